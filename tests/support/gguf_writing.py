"""What the test GGUF writers (``gguf_*_files.py`` and the writers in test files) and their Q8_0
comparisons share. gguf-py and NumPy only: nothing here uses metalnn.

* `add_tensor` puts one tensor into a ``gguf.GGUFWriter``, float32, float16 or quantized (as llama.cpp's
  converter stores it: ``raw_shape`` / ``raw_dtype`` of the packed blocks);
* `permute` is the converter's ``LlamaModel.permute`` of Q/K rows (llama.cpp's rotary order);
* `ssm_hybrid_type` is the type the converter gives a tensor of a Mamba2 hybrid (``granitehybrid``,
  ``nemotron_h``) in a ``--outtype`` run;
* `expert_projections` gives transformers 5's stacked experts the per-projection names gguf-py's tensor
  table maps to llama.cpp's ``ffn_{gate,up,down}_exps``;
* `finish` writes the header, the metadata and the tensors and closes the file;
* `q8_0_round_trip` is a matrix's Q8_0 quantize-dequantize round trip, checked to be a fixed point: a
  file holding it and a transformers model holding it then hold identical weights, so a Q8_0 file is
  compared with transformers on its round-tripped weights at the float32 tolerance;
* `q8_0_values` puts that round trip into every tensor of a transformers model that the file quantizes.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q


def add_tensor(writer, name, a, qtype=Q.F32):
    """Add ``a`` (float32, rows of whole blocks when quantized) to ``writer`` as tensor ``name``: as it is for
    ``Q.F32``, as float16 for ``Q.F16``, else quantized to ``qtype``."""
    a = np.ascontiguousarray(a)
    if qtype == Q.F32:
        writer.add_tensor(name, a)
    elif qtype == Q.F16:
        writer.add_tensor(name, a.astype(np.float16))
    else:
        q = gguf.quants.quantize(a, qtype)
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)


def permute(w, n_head):
    """llama.cpp's ``LlamaModel.permute`` of Q/K rows ``w`` ``[n_head * head_dim, ...]``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def ssm_hybrid_type(name, shape, qtype):
    """The converter's type for GGUF tensor ``name`` of ``shape`` of a Mamba2 hybrid in a ``--outtype``
    ``qtype`` run: vectors, norms, the router and the ``ssm_*`` tensors F32; other matrices ``qtype``, or F16
    when their rows are no multiple of the 32-value block (stacked experts: their last axis decides too)."""
    if qtype == Q.F32 or len(shape) < 2 or name.endswith(".ffn_gate_inp.weight") or \
            any(f".{stem}" in name for stem in ("ssm_conv1d", "ssm_a", "ssm_d", "ssm_norm")):
        return Q.F32
    return qtype if shape[-1] % 32 == 0 else Q.F16


def expert_projections(hf_name, a):
    """``[(name, array)]`` for state-dict entry ``hf_name`` of a transformers 5 MoE model: the stacked
    ``mlp.experts.gate_up_proj`` ``[E, 2*I, W]`` split into ``mlp.experts.gate_proj.weight`` and
    ``up_proj.weight`` ``[E, I, W]`` (gate rows first, as transformers stores them), ``mlp.experts.down_proj``
    as ``mlp.experts.down_proj.weight``, any other entry as it is."""
    if hf_name.endswith("mlp.experts.gate_up_proj"):
        half = a.shape[1] // 2
        base = hf_name[: -len(".gate_up_proj")]
        return [(f"{base}.gate_proj.weight", np.ascontiguousarray(a[:, :half])),
                (f"{base}.up_proj.weight", np.ascontiguousarray(a[:, half:]))]
    if hf_name.endswith("mlp.experts.down_proj"):
        return [(hf_name + ".weight", a)]
    return [(hf_name, a)]


def finish(writer, path):
    """Write ``writer``'s header, metadata and tensors, close it, and return ``path``."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q8_0_round_trip(a):
    """``a`` (float32, last axis a multiple of 32) quantized to Q8_0 and back; asserts that the result is a fixed
    point (quantizing it again gives it back), so it is exactly what a Q8_0 file of it holds."""
    back = gguf.quants.dequantize(gguf.quants.quantize(a, Q.Q8_0), Q.Q8_0)
    again = gguf.quants.dequantize(gguf.quants.quantize(back, Q.Q8_0), Q.Q8_0)
    np.testing.assert_array_equal(again, back)
    return back


def q8_0_values(hf, quantized, round_trip=None):
    """Replace, in place, every tensor of ``hf``'s state dict for which ``quantized(name, shape)`` holds by its
    Q8_0 round trip (``round_trip(name, array)`` when a family's file stores it in another layout, else
    `q8_0_round_trip`). Returns how many state-dict entries were replaced."""
    n = 0
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            if quantized(name, tuple(p.shape)):
                a = p.numpy().astype(np.float32)
                back = round_trip(name, a) if round_trip else q8_0_round_trip(a)
                p.copy_(torch.from_numpy(np.ascontiguousarray(back).reshape(p.shape)))
                n += 1
    return n

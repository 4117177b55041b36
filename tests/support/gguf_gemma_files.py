"""Tiny gemma2 / gemma3 GGUF files written from transformers models the way llama.cpp's converter writes them.

The transforms follow ggml-org/llama.cpp ``convert_hf_to_gguf.py`` (``conversion/gemma.py``): ``Gemma2Model``
(``+ 1`` on every ``norm.weight``, ``lm_head.weight`` dropped, ``set_gguf_parameters``: the soft caps and the
sliding window, no RoPE base) and ``Gemma3Model`` (``+ 1`` on every ``norm.weight``, the base class's
``set_gguf_parameters``: ``rope.freq_base`` of the global layers, ``rope.freq_base_swa`` of the local ones, linear
rope scaling; the final soft cap when set, the sliding window). Names come from gguf-py's own table
(``gguf.get_tensor_name_map``). Nothing here uses metalnn.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from gguf_writing import add_tensor, finish


def converted_tensors(model, arch):
    """``[(GGUF name, float32 array)]`` of ``model`` as the converter emits them for ``arch``."""
    n = model.config.num_hidden_layers
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n)
    out = []
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name == "lm_head.weight" and (arch == "gemma2" or model.config.tie_word_embeddings):
            continue
        if name.endswith("norm.weight"):
            t = t + 1
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        out.append((new, t.contiguous().numpy().astype(np.float32)))
    return out


def quantizable(name, shape):
    """Whether the Q8_0 files store this tensor quantized: matrices whose rows split into 32-value blocks (norms
    stay float32, as llama.cpp keeps them)."""
    return len(shape) == 2 and shape[-1] % 32 == 0


def write(path, model, arch, *, qtype=Q.F32, metadata=None):
    """Write ``model`` as an ``arch`` (``gemma2`` / ``gemma3``) GGUF file (tensors ``qtype`` where `quantizable`,
    else F32). ``metadata`` overrides keys (``{key: (value, GGUFValueType)}``; None removes the key)."""
    h = model.config.to_dict()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(h["num_hidden_layers"])
    w.add_context_length(h["max_position_embeddings"])
    w.add_embedding_length(h["hidden_size"])
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_head_count_kv(h["num_key_value_heads"])
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    w.add_key_length(h["head_dim"])
    w.add_value_length(h["head_dim"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(h["attn_logit_softcapping"])
        w.add_final_logit_softcapping(h["final_logit_softcapping"])
        w.add_sliding_window(h["sliding_window"])
    else:
        rope = h["rope_parameters"]
        full, local = rope["full_attention"], rope["sliding_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(local["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        if h.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(h["final_logit_softcapping"])
        if h.get("sliding_window_pattern") != 1:
            w.add_sliding_window(h["sliding_window"])
    p = arch + "."
    for key, (value, vtype) in (metadata or {}).items():
        w.kv_data[0].pop(p + key, None)
        if value is not None:
            w.add_key_value(p + key, value, vtype)
    for name, a in converted_tensors(model, arch):
        add_tensor(w, name, a, qtype if quantizable(name, a.shape) else Q.F32)
    return finish(w, path)

"""Tiny ``phi3`` GGUF files written from transformers models the way llama.cpp's converter writes them.

The transforms follow ggml-org/llama.cpp ``conversion/phi.py`` ``Phi3MiniModel`` (as shipped with the
``convert_hf_to_gguf.py`` of the llama.cpp checkout this project verifies against): no tensor is transformed
(``qkv_proj`` -> ``attn_qkv``, ``gate_up_proj`` -> ``ffn_up``, by gguf-py's own table), ``set_gguf_parameters``
(context length, ``rope.scaling.original_context_length``, ``rope.dimension_count =
int(partial_rotary_factor * hidden) // heads``, ``attention.sliding_window`` 0 for none, no key length) and
``generate_extra_tensors`` (LongRoPE's factors as ``rope_factors_long`` / ``rope_factors_short``, its attention
factor ``sqrt(1 + log(s) / log(original))`` as ``rope.scaling.attn_factor``). Nothing here uses metalnn.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from gguf_writing import add_tensor, finish


def converted_tensors(model):
    """``[(GGUF name, float32 array)]`` of ``model`` as the converter emits them."""
    h = model.config.to_dict()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, h["num_hidden_layers"])
    out = []
    for name, t in model.state_dict().items():
        if h["tie_word_embeddings"] and name == "lm_head.weight":
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        out.append((new, t.detach().float().contiguous().numpy().astype(np.float32)))
    rope = h.get("rope_parameters") or {}
    if rope.get("long_factor"):
        out.append(("rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32)))
        out.append(("rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32)))
    return out


def quantizable(name, shape):
    """Whether the Q8_0 files store this tensor quantized: matrices whose rows split into 32-value blocks."""
    return len(shape) >= 2 and shape[-1] % 32 == 0 and "norm" not in name


def write(path, model, *, qtype=Q.F32):
    """Write ``model`` as a ``phi3`` GGUF file (tensors ``qtype`` where `quantizable`, else F32)."""
    h = model.config.to_dict()
    rope = h.get("rope_parameters") or {}
    hidden, heads = h["hidden_size"], h["num_attention_heads"]
    original = h["original_max_position_embeddings"]
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(h["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(h["intermediate_size"])
    w.add_block_count(h["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(h["num_key_value_heads"])
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_sliding_window(h.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = h["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
    for name, a in converted_tensors(model):
        add_tensor(w, name, a, qtype if quantizable(name, a.shape) else Q.F32)
    return finish(w, path)

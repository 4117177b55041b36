"""Tiny ``lfm2`` GGUF files written from transformers' ``Lfm2ForCausalLM`` the way llama.cpp's converter
writes them.

The transforms follow ``convert_hf_to_gguf.py`` (``conversion/lfm2.py``, ``LFM2Model``):
``set_gguf_parameters`` (``attention.head_count_kv`` one count per layer, 0 on ``conv`` layers;
``feed_forward_length`` the adjusted width of ``_add_feed_forward_length``; ``shortconv.l_cache``;
``norm_eps`` as the RMS epsilon), ``conv.conv.weight`` squeezed to ``[C, L]``; names from gguf-py's
own table (``gguf.get_tensor_name_map``: ``embedding_norm`` -> ``token_embd_norm``, ``operator_norm``
-> ``attn_norm``, ``conv.*`` -> ``shortconv.*``, ...); a tied head is not written. With ``Q8_0`` the
2-D matrices whose rows hold whole 32-value blocks are quantized, everything else (norms, the
convolution, biases) stays F32, as the converter decides. Nothing here uses metalnn.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from gguf_writing import add_tensor, finish


def converter_ff_width(h: dict) -> int:
    """``LFM2Model._add_feed_forward_length``: the width llama.cpp stores (rounded to ``block_multiple_of``
    whether or not a multiplier is set)."""
    ff = h["intermediate_size"]
    if h["block_auto_adjust_ff_dim"]:
        ff = int(2 * ff / 3)
        if h["block_ffn_dim_multiplier"] is not None:
            ff = int(h["block_ffn_dim_multiplier"] * ff)
        m = h["block_multiple_of"]
        ff = m * ((ff + m - 1) // m)
    return ff


def write_lfm2_gguf(path, hf, qtype=Q.F32):
    """``hf`` (a transformers ``Lfm2ForCausalLM``) as an ``lfm2`` GGUF file at ``path``; returns ``path``."""
    c = hf.config
    h = c.to_dict()
    n = c.num_hidden_layers
    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_block_count(n)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(converter_ff_width(h))
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t != "conv" else 0 for t in c.layer_types])
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_shortconv_l_cache(c.conv_L_cache)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, n)
    for hf_name, p in hf.state_dict().items():
        if c.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        a = p.detach().numpy().astype(np.float32)
        if "conv.conv" in hf_name:  # (the converter squeezes any such tensor: a conv bias would fail there)
            a = a.squeeze(1)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        quantized = a.ndim == 2 and not name.endswith("_norm.weight") and a.shape[1] % 32 == 0
        add_tensor(w, name, a, qtype if quantized else Q.F32)
    return finish(w, path)

"""Tiny ``nemotron_h`` / ``nemotron_h_moe`` GGUF files written from transformers' NemotronHForCausalLM
the way llama.cpp's converter writes them.

The transforms follow ``convert_hf_to_gguf.py``'s ``NemotronHModel`` (``conversion/nemotron.py``, a
``GraniteHybridModel`` of ``conversion/granite.py`` with ``Mamba2Model`` of ``conversion/mamba.py``):
``A_log`` -> ``ssm_a = -exp(A_log)`` ``[H, 1]``, ``D`` -> ``[H, 1]``, ``dt_bias`` -> ``ssm_dt.bias``,
``conv1d.weight`` squeezed, ``mixer.norm.weight`` -> ``[G, I / G]``; the experts stacked into
``ffn_{up,down}_exps``, the router's correction bias as ``exp_probs_b.bias``; per-layer
``head_count_kv`` and ``feed_forward_length``; the architecture ``nemotron_h_moe`` when the config
has ``num_experts_per_tok``.

Two variants, as the converter behaves with the two forms of config it may read:

* ``hub_config=True`` (the Hub's config.json: a ``hybrid_override_pattern`` string): the attention
  layers are known, their Q and K rows permuted (Llama's rotary order) and listed in
  ``head_count_kv``, the MLP or expert widths in ``feed_forward_length``; ``rope.scaling.finetuned``
  false and a context length of 2**20 (no rotary embedding in a hybrid);
* ``hub_config=False`` (transformers 5's ``AutoConfig``: a ``layers_block_type`` list and every
  default, ``num_experts_per_tok`` included): always ``nemotron_h_moe``, every ``head_count_kv``
  entry 0, Q and K left as they are, ``feed_forward_length`` only on the expert layers,
  ``rope.scaling.finetuned`` true and the config's context length (it sees no Mamba2 layers).

Names come from gguf-py's own table. Nothing here uses metalnn.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from gguf_writing import add_tensor, finish, permute, ssm_hybrid_type


def is_moe(model, hub_config):
    c = model.config
    return "moe" in c.layers_block_type or not hub_config


def converted_tensors(model, hub_config=True):
    """``{GGUF name: float32 array}`` as the converter writes ``model``'s state dict."""
    c = model.config
    kinds = c.layers_block_type
    arch = gguf.MODEL_ARCH.NEMOTRON_H_MOE if is_moe(model, hub_config) else gguf.MODEL_ARCH.NEMOTRON_H
    names = gguf.get_tensor_name_map(arch, len(kinds))
    inner = c.mamba_num_heads * c.mamba_head_dim
    out = {}
    for name, p in model.state_dict().items():
        a = p.detach().float().numpy()
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        kind = kinds[bid] if bid is not None else None
        if name.endswith(("mixer.experts.up_proj", "mixer.experts.down_proj")):
            out[f"blk.{bid}.ffn_{name.rsplit('.', 1)[1].split('_')[0]}_exps.weight"] = np.ascontiguousarray(a)
            continue
        if name.endswith("gate.e_score_correction_bias"):
            out[f"blk.{bid}.exp_probs_b.bias"] = a
            continue
        if name.endswith(".dt_bias"):
            out[f"blk.{bid}.ssm_dt.bias"] = a
            continue
        if name.endswith(".A_log"):
            a = (-torch.exp(p.detach().float())).numpy().reshape(-1, 1)
        elif name.endswith("mixer.D"):
            a = a.reshape(-1, 1)
        elif name.endswith("mixer.conv1d.weight"):
            a = a.squeeze()
        elif kind == "linear_attention" and name.endswith("mixer.norm.weight"):
            a = a.reshape(c.n_groups, inner // c.n_groups)
        elif hub_config and name.endswith("q_proj.weight"):
            a = permute(a, c.num_attention_heads)
        elif hub_config and name.endswith("k_proj.weight"):
            a = permute(a, c.num_key_value_heads)
        hf_name = name.replace("model.", "backbone.", 1)
        out[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = np.ascontiguousarray(a, dtype=np.float32)
    return out


def write(path, model, *, qtype=Q.F32, hub_config=True):
    """``model`` as a GGUF file of llama.cpp's converter (F32, or ``qtype`` for the quantizable
    matrices), in the ``hub_config`` variant (see the module docstring)."""
    c = model.config
    kinds = c.layers_block_type
    moe = is_moe(model, hub_config)
    arch = "nemotron_h_moe" if moe else "nemotron_h"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(len(kinds))
    w.add_context_length(2 ** 20 if hub_config else c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    if moe:  # the widths of the expert layers, or of the MLP layers
        w.add_feed_forward_length([c.moe_intermediate_size if k == "moe" else 0 for k in kinds])
    else:
        w.add_feed_forward_length([c.intermediate_size if k == "mlp" else 0 for k in kinds])
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if k == "full_attention" and hub_config else 0 for k in kinds])
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_state_size(c.ssm_state_size)
    w.add_ssm_group_count(c.n_groups)
    w.add_ssm_inner_size(c.mamba_num_heads * c.mamba_head_dim)
    w.add_ssm_time_step_rank(c.mamba_num_heads)
    w.add_rope_scaling_finetuned(not hub_config)  # (GraniteHybridModel's rule: no rope once it sees Mamba2 layers)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if moe:
        w.add_expert_count(c.n_routed_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.moe_shared_expert_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_expert_weights_norm(c.norm_topk_prob)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        if c.moe_latent_size is not None:
            w.add_moe_latent_size(c.moe_latent_size)
    for name, a in converted_tensors(model, hub_config).items():
        add_tensor(w, name, a, ssm_hybrid_type(name, a.shape, qtype))
    return finish(w, path)


def q8_0_values(model):
    """``model`` with every matrix the Q8_0 file stores as Q8_0 (or F16) replaced by that round trip
    (a fixed point: the file and ``model`` then hold the same values)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2 or name.endswith("gate.weight") or "conv1d" in name:
                continue
            a = p.detach().float().numpy()
            if a.shape[-1] % 32:
                b = a.astype(np.float16).astype(np.float32)
            else:
                b = gguf.quants.dequantize(gguf.quants.quantize(a, Q.Q8_0), Q.Q8_0).reshape(a.shape)
            p.copy_(torch.tensor(b))
    return model

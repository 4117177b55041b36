"""Tiny ``granitehybrid`` GGUF files written from transformers' GraniteMoeHybridForCausalLM the way
llama.cpp's converter writes them.

The transforms follow ``convert_hf_to_gguf.py``'s ``GraniteHybridModel`` (``conversion/granite.py``)
with ``Mamba2Model`` (``conversion/mamba.py``), ``GraniteMoeModel`` and ``LlamaModel``:
``A_log`` -> ``ssm_a = -exp(A_log)`` ``[H, 1]``, ``D`` -> ``[H, 1]``, ``dt_bias`` -> ``ssm_dt.bias``,
``conv1d.weight`` squeezed, ``mamba.norm.weight`` -> ``[G, I / G]``; the experts' ``input_linear``
split into ``ffn_gate_exps`` / ``ffn_up_exps``; the shared MLP's ``input_linear`` split into
``ffn_gate_shexp`` / ``ffn_up_shexp`` (``ffn_gate`` / ``ffn_up`` without experts, and
``output_linear`` -> ``ffn_down``); Q and K rows permuted for llama.cpp's rotary embedding;
``head_count_kv`` one entry per layer (0 on Mamba2 layers); the multipliers as ``attention.scale``,
``embedding_scale``, ``residual_scale``, ``logit_scale``; no rotary embedding for a hybrid
(``rope.scaling.finetuned`` false, context length 2**20). Names come from gguf-py's own table.
Nothing here uses metalnn.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from gguf_writing import add_tensor, finish, permute, ssm_hybrid_type


#: transformers 5's in-memory expert names -> the checkpoint's (what the converter reads)
LEGACY = {"block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
          "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
          "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight"}


def converted_tensors(model):
    """``{GGUF name: float32 array}`` as the converter writes ``model``'s state dict."""
    c = model.config
    kinds = c.layer_types
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, c.num_hidden_layers)
    experts = bool(c.num_local_experts)
    groups, inner = c.mamba_n_groups, c.mamba_n_heads * c.mamba_d_head
    out = {}

    def add(hf_name, a):
        out[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = np.ascontiguousarray(a, dtype=np.float32)

    for name, p in model.state_dict().items():
        for new, old in LEGACY.items():  # the checkpoint names the converter reads
            if name.endswith(new):
                name = name[: -len(new)] + old
        if c.tie_word_embeddings and name == "lm_head.weight":
            continue
        a = p.detach().float().numpy()
        if name.endswith("block_sparse_moe.input_linear.weight"):
            half = a.shape[1] // 2
            bid = name.split(".")[2]
            out[f"blk.{bid}.ffn_gate_exps.weight"] = np.ascontiguousarray(a[:, :half])
            out[f"blk.{bid}.ffn_up_exps.weight"] = np.ascontiguousarray(a[:, half:])
            continue
        if name.endswith("shared_mlp.input_linear.weight"):
            half = a.shape[0] // 2
            bid = name.split(".")[2]
            sfx = "_shexp" if experts else ""
            out[f"blk.{bid}.ffn_gate{sfx}.weight"] = np.ascontiguousarray(a[:half])
            out[f"blk.{bid}.ffn_up{sfx}.weight"] = np.ascontiguousarray(a[half:])
            continue
        if name.endswith("shared_mlp.output_linear.weight"):
            out[f"blk.{name.split('.')[2]}.ffn_down{'_shexp' if experts else ''}.weight"] = a
            continue
        if name.endswith(".dt_bias"):
            name = name[: -len(".dt_bias")] + ".dt_proj.bias"
        if name.endswith(".A_log"):
            a = (-torch.exp(p.detach().float())).numpy().reshape(-1, 1)
        elif name.endswith("mamba.D"):
            a = a.reshape(-1, 1)
        elif name.endswith("mamba.conv1d.weight"):
            a = a.squeeze()
        elif name.endswith("mamba.norm.weight"):
            a = a.reshape(groups, inner // groups)
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            a = permute(a, c.num_attention_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            a = permute(a, c.num_key_value_heads)
        add(name, a)
    assert len(kinds) == c.num_hidden_layers
    return out


def write(path, model, *, qtype=Q.F32):
    """``model`` as a ``granitehybrid`` GGUF file (F32, or ``qtype`` for the quantizable matrices)."""
    c = model.config
    kinds = ["attention" if k in ("attention", "full_attention") else "mamba" for k in c.layer_types]
    w = gguf.GGUFWriter(str(path), "granitehybrid")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(2 ** 20)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if k == "attention" else 0 for k in kinds])
    w.add_rope_freq_base(float((c.rope_parameters or {}).get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    w.add_attention_scale(c.attention_multiplier)
    w.add_embedding_scale(c.embedding_multiplier)
    w.add_residual_scale(c.residual_multiplier)
    w.add_logit_scale(c.logits_scaling)
    w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_group_count(c.mamba_n_groups)
    w.add_ssm_inner_size(c.mamba_n_heads * c.mamba_d_head)
    w.add_ssm_time_step_rank(c.mamba_n_heads)
    w.add_rope_scaling_finetuned(False)
    for name, a in converted_tensors(model).items():
        add_tensor(w, name, a, ssm_hybrid_type(name, a.shape, qtype))
    return finish(w, path)


def q8_0_values(model):
    """``model`` with every matrix the Q8_0 file stores as Q8_0 (or F16) replaced by that round trip
    (a fixed point: the file and ``model`` then hold the same values)."""
    kinds = {name: ssm_hybrid_type(name, a.shape, Q.Q8_0) for name, a in converted_tensors(model).items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim < 2 or name.endswith("router.weight") or "conv1d" in name:
                continue
            a = p.detach().float().numpy()
            kind = Q.Q8_0 if a.shape[-1] % 32 == 0 else Q.F16
            assert kind in kinds.values()
            if kind == Q.F16:
                b = a.astype(np.float16).astype(np.float32)
            else:
                b = gguf.quants.dequantize(gguf.quants.quantize(a, Q.Q8_0), Q.Q8_0).reshape(a.shape)
            p.copy_(torch.tensor(b))
    return model

"""Tiny qwen3next / qwen35 / qwen35moe GGUF files written from transformers models the way llama.cpp's converter
writes them.

The transforms follow ggml-org/llama.cpp ``convert_hf_to_gguf.py`` at commit
0024aa7417efd50a7c2a79e049dfbbbceb0beaaf: ``Qwen3NextModel`` (``A_log`` -> ``-exp(A_log)``, ``dt_bias`` ->
``dt_proj.bias``, ``conv1d`` squeezed, ``+ 1`` on every ``norm.weight`` but ``linear_attn.norm``, ``in_proj_qkvz``
split into ``attn_qkv`` and ``attn_gate``, ``set_gguf_parameters``), ``Qwen2MoeModel`` (``experts.gate_up_proj``
split into gate and up, ``experts.down_proj`` kept) and ``_LinearAttentionVReorderBase`` / ``Qwen3_5TextModel``
(value heads from grouped to tiled order when there are fewer key than value heads); ``Qwen3_5MoeTextModel`` is
both (Qwen3.5's projections and head order, Qwen3-Next's experts; no ``feed_forward_length``: no dense layers).
Names come from gguf-py's own table (``gguf.get_tensor_name_map``). Nothing here uses metalnn.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from gguf_writing import add_tensor, finish


def reorder_v_heads(t, dim, num_k_heads, num_v_per_k, head_dim):
    """The converter's ``_reorder_v_heads``: value heads along ``dim`` from grouped to tiled order."""
    shape = list(t.shape)
    dim = dim % len(shape)
    t = t.reshape(*shape[:dim], num_k_heads, num_v_per_k, head_dim, *shape[dim + 1:])
    perm = list(range(t.ndim))
    perm[dim], perm[dim + 1] = perm[dim + 1], perm[dim]
    return t.permute(*perm).contiguous().reshape(*shape)


def _v_reorder(name, t, h):
    """``_LinearAttentionVReorderBase.modify_tensors`` (qwen35 and qwen35moe)."""
    nk, nv = h["linear_num_key_heads"], h["linear_num_value_heads"]
    if nk == nv or "linear_attn." not in name:
        return t
    dk, dv, r = h["linear_key_head_dim"], h["linear_value_head_dim"], nv // nk
    if ".in_proj_qkv." in name:
        return torch.cat([t[:2 * nk * dk], reorder_v_heads(t[2 * nk * dk:], 0, nk, r, dv)], dim=0)
    if ".in_proj_z." in name:
        return reorder_v_heads(t, 0, nk, r, dv)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return reorder_v_heads(t, 0, nk, r, 1)
    if ".A_log" in name or ".dt_bias" in name:
        return reorder_v_heads(t.unsqueeze(-1), 0, nk, r, 1).squeeze(-1)
    if ".conv1d" in name:
        t = t.squeeze()
        return torch.cat([t[:2 * nk * dk], reorder_v_heads(t[2 * nk * dk:], 0, nk, r, dv)], dim=0)
    if ".out_proj." in name:
        return reorder_v_heads(t, 1, nk, r, dv)
    return t


def _split_qkvz(t, h):
    """``Qwen3NextModel``: ``in_proj_qkvz`` rows ``[q, k, v, z]`` per key head -> (all q, k, v rows; all z rows)."""
    nk, dk = h["linear_num_key_heads"], h["linear_key_head_dim"]
    vz = h["linear_num_value_heads"] // nk * h["linear_value_head_dim"]
    hidden = h["hidden_size"]
    t = t.permute(1, 0).contiguous().view(-1, nk, 2 * dk + 2 * vz)
    q, k, v, z = torch.split(t, [dk, dk, vz, vz], dim=-1)
    qkv = torch.cat([x.contiguous().view(hidden, -1) for x in (q, k, v)], dim=-1).permute(1, 0).contiguous()
    return qkv, z.contiguous().view(hidden, -1).permute(1, 0).contiguous()


def converted_tensors(model, arch):
    """``[(GGUF name, float32 array)]`` of ``model`` as the converter emits them for ``arch``."""
    h = model.config.to_dict()
    n = h["num_hidden_layers"]
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n)
    out = []
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name.startswith("mtp") or (h["tie_word_embeddings"] and name == "lm_head.weight"):
            continue
        if arch in ("qwen35", "qwen35moe"):
            t = _v_reorder(name, t, h)
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if "in_proj_qkvz.weight" in name:
            qkv, z = _split_qkvz(t, h)
            out += [(f"blk.{bid}.attn_qkv.weight", qkv), (f"blk.{bid}.attn_gate.weight", z)]
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            f = t.shape[-2] // 2
            base = name.removesuffix(".gate_up_proj")
            out += [(names.get_name(f"{base}.gate_proj.weight", try_suffixes=(".weight",)), t[..., :f, :]),
                    (names.get_name(f"{base}.up_proj.weight", try_suffixes=(".weight",)), t[..., f:, :])]
            continue
        if name.endswith("mlp.experts.down_proj"):
            name += ".weight"
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        out.append((new, t))
    return [(k, v.contiguous().numpy().astype(np.float32)) for k, v in out]


def quantizable(name, shape):
    """Whether the Q8_0 files store this tensor quantized (``name``: GGUF's or Hugging Face's): matrices (and
    stacked experts) whose rows split into 32-value blocks; norms, biases, ``ssm_a``, the convolution and the
    routers (``ffn_gate_inp``, ``ffn_gate_inp_shexp``: ``mlp.gate``, ``mlp.shared_expert_gate``) stay float32 as
    llama.cpp keeps them."""
    router = "ffn_gate_inp" in name or name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight"))
    return len(shape) >= 2 and shape[-1] % 32 == 0 and "conv1d" not in name and "norm" not in name and not router


def write(path, model, arch, *, qtype=Q.F32, metadata=None, drop=()):
    """Write ``model`` as a ``arch`` GGUF file (tensors ``qtype`` where `quantizable`, else F32). ``metadata``
    overrides keys (``{key: (value, GGUFValueType)}``); tensors named in ``drop`` are left out."""
    h = model.config.to_dict()
    w = gguf.GGUFWriter(str(path), arch)
    p = arch + "."
    rope = h.get("rope_parameters") or {}
    head_dim = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
    w.add_block_count(h["num_hidden_layers"])
    w.add_context_length(h["max_position_embeddings"])
    w.add_embedding_length(h["hidden_size"])
    if "intermediate_size" in h:  # (Qwen3.5-MoE has none)
        w.add_feed_forward_length(h["intermediate_size"])
    w.add_head_count(h["num_attention_heads"])
    w.add_head_count_kv(h["num_key_value_heads"])
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(h["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch in ("qwen3next", "qwen35moe"):
        w.add_expert_count(h["num_experts"])
        w.add_expert_used_count(h["num_experts_per_tok"])
        w.add_expert_feed_forward_length(h["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(h["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(h["linear_conv_kernel_dim"])
    w.add_ssm_state_size(h["linear_key_head_dim"])
    w.add_ssm_group_count(h["linear_num_key_heads"])
    w.add_ssm_time_step_rank(h["linear_num_value_heads"])
    w.add_ssm_inner_size(h["linear_value_head_dim"] * h["linear_num_value_heads"])
    # released config.json files carry full_attention_interval; transformers' to_dict keeps only layer_types
    w.add_full_attention_interval(h.get("full_attention_interval") or h["layer_types"].index("full_attention") + 1)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", h.get("partial_rotary_factor", 0.25))))
    for key, (value, vtype) in (metadata or {}).items():
        w.kv_data[0].pop(p + key, None)
        if value is not None:
            w.add_key_value(p + key, value, vtype)
    for name, a in converted_tensors(model, arch):
        if name in drop:
            continue
        add_tensor(w, name, a, qtype if quantizable(name, a.shape) else Q.F32)
    return finish(w, path)

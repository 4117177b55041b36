"""``qwen35`` GGUF files (the dense Qwen3.5 text model): the hybrid layout of `hybrid` with Qwen3.5's
four linear-attention input projections (``attn_qkv``, ``attn_gate``, ``ssm_beta``, ``ssm_alpha``).

With fewer key than value heads, llama.cpp's converter (``_LinearAttentionVReorderBase``) moves the
value heads of ``in_proj_qkv`` (v rows), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``A_log``,
``dt_bias``, the v channels of ``conv1d`` and the columns of ``out_proj`` from grouped order (by key
head) to tiled order; `grouped_order` turns them back. ``qwen35moe`` files (Qwen3.5-MoE)
are read by `qwen35moe`.
"""

from __future__ import annotations

import numpy as np

from .hybrid import HybridConverter, Parts, col_blocks, put, rows


def grouped_order(n_k: int, n_v: int, dim: int) -> np.ndarray:
    """Index turning llama.cpp's tiled value-head order back into grouped order: ``grouped = tiled[index]`` along
    an axis of ``n_v * dim`` entries (``dim`` per value head, ``n_v // n_k`` value heads per key head)."""
    r = n_v // n_k
    tiled_from_grouped = np.arange(n_v * dim).reshape(n_k, r, dim).transpose(1, 0, 2).reshape(-1)
    return np.argsort(tiled_from_grouped)


class Qwen35Converter(HybridConverter):
    """``qwen35`` files: separate projections, value heads back in grouped order."""

    architecture = "qwen35"

    def value_order(self, c: dict, dim: int):
        nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        return grouped_order(nk, nv, dim) if nk != nv else None

    def linear_projections(self, parts: Parts, i: int, c: dict, out: dict):
        """``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` / ``out_proj`` with the value heads back
        in grouped order."""
        nk, dk, dv = c["linear_num_key_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
        nv = c["linear_num_value_heads"]
        pre = f"model.layers.{i}.linear_attn."
        qkv = parts.take(f"blk.{i}.attn_qkv")
        if qkv is not None:
            index = np.concatenate([np.arange(2 * nk * dk), 2 * nk * dk + grouped_order(nk, nv, dv)])
            put(out, pre + "in_proj_qkv", rows(qkv, index))
        for stem, name, dim in (("attn_gate", "in_proj_z", dv), ("ssm_beta", "in_proj_b", 1),
                                ("ssm_alpha", "in_proj_a", 1)):
            p = parts.take(f"blk.{i}.{stem}")
            if p is not None:
                put(out, pre + name, rows(p, grouped_order(nk, nv, dim)))
        p = parts.take(f"blk.{i}.ssm_out")
        if p is not None:
            put(out, pre + "out_proj", col_blocks(p, grouped_order(nk, nv, 1), dv))

"""``qwen3next`` GGUF files (Qwen3-Next): the hybrid layout of `hybrid` plus what llama.cpp's
``Qwen3NextModel`` converter does to this model's own tensors, undone:

* ``in_proj_qkvz`` (rows ``[q, k, v, z]`` per key head) is split into ``attn_qkv`` (all q rows, all k
  rows, all v rows) and ``attn_gate`` (all z rows); ``in_proj_ba`` is kept as ``ssm_ba``;
* experts are stacked per layer (``ffn_{gate,up,down}_exps``, or a fused ``ffn_gate_up_exps``), the
  shared expert is ``ffn_*_shexp`` and its gate ``ffn_gate_inp_shexp``. Experts load in float
  (metalnn keeps experts in float).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .hybrid import HybridConverter, Parts, cat_rows, dense, put, rows

#: the router and the shared expert (GGUF stem inside the block -> Hugging Face module)
ROUTER = {"ffn_gate_inp": "mlp.gate"}
SHARED_EXPERT = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                 "ffn_down_shexp": "mlp.shared_expert.down_proj"}


class Qwen3NextConverter(HybridConverter):
    """``qwen3next`` files: grouped ``in_proj_qkvz`` / ``in_proj_ba`` rebuilt, experts stacked."""

    architecture = "qwen3next"

    def extra_config(self, config: dict) -> dict:
        """The hybrid keys plus the experts (layers without a router are dense: ``mlp_only_layers``)."""
        layers = self.meta_int("block_count")
        dense_layers = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in self.header.tensors]
        return dict(super().extra_config(config), num_experts=self.meta_int("expert_count"),
                    num_experts_per_tok=self.meta_int("expert_used_count"),
                    moe_intermediate_size=self.meta_int("expert_feed_forward_length"),
                    shared_expert_intermediate_size=self.meta_int("expert_shared_feed_forward_length", 0),
                    norm_topk_prob=bool(self.header.metadata.get(self.prefix + "expert_weights_norm", True)),
                    decoder_sparse_step=1, mlp_only_layers=dense_layers)

    def linear_projections(self, parts: Parts, i: int, c: dict, out: dict):
        pre = f"model.layers.{i}.linear_attn."
        put(out, pre + "in_proj_qkvz", self.qkvz(parts, i, c))
        for stem, name in (("ssm_ba", "in_proj_ba"), ("ssm_out", "out_proj")):
            p = parts.take(f"blk.{i}.{stem}")
            if p is not None:
                put(out, pre + name, p)

    def qkvz(self, parts: Parts, i: int, c: dict) -> dict:
        """``in_proj_qkvz`` of layer ``i`` rebuilt from ``attn_qkv`` and ``attn_gate`` (rows back to
        ``[q, k, v, z]`` per key head), or ``ssm_in`` as older converters wrote it."""
        old = parts.take(f"blk.{i}.ssm_in", optional=True)
        if old is not None:
            return old
        qkv, z = parts.take(f"blk.{i}.attn_qkv"), parts.take(f"blk.{i}.attn_gate")
        if qkv is None or z is None:
            return {}
        nk, dk = c["linear_num_key_heads"], c["linear_key_head_dim"]
        vz = c["linear_num_value_heads"] // nk * c["linear_value_head_dim"]
        both = cat_rows(qkv, z)
        q0, k0, v0, z0 = 0, nk * dk, 2 * nk * dk, 2 * nk * dk + nk * vz
        index = [np.arange(start + g * size, start + (g + 1) * size)
                 for g in range(nk) for start, size in ((q0, dk), (k0, dk), (v0, vz), (z0, vz))]
        return rows(both, np.concatenate(index))

    def feed_forward(self, parts: Parts, i: int, out: dict):
        """Experts where the block has a router (``ffn_gate_inp``), the dense SwiGLU elsewhere."""
        if not parts.has(f"blk.{i}.ffn_gate_inp"):
            return super().feed_forward(parts, i, out)
        self.experts(parts, i, out)
        for stem, name in {**ROUTER, **SHARED_EXPERT}.items():
            p = parts.take(f"blk.{i}.{stem}", optional=stem in SHARED_EXPERT)
            if p is not None:
                put(out, f"model.layers.{i}.{name}", p)

    def experts(self, parts: Parts, i: int, out: dict):
        """Stacked expert weights (dequantized) as ``mlp.experts.gate_up_proj`` ``[E, 2*I, W]`` and
        ``mlp.experts.down_proj`` ``[E, W, I]``, and the shared expert's gate ``[1, W]``."""
        pre = f"model.layers.{i}.mlp.experts."
        fused = parts.take(f"blk.{i}.ffn_gate_up_exps", optional=True)
        if fused is not None:
            out[pre + "gate_up_proj"] = dense(fused)
        else:
            gate, up = parts.take(f"blk.{i}.ffn_gate_exps"), parts.take(f"blk.{i}.ffn_up_exps")
            if gate is not None and up is not None:
                out[pre + "gate_up_proj"] = mx.concatenate([dense(gate), dense(up)], axis=1)
        down = parts.take(f"blk.{i}.ffn_down_exps")
        if down is not None:
            out[pre + "down_proj"] = dense(down)
        shared_gate = parts.take(f"blk.{i}.ffn_gate_inp_shexp", optional=True)
        if shared_gate is not None:
            put(out, f"model.layers.{i}.mlp.shared_expert_gate",
                {k: (a.reshape(1, -1) if a.ndim == 1 else a) for k, a in shared_gate.items()})

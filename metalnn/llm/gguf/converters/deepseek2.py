"""``deepseek2`` GGUF files (DeepSeek-V3 and its relatives), as llama.cpp's ``DeepseekV2Model``
converter writes them, read as a Hugging Face ``DeepseekV3ForCausalLM`` checkpoint.

What the converter does and how it is undone here:

* metadata: ``head_count_kv`` 1 and ``key_length`` / ``value_length`` of the latent (llama.cpp runs
  latent attention as one shared head); the per-head sizes are ``key_length_mla`` (``qk_nope_head_dim
  + qk_rope_head_dim``), ``value_length_mla`` (``v_head_dim``) and ``rope.dimension_count``; older
  files without the ``_mla`` keys give them as ``key_length`` / ``value_length``;
* ``kv_b_proj`` ``[H * (nope + v), kv_lora_rank]`` is split per head into ``attn_k_b``
  ``[H, kv_lora_rank, nope]`` (transposed) and ``attn_v_b`` ``[H, v, kv_lora_rank]``: both are decoded
  to float32, the key half transposed back and the two interleaved per head again (older files
  keep one ``attn_kv_b``: taken as it is);
* the router's correction bias ``mlp.gate.e_score_correction_bias`` is ``exp_probs_b.bias``; the
  experts are stacked per layer (``ffn_{gate,up,down}_exps``, regrouped into ``mlp.experts.gate_up_proj``
  / ``down_proj`` in float32, as metalnn keeps experts); shared experts are ``ffn_*_shexp``;
* routing: ``expert_gating_func`` (llama.cpp reads an absent one as softmax, DeepSeek-V2's; such
  files are refused by the model), ``expert_weights_scale`` (absent: 1), ``expert_weights_norm``
  (absent: false), ``expert_group_count`` / ``expert_group_used_count`` (absent: one group),
  ``leading_dense_block_count`` (the dense layers first).

The rotary features stay in the checkpoints' interleaved order (llama.cpp rotates adjacent pairs):
the config gets ``rope_interleave`` true. The router and ``kv_b_proj`` load in float32 (a quantized
one decoded); the other matrices stay as stored.
"""

from __future__ import annotations

import mlx.core as mx

from ....errors import WeightLoadError
from ..convert import BLOCK_NAMES, Converter

#: gguf-py's DeepSeek-2 tensor stems inside ``blk.N.`` -> Hugging Face names inside ``model.layers.N.``
DEEPSEEK2_NAMES = {
    **BLOCK_NAMES,
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
#: gguf-py's ``ExpertGatingFuncType`` values -> the config's ``scoring_func``
GATING = {1: "softmax", 2: "sigmoid"}


class Deepseek2Converter(Converter):
    """``deepseek2`` files: the tables above plus the regrouped ``kv_b_proj``, experts and router bias."""

    architecture = "deepseek2"
    block_names = DEEPSEEK2_NAMES

    def extra_config(self, config: dict) -> dict:
        meta, p = self.header.metadata, self.prefix
        rope = self.meta_int("rope.dimension_count")
        key = self.meta_int("attention.key_length_mla", self.meta_int("attention.key_length"))
        value = self.meta_int("attention.value_length_mla", self.meta_int("attention.value_length"))
        gating = meta.get(p + "expert_gating_func")
        q_rank = meta.get(p + "attention.q_lora_rank")
        experts = self.meta_int("expert_count", 0)
        out = {
            "num_key_value_heads": config["num_attention_heads"],  # (the file's 1 is the latent's shared head)
            "head_dim": key,
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": key - rope,
            "v_head_dim": value,
            "kv_lora_rank": self.meta_int("attention.kv_lora_rank"),
            "q_lora_rank": None if q_rank is None else int(q_rank),
            "rope_interleave": True,
            "first_k_dense_replace": self.meta_int("leading_dense_block_count", 0),
            "n_routed_experts": experts,
            "num_experts_per_tok": self.meta_int("expert_used_count", 1),
            "moe_intermediate_size": self.meta_int("expert_feed_forward_length"),
            "n_shared_experts": self.meta_int("expert_shared_count", 0),
            "n_group": self.meta_int("expert_group_count", 1),
            "topk_group": self.meta_int("expert_group_used_count", 1),
            "norm_topk_prob": bool(meta.get(p + "expert_weights_norm", False)),
            "routed_scaling_factor": float(meta.get(p + "expert_weights_scale", 1.0)),
            "scoring_func": GATING.get(gating, f"gating function {gating}") if gating is not None else "softmax",
            "topk_method": "noaux_tc",
        }
        if experts <= 0:  # a dense file: every layer dense
            out.update(n_routed_experts=None, first_k_dense_replace=config["num_hidden_layers"])
        return out

    def convert(self, arrays: dict, config: dict) -> dict:
        """The standard renaming, after each layer's split ``kv_b_proj``, stacked experts, router and
        router bias are taken out and rebuilt (a layer missing a part keeps its GGUF names, for a
        strict load to report)."""
        out = {}
        nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
        for i in range(config["num_hidden_layers"]):
            blk, pre = f"blk.{i}.", f"model.layers.{i}."
            if f"{blk}attn_k_b.weight" in arrays and f"{blk}attn_v_b.weight" in arrays:
                k_b = self.dense(arrays, f"{blk}attn_k_b.weight")                     # [H, rank, nope]
                v_b = self.dense(arrays, f"{blk}attn_v_b.weight")                     # [H, v, rank]
                if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[2] != nope or v_b.shape[1] != v:
                    raise WeightLoadError(source=str(self.header.path), mismatched={
                        f"{blk}attn_k_b / attn_v_b": (f"[heads, kv_lora_rank, {nope}] / [heads, {v}, kv_lora_rank]",
                                                      f"{tuple(k_b.shape)} / {tuple(v_b.shape)}")})
                kv = mx.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)               # [H, nope + v, rank]
                out[pre + "self_attn.kv_b_proj.weight"] = kv.reshape(-1, kv.shape[-1])
            for name in (f"{blk}attn_kv_b.weight", f"{blk}ffn_gate_inp.weight"):
                if name in arrays:  # float32 (the router is no Linear; kv_b_proj is read whole)
                    out[self.hf_name(name)] = self.dense(arrays, name)
            if f"{blk}exp_probs_b.bias" in arrays:
                out[pre + "mlp.gate.e_score_correction_bias"] = self.dense(arrays, f"{blk}exp_probs_b.bias")
            fused, down = f"{blk}ffn_gate_up_exps.weight", f"{blk}ffn_down_exps.weight"
            if fused in arrays and down in arrays:
                out[pre + "mlp.experts.gate_up_proj"] = self.dense(arrays, fused)
                out[pre + "mlp.experts.down_proj"] = self.dense(arrays, down)
            else:
                out.update(self.stacked_experts(arrays, i))
        return {**super().convert(arrays, config), **out}

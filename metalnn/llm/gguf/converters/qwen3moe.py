"""``qwen3moe`` GGUF files (Qwen3-MoE), as llama.cpp's ``Qwen3MoeModel`` (a ``Qwen2MoeModel``) writes
them: Qwen3's tensors (standard names plus ``attn_q_norm`` / ``attn_k_norm``, no transforms), the
router as ``ffn_gate_inp`` and each layer's experts stacked into ``ffn_gate_exps`` / ``ffn_up_exps``
``[E, I, W]`` and ``ffn_down_exps`` ``[E, W, I]`` (row-major), undone here into ``mlp.experts.gate_up_proj``
``[E, 2*I, W]`` and ``mlp.experts.down_proj``. Experts load in float (metalnn keeps experts in float:
quantized ones are decoded); the other matrices stay as stored.

llama.cpp's ``qwen3moe`` graph always renormalises the chosen experts' weights and attends to every
position, so the config gets ``norm_topk_prob`` true (unless the file says otherwise in
``expert_weights_norm``) and no sliding window; layers without a router are dense (``mlp_only_layers``).
"""

from __future__ import annotations

from ..convert import BLOCK_NAMES, Converter


class Qwen3MoeConverter(Converter):
    """``qwen3moe`` files: Qwen3's tables plus the router; stacked experts regrouped (`convert`)."""

    architecture = "qwen3moe"
    block_names = {**BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                   "ffn_gate_inp": "mlp.gate"}

    def extra_config(self, config: dict) -> dict:
        layers = config["num_hidden_layers"]
        dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in self.header.tensors]
        return {"num_experts": self.meta_int("expert_count"), "num_experts_per_tok": self.meta_int("expert_used_count"),
                "moe_intermediate_size": self.meta_int("expert_feed_forward_length"),
                "norm_topk_prob": bool(self.header.metadata.get(self.prefix + "expert_weights_norm", True)),
                "decoder_sparse_step": 1, "mlp_only_layers": dense, "use_sliding_window": False,
                "sliding_window": None}

    def convert(self, arrays: dict, config: dict) -> dict:
        """The standard renaming, after each layer's ``ffn_{gate,up,down}_exps`` are taken out and
        stacked as ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` (a layer missing one of
        them keeps its GGUF names, for a strict load to report)."""
        experts = {}
        for i in range(config["num_hidden_layers"]):
            experts.update(self.stacked_experts(arrays, i))
        return {**super().convert(arrays, config), **experts}

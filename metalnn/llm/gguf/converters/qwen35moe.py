"""``qwen35moe`` GGUF files (Qwen3.5-MoE): Qwen3.5's hybrid layout (`qwen35`: separate linear-attention input
projections, value heads back from llama.cpp's tiled order to grouped order) with Qwen3-Next's sparse experts
(`qwen3next`: ``ffn_{gate,up,down}_exps`` or a fused ``ffn_gate_up_exps`` stacked per layer, the router
``ffn_gate_inp``, the shared expert ``ffn_*_shexp`` and its gate ``ffn_gate_inp_shexp``).

llama.cpp's ``Qwen3_5MoeTextModel`` (``convert_hf_to_gguf.py``, ``conversion/qwen.py``) is
``_LinearAttentionVReorderBase`` over ``Qwen3NextModel`` over ``Qwen2MoeModel``: the same transforms as those two
files, and no ``feed_forward_length`` (every layer's feed-forward block is sparse: a block without a router is
reported missing). The router always renormalises the chosen experts' weights (as transformers'
``Qwen3_5MoeTopKRouter``), so the files carry no ``expert_weights_norm``. ``rope.dimension_sections`` (the
multimodal rotary sections) is not read: on text, every section's positions are the token positions and the
rotation is the ordinary partial one.
"""

from __future__ import annotations

from .hybrid import HybridConverter, Parts, put
from .qwen35 import Qwen35Converter
from .qwen3next import ROUTER, SHARED_EXPERT, Qwen3NextConverter


class Qwen35MoeConverter(Qwen35Converter, Qwen3NextConverter):
    """``qwen35moe`` files: `Qwen35Converter`'s linear-attention projections and value-head order,
    `Qwen3NextConverter`'s experts (dequantized: metalnn keeps experts in float)."""

    architecture = "qwen35moe"
    has_feed_forward_length = False

    def extra_config(self, config: dict) -> dict:
        """The hybrid keys (`HybridConverter.extra_config`) plus the experts' sizes."""
        return dict(HybridConverter.extra_config(self, config), num_experts=self.meta_int("expert_count"),
                    num_experts_per_tok=self.meta_int("expert_used_count"),
                    moe_intermediate_size=self.meta_int("expert_feed_forward_length"),
                    shared_expert_intermediate_size=self.meta_int("expert_shared_feed_forward_length"))

    def feed_forward(self, parts: Parts, i: int, out: dict):
        """Block ``i``'s sparse experts and the shared expert's gate (`Qwen3NextConverter.experts`), the router
        and the shared expert; every block has them (one absent is reported missing; the shared expert's gate by
        the strict load)."""
        self.experts(parts, i, out)
        for stem, name in {**ROUTER, **SHARED_EXPERT}.items():
            p = parts.take(f"blk.{i}.{stem}")
            if p is not None:
                put(out, f"model.layers.{i}.{name}", p)

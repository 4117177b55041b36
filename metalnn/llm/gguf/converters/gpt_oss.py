"""``gpt-oss`` GGUF files (gpt-oss), as llama.cpp's ``GptOssModel`` writes them, undone into transformers'
``GptOssForCausalLM`` layout.

The converter writes the standard attention names with their biases, ``attn_sinks.weight`` (transformers'
``self_attn.sinks``), ``post_attention_norm`` (the norm before the experts), the router as ``ffn_gate_inp``
(weight and bias) and each layer's experts split: ``gate_up_proj`` ``[E, W, 2*I]`` (gate and up columns
interleaved) into ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, W]`` (the even and odd columns, transposed), its
bias into ``ffn_gate_exps.bias`` / ``ffn_up_exps.bias`` ``[E, I]``, ``down_proj`` ``[E, I, W]`` transposed into
``ffn_down_exps`` ``[E, W, I]`` with ``ffn_down_exps.bias``. Released (MXFP4) checkpoints keep their experts as
GGML MXFP4 blocks; metalnn decodes experts to float32 here (`convert`), as it keeps experts in float.

The metadata holds no ``layer_types`` (llama.cpp's graph slides on the even layers, transformers' default plan),
nor ``swiglu_alpha`` / ``swiglu_limit`` (fixed at 1.702 / 7.0 there, transformers' defaults), nor YaRN's
``truncate``: gpt-oss's configs set it false, and so does the config built here.
"""

from __future__ import annotations

import mlx.core as mx

from .... import ggml
from ..convert import BLOCK_NAMES, Converter

#: per-layer expert stems: gate, up and down
EXPERT_STEMS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class GptOssConverter(Converter):
    """``gpt-oss`` files: standard tables plus sinks, the post-attention norm and the router; experts
    regrouped into transformers' interleaved, input-major layout (`convert`)."""

    architecture = "gpt-oss"
    block_names = {**BLOCK_NAMES, "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                   "ffn_gate_inp": "mlp.router"}

    def extra_config(self, config: dict) -> dict:
        out = {"num_local_experts": self.meta_int("expert_count"),
               "num_experts_per_tok": self.meta_int("expert_used_count"),
               "intermediate_size": self.meta_int("expert_feed_forward_length"),
               "sliding_window": self.meta_int("attention.sliding_window"),
               "attention_bias": "blk.0.attn_q.bias" in self.header.tensors,
               "rope_parameters": {"rope_type": "default", "rope_theta": config["rope_theta"]}}
        yarn = config.get("rope_scaling")
        if yarn is not None:
            out["rope_parameters"] = {**yarn, "rope_theta": config["rope_theta"], "truncate": False}
        out["rope_scaling"] = None
        return out

    def dense(self, name: str, array):
        """A tensor of the file as float32 (GGML blocks, MXFP4 among them, decoded)."""
        kind = self.packed.get(name)
        return array.astype(mx.float32) if kind is None else ggml.get_type(kind).decode(array)

    def convert(self, arrays: dict, config: dict) -> dict:
        """The standard renaming (``self_attn.sinks`` without ``.weight``), after each layer's experts are
        taken out and regrouped as ``mlp.experts.gate_up_proj`` ``[E, W, 2*I]`` (gate and up interleaved),
        ``gate_up_proj_bias``, ``down_proj`` ``[E, I, W]`` and ``down_proj_bias`` (a layer missing one of
        them keeps its GGUF names, for a strict load to report)."""
        experts = {}
        for i in range(config["num_hidden_layers"]):
            names = [f"blk.{i}.{stem}.{kind}" for kind in ("weight", "bias") for stem in EXPERT_STEMS]
            if not all(n in arrays for n in names):
                continue
            gate, up, down, gate_b, up_b, down_b = (self.dense(n, arrays.pop(n)) for n in names)
            e, inter, width = gate.shape
            pre = f"model.layers.{i}.mlp.experts."
            experts[pre + "gate_up_proj"] = mx.stack([gate, up], axis=2).reshape(e, 2 * inter, width).swapaxes(1, 2)
            experts[pre + "gate_up_proj_bias"] = mx.stack([gate_b, up_b], axis=-1).reshape(e, 2 * inter)
            experts[pre + "down_proj"] = down.swapaxes(1, 2)
            experts[pre + "down_proj_bias"] = down_b
            mx.eval(*(experts[pre + k] for k in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")))
        tensors = super().convert(arrays, config)
        tensors = {(k[: -len(".weight")] if k.endswith(".self_attn.sinks.weight") else k): v for k, v in tensors.items()}
        return {**tensors, **experts}

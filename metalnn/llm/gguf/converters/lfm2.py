"""``lfm2`` GGUF files (LFM2), as llama.cpp's ``LFM2Model`` (``convert_hf_to_gguf.py``,
``conversion/lfm2.py``) writes them, undone here:

* the final norm ``model.embedding_norm`` is stored as ``token_embd_norm``; ``operator_norm`` as
  ``attn_norm``, ``ffn_norm`` as ``ffn_norm``; ``feed_forward.w1`` / ``w3`` / ``w2`` as ``ffn_gate`` /
  ``ffn_up`` / ``ffn_down``; ``self_attn.out_proj`` as ``attn_output``, ``q_layernorm`` /
  ``k_layernorm`` as ``attn_q_norm`` / ``attn_k_norm``; ``conv.in_proj`` / ``conv.conv`` /
  ``conv.out_proj`` as ``shortconv.in_proj`` / ``shortconv.conv`` / ``shortconv.out_proj``;
* the convolution weight ``[C, 1, L]`` is squeezed to ``[C, L]`` (restored here);
* ``attention.head_count_kv`` lists one count per layer, 0 on the convolution layers (read back as
  ``layer_types``); ``feed_forward_length`` is the adjusted width (the config gets it as
  ``intermediate_size`` with ``block_auto_adjust_ff_dim`` off); ``shortconv.l_cache`` is
  ``conv_L_cache``; ``conv_bias`` is whether ``shortconv.in_proj.bias`` is there.

Linear and embedding matrices stay as stored (GGML blocks or float); nothing else is transformed.
"""

from __future__ import annotations

from dataclasses import replace

from ....errors import UnsupportedConfigError
from ..convert import BLOCK_NAMES, GLOBAL_NAMES, Converter, Misfit


class Lfm2Converter(Converter):
    """``lfm2`` files: LFM2's tensor names, the squeezed convolution restored, layer kinds from the
    per-layer key/value head counts."""

    architecture = "lfm2"
    global_names = {**GLOBAL_NAMES, "token_embd_norm": "model.embedding_norm"}
    block_names = {**BLOCK_NAMES, "attn_norm": "operator_norm", "ffn_norm": "ffn_norm",
                   "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
                   "attn_k_norm": "self_attn.k_layernorm", "ffn_gate": "feed_forward.w1",
                   "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2", "shortconv.conv": "conv.conv",
                   "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj"}

    def _kv_heads(self) -> list | None:
        """The per-layer key/value head counts (0 on convolution layers), or None when one count is given."""
        value = self.header.metadata.get(self.prefix + "attention.head_count_kv")
        return [int(v) for v in value] if isinstance(value, list) else None

    def config(self) -> dict:
        per_layer = self._kv_heads()
        if per_layer is None:
            return super().config()
        counts = sorted({n for n in per_layer if n})
        if len(counts) > 1:
            raise UnsupportedConfigError(f"{self.header.path}: {self.prefix}attention.head_count_kv = {per_layer}: "
                                         "the attention layers have different key/value head counts")
        key = self.prefix + "attention.head_count_kv"
        meta = dict(self.header.metadata)
        if counts:
            meta[key] = counts[0]
        else:
            meta.pop(key)
        own, self.header = self.header, replace(self.header, metadata=meta)
        try:
            return super().config()
        finally:
            self.header = own

    def extra_config(self, config: dict) -> dict:
        layers, tensors = config["num_hidden_layers"], self.header.tensors
        per_layer = self._kv_heads()
        if per_layer is not None and len(per_layer) != layers:
            raise UnsupportedConfigError(f"{self.header.path}: {self.prefix}attention.head_count_kv lists "
                                         f"{len(per_layer)} layers, block_count is {layers}")
        kinds = ["conv" if f"blk.{i}.shortconv.in_proj.weight" in tensors else "full_attention" for i in range(layers)]
        if per_layer is not None:
            told = ["full_attention" if n else "conv" for n in per_layer]
            if told != kinds:
                raise UnsupportedConfigError(f"{self.header.path}: {self.prefix}attention.head_count_kv = {per_layer} "
                                             f"but the file's convolution tensors make the layers {kinds}")
        return {"layer_types": kinds, "norm_eps": config["rms_norm_eps"],
                "conv_L_cache": self.meta_int("shortconv.l_cache", 3),
                "conv_bias": any(n.endswith("shortconv.in_proj.bias") for n in tensors),
                "block_auto_adjust_ff_dim": False, "rope_parameters": None}

    def transform(self, name: str, array, config: dict):
        if name.endswith(".conv.conv.weight"):
            width = config["conv_L_cache"]
            if array.ndim != 2 or array.shape[1] != width:
                raise Misfit(f"[channels, {width}]")
            return array.reshape(array.shape[0], 1, width)
        return array

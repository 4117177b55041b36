"""What the hybrid Gated DeltaNet GGUF layouts (``qwen3next``, ``qwen35``, ``qwen35moe``) share: `HybridConverter`
(config from the ``ssm.*`` metadata, the blocks walked one layer kind at a time) and `Parts`, the
tensors grouped by stem with the helpers that move their rows and columns.

What llama.cpp's converter does to both (``convert_hf_to_gguf.py`` of ggml-org/llama.cpp at commit
0024aa7417efd50a7c2a79e049dfbbbceb0beaaf, classes ``Qwen3NextModel``, ``_LinearAttentionVReorderBase``,
``Qwen3_5TextModel``), undone here:

* every ``*norm.weight`` except the gated ``linear_attn.norm`` is stored as ``weight + 1``;
* ``A_log`` is stored as ``ssm_a = -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, ``conv1d.weight``
  squeezed to ``[C, K]``;
* multi-token-prediction tensors are dropped.

The architecture-specific parts (the linear-attention input projections, value-head order, experts)
are the hooks `HybridConverter.linear_projections`, `HybridConverter.value_order` and
`HybridConverter.feed_forward`. Linear and embedding matrices stay quantized; tensors that need
arithmetic (norms, ``ssm_a``, the convolution) are dequantized.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ....errors import UnsupportedConfigError, WeightLoadError
from ....quantization import config_from_settings
from ..convert import Converter

#: norms stored as ``weight + 1`` (GGUF stem inside the block -> Hugging Face name)
NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
#: full-attention tensors copied as they are (GGUF stem inside the block -> Hugging Face module)
ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj"}
#: the dense feed-forward block
DENSE_FFN = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


class Parts:
    """The arrays of a GGUF file grouped by tensor stem (``blk.0.attn_q`` -> ``{"weight": ..., "scales": ...}``;
    a name without a suffix, such as ``blk.0.ssm_a``, is its own stem holding a ``weight``), taken out one stem at
    a time; stems asked for and absent are collected for one error."""

    SUFFIXES = ("weight", "bias", "scales", "biases")

    def __init__(self, arrays: dict):
        self.groups, self.names, self.missing = {}, {}, []
        for name, a in arrays.items():
            stem, _, suffix = name.rpartition(".")
            if suffix not in self.SUFFIXES:
                stem, suffix = name, "weight"
            self.groups.setdefault(stem, {})[suffix] = a
            self.names[(stem, suffix)] = name

    def has(self, stem: str) -> bool:
        return stem in self.groups

    def take(self, stem: str, optional: bool = False) -> dict | None:
        """The parts of ``stem`` (removed); None and noted as missing when absent (unless optional)."""
        parts = self.groups.pop(stem, None)
        if parts is None and not optional:
            self.missing.append(stem)
        return parts

    def rest(self) -> dict:
        """``{GGUF name: array}`` of every tensor not taken (left for a strict load to report)."""
        return {self.names[(stem, suffix)]: a for stem, parts in self.groups.items() for suffix, a in parts.items()}


def bits(parts: dict) -> int:
    """Bits per weight of a quantized triple (GGUF blocks hold 32 values: one scale per 32 columns)."""
    return parts["weight"].shape[-1] // parts["scales"].shape[-1]


def dense(parts: dict, suffix: str = "weight"):
    """``parts[suffix]`` as a float32 array (dequantized when the tensor is stored quantized)."""
    if suffix == "weight" and "scales" in parts:
        return mx.dequantize(parts["weight"], parts["scales"].astype(mx.float32), parts["biases"].astype(mx.float32),
                             group_size=32, bits=bits(parts))
    return parts[suffix].astype(mx.float32)


def as_float(parts: dict) -> dict:
    """The parts with the weight dequantized (bias kept)."""
    out = {"weight": dense(parts)}
    if "bias" in parts:
        out["bias"] = parts["bias"]
    return out


def rows(parts: dict, index) -> dict:
    """Rows ``index`` of every part (packed weights, scales and biases share the output rows)."""
    index = mx.array(np.asarray(index, dtype=np.int32))
    return {k: mx.take(a, index, axis=0) for k, a in parts.items()}


def cat_rows(*all_parts) -> dict:
    """The parts of several tensors stacked row-wise (all quantized alike, or all float)."""
    if len({"scales" in p for p in all_parts}) > 1 or len({bits(p) for p in all_parts if "scales" in p}) > 1:
        all_parts = [as_float(p) for p in all_parts]
    return {k: mx.concatenate([p[k] for p in all_parts], axis=0) for k in all_parts[0]}


def col_blocks(parts: dict, order, block: int) -> dict:
    """Columns permuted in blocks of ``block``: block ``j`` of the result is block ``order[j]``. Quantized weights
    stay quantized when ``block`` is a multiple of the 32-column group; else they are dequantized first."""
    order = mx.array(np.asarray(order, dtype=np.int32))
    if "scales" in parts and block % 32:
        parts = as_float(parts)
    out = dict(parts)
    for key in ("weight", "scales", "biases") if "scales" in parts else ("weight",):
        a = parts[key]
        n = len(order)
        out[key] = mx.take(a.reshape(a.shape[0], n, a.shape[1] // n), order, axis=1).reshape(a.shape)
    return out


def put(out: dict, module: str, parts: dict):
    """Store ``parts`` as ``<module>.<suffix>`` tensors."""
    for suffix, a in parts.items():
        out[f"{module}.{suffix}"] = a


def quantization_of_tensors(tensors: dict) -> dict | None:
    """The ``quantization`` config of the quantized triples among Hugging Face named tensors (GGUF blocks:
    group size 32; bits from the packed width)."""
    return config_from_settings({
        name[: -len(".scales")]: (32, tensors[name[: -len(".scales")] + ".weight"].shape[-1] // a.shape[-1], "affine")
        for name, a in tensors.items() if name.endswith(".scales")})


class HybridConverter(Converter):
    """Files of a Gated DeltaNet hybrid: every ``full_attention_interval``-th layer full attention, the
    others linear attention; `convert` walks the blocks and calls the hooks for what differs. Its column
    regrouping needs MLX's affine groups: Q4_0 ... Q8_0 weights arrive as them, other GGML types decoded
    to float32."""

    keeps_ggml_blocks = False

    # -- config ------------------------------------------------------------------------------------
    def linear_sizes(self) -> dict:
        """The Gated DeltaNet sizes of the ``ssm.*`` metadata, checked for consistency."""
        p = self.prefix
        nk, nv = self.meta_int("ssm.group_count"), self.meta_int("ssm.time_step_rank")
        inner = self.meta_int("ssm.inner_size")
        if nk <= 0 or nv % nk:
            raise UnsupportedConfigError(f"{self.header.path}: {p}ssm.time_step_rank (value heads) = {nv} is not a "
                                         f"multiple of {p}ssm.group_count (key heads) = {nk}")
        if inner % nv:
            raise UnsupportedConfigError(f"{self.header.path}: {p}ssm.inner_size = {inner} is not a multiple of "
                                         f"{p}ssm.time_step_rank = {nv} (expected value heads x value head size)")
        return dict(linear_num_key_heads=nk, linear_num_value_heads=nv, linear_value_head_dim=inner // nv,
                    linear_key_head_dim=self.meta_int("ssm.state_size"),
                    linear_conv_kernel_dim=self.meta_int("ssm.conv_kernel"))

    def extra_config(self, config: dict) -> dict:
        """Gated DeltaNet sizes, layer kinds and the partial rotary factor."""
        layers, every = self.meta_int("block_count"), self.meta_int("full_attention_interval", 4)
        if every <= 0:
            raise UnsupportedConfigError(f"{self.header.path}: {self.prefix}full_attention_interval = {every}; "
                                         "expected a positive integer")
        heads = self.meta_int("attention.head_count")
        head_dim = self.meta_int("attention.key_length", self.meta_int("embedding_length") // heads)
        rope_dims = self.meta_int("rope.dimension_count", head_dim)
        return dict(self.linear_sizes(), full_attention_interval=every, partial_rotary_factor=rope_dims / head_dim,
                    layer_types=["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)])

    # -- tensors -----------------------------------------------------------------------------------
    def convert(self, arrays: dict, config: dict) -> dict:
        """The tensors under Hugging Face names, with llama.cpp's transforms undone.

        Raises:
            WeightLoadError: tensors the layers of the metadata need are absent (all of them named).
            UnsupportedConfigError: ``full_attention_interval`` disagrees with the layers the file holds.
        """
        parts, out = Parts(arrays), {}
        for stem, name in (("token_embd", "model.embed_tokens"), ("output", "lm_head")):
            p = parts.take(stem, optional=stem == "output")
            if p is not None:
                put(out, name, p)
        p = parts.take("output_norm")
        if p is not None:
            out["model.norm.weight"] = dense(p) - 1.0
        for i, kind in enumerate(self.layer_kinds(config, parts)):
            self.block(parts, i, kind, config, out)
        if parts.missing:
            raise WeightLoadError(missing=parts.missing, source=str(self.header.path), message=(
                f"{self.header.path}: GGUF tensor(s) missing for the {self.header.architecture} layers its metadata "
                f"describes: {', '.join(parts.missing)}"))
        out.update(parts.rest())
        return out

    def quantization(self, tensors: dict) -> dict | None:
        """From the converted tensors: some were regrouped or dequantized on the way."""
        return quantization_of_tensors(tensors)

    def layer_kinds(self, config: dict, parts: Parts) -> list:
        """Per layer ``linear_attention`` / ``full_attention`` from ``full_attention_interval``, checked against the
        tensors (full attention layers have ``attn_q``, linear ones ``ssm_a``)."""
        kinds = config["layer_types"]
        for i, kind in enumerate(kinds):
            has_q = parts.has(f"blk.{i}.attn_q")
            if has_q != (kind == "full_attention"):
                key = self.prefix + "full_attention_interval"
                every = config["full_attention_interval"]
                raise UnsupportedConfigError(
                    f"{self.header.path}: {key} = {every} makes layer {i} {kind}, but the file has "
                    f"{'an' if has_q else 'no'} blk.{i}.attn_q tensor (expected every {every}th layer to be full "
                    "attention)")
        return kinds

    def block(self, parts: Parts, i: int, kind: str, config: dict, out: dict):
        """The tensors of block ``i`` (a ``kind`` layer) under Hugging Face names."""
        for stem, name in NORMS.items():
            if kind == "full_attention" or not stem.startswith(("attn_q", "attn_k")):
                p = parts.take(f"blk.{i}.{stem}")
                if p is not None:
                    out[f"model.layers.{i}.{name}.weight"] = dense(p) - 1.0
        if kind == "linear_attention":
            self.linear_attention(parts, i, config, out)
        else:
            for stem, name in ATTENTION.items():
                p = parts.take(f"blk.{i}.{stem}")
                if p is not None:
                    put(out, f"model.layers.{i}.{name}", p)
        self.feed_forward(parts, i, out)

    def linear_attention(self, parts: Parts, i: int, c: dict, out: dict):
        """The Gated DeltaNet tensors of layer ``i``: the projections (`linear_projections`), then the decay
        (``A_log`` from ``ssm_a``, ``dt_bias``), the convolution and the gated norm."""
        pre = f"model.layers.{i}.linear_attn."
        self.linear_projections(parts, i, c, out)
        heads = self.value_order(c, 1)
        heads = mx.array((np.arange(c["linear_num_value_heads"]) if heads is None else heads).astype(np.int32))
        a = parts.take(f"blk.{i}.ssm_a")
        if a is not None:
            out[pre + "A_log"] = mx.take(mx.log(-dense(a).reshape(-1)), heads)
        dt = parts.take(f"blk.{i}.ssm_dt")
        if dt is not None:
            out[pre + "dt_bias"] = mx.take(dense(dt, "bias").reshape(-1), heads)
        conv = parts.take(f"blk.{i}.ssm_conv1d")
        if conv is not None:
            w = dense(conv)
            order = self.value_order(c, c["linear_value_head_dim"])
            if order is not None:
                qk = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"]
                w = mx.take(w, mx.array(np.concatenate([np.arange(qk), qk + order]).astype(np.int32)), axis=0)
            out[pre + "conv1d.weight"] = w.reshape(w.shape[0], 1, w.shape[-1])
        p = parts.take(f"blk.{i}.ssm_norm")
        if p is not None:
            put(out, pre + "norm", p)

    def feed_forward(self, parts: Parts, i: int, out: dict):
        """Hook: the feed-forward tensors of block ``i`` (here the dense SwiGLU's)."""
        for stem, name in DENSE_FFN.items():
            p = parts.take(f"blk.{i}.{stem}")
            if p is not None:
                put(out, f"model.layers.{i}.{name}", p)

    def linear_projections(self, parts: Parts, i: int, c: dict, out: dict):  # pragma: no cover - abstract
        """Hook: the input and output projections of linear-attention layer ``i``."""
        raise NotImplementedError

    def value_order(self, c: dict, dim: int):
        """Hook: the index restoring the checkpoint's value-head order along an axis of ``n_v * dim`` entries
        (``dim`` per value head), or None when the file keeps it."""
        return None

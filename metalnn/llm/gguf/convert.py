"""GGUF checkpoints (llama.cpp / Ollama files) as Hugging Face style configs and tensors.

`read_checkpoint(path)` turns a ``.gguf`` file into what `load_pretrained` needs: a config dict in
Hugging Face's keys (built from the ``<arch>.*`` / ``general.*`` / ``tokenizer.ggml.*`` metadata),
the tensors under Hugging Face's names (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.
q_proj.weight``; quantized tensors keep MLX's ``weight`` / ``scales`` / ``biases`` triple) and the
``quantization`` config of the layers the file stores quantized.

llama.cpp's converter reorders the rows of the query and key projections of Llama-family models
(so that its rotary embedding can rotate adjacent pairs); that is undone here, row by row, so the
tensors equal the original checkpoint's and metalnn's (half-split) RoPE applies. Llama 3's rope
scaling arrives as a ``rope_freqs`` tensor of per-frequency factors; it becomes the config's
``rope_freq_factors``.

The hybrid Gated DeltaNet files (``qwen3next`` -> `Qwen3NextForCausalLM`, ``qwen35`` ->
`Qwen3_5ForCausalLM`) go through `hybrid_tensors`, which undoes the rest of what the converter
did to them (norm offsets, ``ssm_a = -exp(A_log)``, the split ``in_proj_qkvz``, Qwen3.5's tiled
value-head order; listed above that function). Linear and embedding matrices stay quantized;
tensors that need arithmetic (norms, ``ssm_a``, the convolution) and the stacked experts (metalnn
keeps experts in float) are dequantized. ``qwen35moe`` is not read.

`ARCHITECTURES` maps a GGUF ``general.architecture`` to a `GGUFArchitecture`: which metalnn
architecture it becomes, how its tensors are named, how its config is built and whether Q/K rows
are permuted. Add an entry to support another architecture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np

from ...errors import UnsupportedConfigError, WeightLoadError
from .reader import GGUFHeader, check_supported, find_gguf, load_tensors, quantization_of, read_header
from ...quantization import config_from_settings

#: GGUF tensor names outside the blocks -> Hugging Face module paths
LLAMA_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: GGUF names inside block ``blk.N.`` -> Hugging Face names inside ``model.layers.N.``
LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
QWEN3_BLOCK_NAMES = {**LLAMA_BLOCK_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


@dataclass(frozen=True)
class GGUFArchitecture:
    """How one llama.cpp architecture becomes a Hugging Face style checkpoint.

    Attributes:
        hf_architecture: the ``architectures`` entry of the config (a key of
            `metalnn.llm.models.ARCHITECTURES` once metalnn implements it).
        model_type: the config's ``model_type``.
        block_names, global_names: GGUF name -> Hugging Face name (without ``.weight`` etc.).
        permute_qk: llama.cpp permuted the Q/K rows (its ``LlamaModel`` converter does).
        config_extra: ``f(header, arch_prefix) -> dict`` of architecture-specific config keys.
        convert: ``f(header, arrays, config) -> {Hugging Face name: array}`` for architectures whose tensors
            llama.cpp transforms beyond renaming (used instead of ``block_names`` / ``global_names``).
    """

    hf_architecture: str
    model_type: str
    block_names: dict = field(default_factory=lambda: dict(LLAMA_BLOCK_NAMES))
    global_names: dict = field(default_factory=lambda: dict(LLAMA_GLOBAL_NAMES))
    permute_qk: bool = False
    config_extra: Callable | None = None
    convert: Callable | None = None


def _qwen2_extra(header, prefix):
    return {"use_sliding_window": False}


# -- hybrid Gated DeltaNet architectures (qwen3next, qwen35) -----------------------------------------------
# What llama.cpp's converter does to these checkpoints, undone below (convert_hf_to_gguf.py of ggml-org/llama.cpp
# at commit 0024aa7417efd50a7c2a79e049dfbbbceb0beaaf: classes Qwen3NextModel, _LinearAttentionVReorderBase,
# Qwen3_5TextModel):
# * every ``*norm.weight`` except the gated ``linear_attn.norm`` is stored as ``weight + 1``;
# * ``A_log`` is stored as ``ssm_a = -exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, ``conv1d.weight`` squeezed to
#   ``[C, K]``;
# * qwen3next: ``in_proj_qkvz`` (rows ``[q, k, v, z]`` per key head) is split into ``attn_qkv`` (all q rows, all k
#   rows, all v rows) and ``attn_gate`` (all z rows); ``in_proj_ba`` is kept as ``ssm_ba``;
# * qwen35 with fewer key than value heads: the value heads of ``in_proj_qkv`` (v rows), ``in_proj_z``, ``in_proj_b``,
#   ``in_proj_a``, ``A_log``, ``dt_bias``, the v channels of ``conv1d`` and the columns of ``out_proj`` are moved from
#   grouped order (by key head) to tiled order (``_reorder_v_heads``);
# * experts are stacked per layer (``ffn_{gate,up,down}_exps``), the shared expert is ``ffn_*_shexp`` and its gate
#   ``ffn_gate_inp_shexp``; multi-token-prediction tensors are dropped.

#: norms stored as ``weight + 1`` (GGUF stem inside the block -> Hugging Face name)
HYBRID_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
#: tensors copied as they are (GGUF stem inside the block -> Hugging Face module)
HYBRID_PLAIN = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ssm_norm": "linear_attn.norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


class _Parts:
    """The arrays of a GGUF file grouped by tensor stem (``blk.0.attn_q`` -> ``{"weight": ..., "scales": ...}``;
    a name without a suffix, such as ``blk.0.ssm_a``, is its own stem holding a ``weight``), taken out one stem at
    a time; stems asked for and absent are collected for one error."""

    SUFFIXES = ("weight", "bias", "scales", "biases")

    def __init__(self, arrays: dict, path):
        self.path, self.groups, self.names, self.missing = path, {}, {}, []
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


def _bits(parts: dict) -> int:
    """Bits per weight of a quantized triple (GGUF blocks hold 32 values: one scale per 32 columns)."""
    return parts["weight"].shape[-1] // parts["scales"].shape[-1]


def _dense(parts: dict, suffix: str = "weight"):
    """``parts[suffix]`` as a float32 array (dequantized when the tensor is stored quantized)."""
    if suffix == "weight" and "scales" in parts:
        return mx.dequantize(parts["weight"], parts["scales"].astype(mx.float32), parts["biases"].astype(mx.float32),
                             group_size=32, bits=_bits(parts))
    return parts[suffix].astype(mx.float32)


def _as_float(parts: dict) -> dict:
    """The parts with the weight dequantized (bias kept)."""
    out = {"weight": _dense(parts)}
    if "bias" in parts:
        out["bias"] = parts["bias"]
    return out


def _rows(parts: dict, index) -> dict:
    """Rows ``index`` of every part (packed weights, scales and biases share the output rows)."""
    index = mx.array(np.asarray(index, dtype=np.int32))
    return {k: mx.take(a, index, axis=0) for k, a in parts.items()}


def _cat_rows(*all_parts) -> dict:
    """The parts of several tensors stacked row-wise (all quantized alike, or all float)."""
    if len({"scales" in p for p in all_parts}) > 1 or len({_bits(p) for p in all_parts if "scales" in p}) > 1:
        all_parts = [_as_float(p) for p in all_parts]
    return {k: mx.concatenate([p[k] for p in all_parts], axis=0) for k in all_parts[0]}


def _col_blocks(parts: dict, order, block: int) -> dict:
    """Columns permuted in blocks of ``block``: block ``j`` of the result is block ``order[j]``. Quantized weights
    stay quantized when ``block`` is a multiple of the 32-column group; else they are dequantized first."""
    order = mx.array(np.asarray(order, dtype=np.int32))
    if "scales" in parts and block % 32:
        parts = _as_float(parts)
    out = dict(parts)
    for key in ("weight", "scales", "biases") if "scales" in parts else ("weight",):
        a = parts[key]
        n = len(order)
        out[key] = mx.take(a.reshape(a.shape[0], n, a.shape[1] // n), order, axis=1).reshape(a.shape)
    return out


def grouped_order(n_k: int, n_v: int, dim: int) -> np.ndarray:
    """Index turning llama.cpp's tiled value-head order back into grouped order: ``grouped = tiled[index]`` along
    an axis of ``n_v * dim`` entries (``dim`` per value head, ``n_v // n_k`` value heads per key head)."""
    r = n_v // n_k
    tiled_from_grouped = np.arange(n_v * dim).reshape(n_k, r, dim).transpose(1, 0, 2).reshape(-1)
    return np.argsort(tiled_from_grouped)


def _norm_minus_one(parts: dict) -> mx.array:
    return _dense(parts) - 1.0


def _layer_kinds(header, config, parts: _Parts) -> list:
    """Per layer ``linear_attention`` / ``full_attention`` from ``full_attention_interval``, checked against the
    tensors (full attention layers have ``attn_q``, linear ones ``ssm_a``)."""
    kinds = config["layer_types"]
    for i, kind in enumerate(kinds):
        has_q = parts.has(f"blk.{i}.attn_q")
        if has_q != (kind == "full_attention"):
            key = header.architecture + ".full_attention_interval"
            raise UnsupportedConfigError(
                f"{header.path}: {key} = {config['full_attention_interval']} makes layer {i} {kind}, but the file "
                f"has {'an' if has_q else 'no'} blk.{i}.attn_q tensor (expected every "
                f"{config['full_attention_interval']}th layer to be full attention)")
    return kinds


def _qkvz(parts: _Parts, i: int, c: dict) -> dict:
    """``in_proj_qkvz`` of a qwen3next layer rebuilt from ``attn_qkv`` and ``attn_gate`` (rows back to
    ``[q, k, v, z]`` per key head), or ``ssm_in`` as older converters wrote it."""
    old = parts.take(f"blk.{i}.ssm_in", optional=True)
    if old is not None:
        return old
    qkv, z = parts.take(f"blk.{i}.attn_qkv"), parts.take(f"blk.{i}.attn_gate")
    if qkv is None or z is None:
        return {}
    nk, dk = c["linear_num_key_heads"], c["linear_key_head_dim"]
    vz = c["linear_num_value_heads"] // nk * c["linear_value_head_dim"]
    both = _cat_rows(qkv, z)
    q0, k0, v0, z0 = 0, nk * dk, 2 * nk * dk, 2 * nk * dk + nk * vz
    index = [np.arange(start + g * size, start + (g + 1) * size)
             for g in range(nk) for start, size in ((q0, dk), (k0, dk), (v0, vz), (z0, vz))]
    return _rows(both, np.concatenate(index))


def _qwen35_projections(parts: _Parts, i: int, c: dict, out: dict):
    """Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` / ``out_proj`` with the value heads
    back in grouped order."""
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    pre = f"model.layers.{i}.linear_attn."
    qkv = parts.take(f"blk.{i}.attn_qkv")
    if qkv is not None:
        index = np.concatenate([np.arange(2 * nk * dk), 2 * nk * dk + grouped_order(nk, nv, dv)])
        _put(out, pre + "in_proj_qkv", _rows(qkv, index))
    for stem, name, dim in (("attn_gate", "in_proj_z", dv), ("ssm_beta", "in_proj_b", 1),
                            ("ssm_alpha", "in_proj_a", 1)):
        p = parts.take(f"blk.{i}.{stem}")
        if p is not None:
            _put(out, pre + name, _rows(p, grouped_order(nk, nv, dim)))
    p = parts.take(f"blk.{i}.ssm_out")
    if p is not None:
        _put(out, pre + "out_proj", _col_blocks(p, grouped_order(nk, nv, 1), dv))


def _put(out: dict, module: str, parts: dict):
    for suffix, a in parts.items():
        out[f"{module}.{suffix}"] = a


def _linear_attention(parts: _Parts, i: int, c: dict, arch: str, out: dict):
    """The Gated DeltaNet tensors of layer ``i`` under Hugging Face names."""
    pre = f"model.layers.{i}.linear_attn."
    reorder = arch == "qwen35" and c["linear_num_key_heads"] != c["linear_num_value_heads"]
    nk, nv, dv = c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_value_head_dim"]
    heads = grouped_order(nk, nv, 1) if reorder else np.arange(nv)
    if arch == "qwen3next":
        _put(out, pre + "in_proj_qkvz", _qkvz(parts, i, c))
        ba = parts.take(f"blk.{i}.ssm_ba")
        if ba is not None:
            _put(out, pre + "in_proj_ba", ba)
        p = parts.take(f"blk.{i}.ssm_out")
        if p is not None:
            _put(out, pre + "out_proj", p)
    else:
        _qwen35_projections(parts, i, c, out)
    a = parts.take(f"blk.{i}.ssm_a")
    if a is not None:
        out[pre + "A_log"] = mx.take(mx.log(-_dense(a).reshape(-1)), mx.array(heads.astype(np.int32)))
    dt = parts.take(f"blk.{i}.ssm_dt")
    if dt is not None:
        out[pre + "dt_bias"] = mx.take(_dense(dt, "bias").reshape(-1), mx.array(heads.astype(np.int32)))
    conv = parts.take(f"blk.{i}.ssm_conv1d")
    if conv is not None:
        w = _dense(conv)
        if reorder:
            qk = 2 * nk * c["linear_key_head_dim"]
            w = mx.take(w, mx.array(np.concatenate([np.arange(qk), qk + grouped_order(nk, nv, dv)]).astype(np.int32)),
                        axis=0)
        out[pre + "conv1d.weight"] = w.reshape(w.shape[0], 1, w.shape[-1])


def _experts(parts: _Parts, i: int, out: dict):
    """Stacked expert weights (dequantized: metalnn keeps experts in float) as ``mlp.experts.gate_up_proj``
    ``[E, 2*I, W]`` and ``mlp.experts.down_proj`` ``[E, W, I]``."""
    pre = f"model.layers.{i}.mlp.experts."
    fused = parts.take(f"blk.{i}.ffn_gate_up_exps", optional=True)
    if fused is not None:
        out[pre + "gate_up_proj"] = _dense(fused)
    else:
        gate, up = parts.take(f"blk.{i}.ffn_gate_exps"), parts.take(f"blk.{i}.ffn_up_exps")
        if gate is not None and up is not None:
            out[pre + "gate_up_proj"] = mx.concatenate([_dense(gate), _dense(up)], axis=1)
    down = parts.take(f"blk.{i}.ffn_down_exps")
    if down is not None:
        out[pre + "down_proj"] = _dense(down)
    shared_gate = parts.take(f"blk.{i}.ffn_gate_inp_shexp", optional=True)
    if shared_gate is not None:
        _put(out, f"model.layers.{i}.mlp.shared_expert_gate",
             {k: (a.reshape(1, -1) if a.ndim == 1 else a) for k, a in shared_gate.items()})


def _block(parts: _Parts, i: int, kind: str, config: dict, arch: str, out: dict):
    """The tensors of block ``i`` (a ``kind`` layer) under Hugging Face names."""
    for stem, name in HYBRID_NORMS.items():
        if kind == "full_attention" or not stem.startswith(("attn_q", "attn_k")):
            p = parts.take(f"blk.{i}.{stem}")
            if p is not None:
                out[f"model.layers.{i}.{name}.weight"] = _norm_minus_one(p)
    if kind == "linear_attention":
        _linear_attention(parts, i, config, arch, out)
        mixer = ("ssm_norm",)
    else:
        mixer = ("attn_q", "attn_k", "attn_v", "attn_output")
    if parts.has(f"blk.{i}.ffn_gate_inp"):
        _experts(parts, i, out)
        ffn = ("ffn_gate_inp",)
        optional = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
    else:
        ffn, optional = ("ffn_gate", "ffn_up", "ffn_down"), ()
    for stem in mixer + ffn + optional:
        p = parts.take(f"blk.{i}.{stem}", optional=stem in optional)
        if p is not None:
            _put(out, f"model.layers.{i}.{HYBRID_PLAIN[stem]}", p)


def hybrid_tensors(header, arrays: dict, config: dict) -> dict:
    """The tensors of a qwen3next / qwen35 GGUF file under Hugging Face names, with llama.cpp's transforms undone.

    Raises:
        WeightLoadError: tensors the layers of the metadata need are absent (all of them named).
        UnsupportedConfigError: ``full_attention_interval`` disagrees with the layers the file holds.
    """
    arch, parts = header.architecture, _Parts(arrays, header.path)
    out = {}
    for stem, name in (("token_embd", "model.embed_tokens"), ("output", "lm_head")):
        p = parts.take(stem, optional=stem == "output")
        if p is not None:
            _put(out, name, p)
    p = parts.take("output_norm")
    if p is not None:
        out["model.norm.weight"] = _norm_minus_one(p)
    for i, kind in enumerate(_layer_kinds(header, config, parts)):
        _block(parts, i, kind, config, arch, out)
    if parts.missing:
        raise WeightLoadError(missing=parts.missing, source=str(header.path), message=(
            f"{header.path}: GGUF tensor(s) missing for the {arch} layers its metadata describes: "
            f"{', '.join(parts.missing)}"))
    out.update(parts.rest())
    return out


def _meta_int(header, key: str, default=None) -> int:
    """An integer metadata value; UnsupportedConfigError naming the file and key when absent."""
    value = header.metadata.get(key, default)
    if value is None:
        raise UnsupportedConfigError(f"{header.path}: GGUF metadata lacks {key} (needed for a "
                                     f"{header.architecture} model)")
    if isinstance(value, list):
        raise UnsupportedConfigError(f"{header.path}: {key} varies per layer ({value}); expected one integer")
    return int(value)


def _hybrid_heads(header, p: str) -> dict:
    """The Gated DeltaNet sizes of the ``ssm.*`` metadata, checked for consistency."""
    nk, nv = _meta_int(header, p + "ssm.group_count"), _meta_int(header, p + "ssm.time_step_rank")
    inner = _meta_int(header, p + "ssm.inner_size")
    if nk <= 0 or nv % nk:
        raise UnsupportedConfigError(f"{header.path}: {p}ssm.time_step_rank (value heads) = {nv} is not a multiple "
                                     f"of {p}ssm.group_count (key heads) = {nk}")
    if inner % nv:
        raise UnsupportedConfigError(f"{header.path}: {p}ssm.inner_size = {inner} is not a multiple of "
                                     f"{p}ssm.time_step_rank = {nv} (expected value heads x value head size)")
    return dict(linear_num_key_heads=nk, linear_num_value_heads=nv, linear_value_head_dim=inner // nv,
                linear_key_head_dim=_meta_int(header, p + "ssm.state_size"),
                linear_conv_kernel_dim=_meta_int(header, p + "ssm.conv_kernel"))


def _hybrid_extra(header, p: str) -> dict:
    """Config keys of qwen3next / qwen35 files: Gated DeltaNet sizes, layer kinds, partial rotary factor and, for
    qwen3next, the experts."""
    meta = header.metadata
    layers, every = _meta_int(header, p + "block_count"), _meta_int(header, p + "full_attention_interval", 4)
    if every <= 0:
        raise UnsupportedConfigError(f"{header.path}: {p}full_attention_interval = {every}; expected a positive "
                                     "integer")
    heads = _meta_int(header, p + "attention.head_count")
    head_dim = _meta_int(header, p + "attention.key_length", _meta_int(header, p + "embedding_length") // heads)
    rope_dims = _meta_int(header, p + "rope.dimension_count", head_dim)
    cfg = dict(_hybrid_heads(header, p), full_attention_interval=every, partial_rotary_factor=rope_dims / head_dim,
               layer_types=["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)])
    if header.architecture == "qwen3next":
        dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in header.tensors]
        cfg.update(num_experts=_meta_int(header, p + "expert_count"),
                   num_experts_per_tok=_meta_int(header, p + "expert_used_count"),
                   moe_intermediate_size=_meta_int(header, p + "expert_feed_forward_length"),
                   shared_expert_intermediate_size=_meta_int(header, p + "expert_shared_feed_forward_length", 0),
                   norm_topk_prob=bool(meta.get(p + "expert_weights_norm", True)), decoder_sparse_step=1,
                   mlp_only_layers=dense)
    return cfg


def quantization_of_tensors(tensors: dict) -> dict | None:
    """The ``quantization`` config of the quantized triples among Hugging Face named tensors (GGUF blocks:
    group size 32; bits from the packed width)."""
    return config_from_settings({
        name[: -len(".scales")]: (32, tensors[name[: -len(".scales")] + ".weight"].shape[-1] // a.shape[-1], "affine")
        for name, a in tensors.items() if name.endswith(".scales")})


ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", config_extra=_qwen2_extra),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", block_names=dict(QWEN3_BLOCK_NAMES)),
    "qwen3next": GGUFArchitecture("Qwen3NextForCausalLM", "qwen3_next", config_extra=_hybrid_extra,
                                  convert=hybrid_tensors),
    "qwen35": GGUFArchitecture("Qwen3_5ForCausalLM", "qwen3_5_text", config_extra=_hybrid_extra,
                               convert=hybrid_tensors),
}


@dataclass
class GGUFCheckpoint:
    """A GGUF file read as a Hugging Face style checkpoint.

    Attributes:
        config: Hugging Face config dict (with ``quantization`` when any tensor is quantized).
        tensors: ``{Hugging Face name: mx.array}``; names with no mapping keep their GGUF name.
        header: the parsed `GGUFHeader` (metadata for the tokenizer).
    """

    config: dict
    tensors: dict
    header: GGUFHeader


def _architecture(header) -> tuple[str, GGUFArchitecture]:
    arch = header.architecture
    if arch not in ARCHITECTURES:
        raise UnsupportedConfigError(f"{header.path}: GGUF architecture {arch!r} is not supported; metalnn reads "
                                     f"{', '.join(sorted(ARCHITECTURES))}")
    return arch, ARCHITECTURES[arch]


def build_config(header: GGUFHeader) -> dict:
    """The Hugging Face config dict described by a GGUF header's metadata."""
    arch, spec = _architecture(header)
    meta, p = header.metadata, arch + "."
    missing = [k for k in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
               if p + k not in meta]
    if missing:
        raise UnsupportedConfigError(f"{header.path}: GGUF metadata lacks {', '.join(p + k for k in missing)}")
    hidden, heads = int(meta[p + "embedding_length"]), int(meta[p + "attention.head_count"])
    kv_heads = meta.get(p + "attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedConfigError(f"{header.path}: {p}attention.head_count_kv varies per layer; not supported")
    head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(p + "vocab_size")
    if vocab is None:
        emb = header.tensors.get("token_embd.weight")
        vocab = emb.shape[0] if emb is not None else (len(tokens) if tokens else None)
    if vocab is None:
        raise UnsupportedConfigError(f"{header.path}: cannot tell the vocabulary size ({p}vocab_size, token_embd)")
    cfg = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(p + "context_length", 2048)),
        "rms_norm_eps": float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "attention_bias": "blk.0.attn_q.bias" in header.tensors,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    rope_dims = meta.get(p + "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        cfg["partial_rotary_factor"] = int(rope_dims) / head_dim
    kind = meta.get(p + "rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise UnsupportedConfigError(f"{header.path}: {p}rope.scaling.type {kind!r} is not supported (linear)")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(meta[p + "rope.scaling.factor"])}
    if spec.config_extra is not None:
        cfg.update(spec.config_extra(header, p))
    return cfg


def hf_name(name: str, spec: GGUFArchitecture) -> str | None:
    """Hugging Face name of a GGUF tensor name (None if the architecture does not map it)."""
    stem, _, suffix = name.rpartition(".")
    if not stem:
        return None
    if stem in spec.global_names:
        return f"{spec.global_names[stem]}.{suffix}"
    parts = stem.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in spec.block_names:
        return f"model.layers.{parts[1]}.{spec.block_names[parts[2]]}.{suffix}"
    return None


def unpermute_rows(a, n_heads: int):
    """Undo llama.cpp's Q/K row order: within each head, rows ``[x0, x1, ..., y0, y1, ...]`` were
    stored interleaved ``[x0, y0, x1, y1, ...]``. Works on any array whose rows are the projection's
    outputs (packed weights, scales, biases, bias vectors)."""
    rows = a.shape[0]
    half = rows // n_heads // 2
    return a.reshape(n_heads, half, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def quantization_config(header: GGUFHeader, spec: GGUFArchitecture) -> dict | None:
    """The ``quantization`` config (metalnn / MLX form) of the layers stored quantized."""
    layers = {}
    for info in header.tensors.values():
        q = quantization_of(info)
        if q is not None and info.name.endswith(".weight"):
            name = hf_name(info.name, spec)
            if name is not None:
                bits, group = q
                layers[name[: -len(".weight")]] = (group, bits, "affine")
    return config_from_settings(layers)


def read_checkpoint(path) -> GGUFCheckpoint:
    """Read a ``.gguf`` file: config, renamed tensors (Q/K rows restored) and header.

    Raises:
        WeightLoadError: not GGUF, truncated, corrupt, or tensor types MLX cannot load.
        UnsupportedConfigError: an architecture or metadata value metalnn does not support.
    """
    header = read_header(path)
    check_supported(header)
    arch, spec = _architecture(header)
    config = build_config(header)
    arrays = load_tensors(header)
    if spec.convert is not None:
        tensors = spec.convert(header, arrays, config)
        q = quantization_of_tensors(tensors)
        if q is not None:
            config["quantization"] = q
        return GGUFCheckpoint(config, tensors, header)
    q = quantization_config(header, spec)
    if q is not None:
        config["quantization"] = q
    factors = arrays.pop("rope_freqs.weight", None)  # Llama 3 rope scaling, one factor per frequency
    if factors is not None:
        config["rope_freq_factors"] = [float(f) for f in factors.astype(mx.float32).tolist()]
    tensors, bad = {}, {}
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    for name, a in arrays.items():
        new = hf_name(name, spec)
        if new is None:
            tensors[name] = a  # reported as unexpected by a strict load
            continue
        if spec.permute_qk and (".self_attn.q_proj." in new or ".self_attn.k_proj." in new):
            n = heads if ".q_proj." in new else kv
            if a.shape[0] % (2 * n):
                bad[new] = (f"rows divisible by 2 x {n} heads", str(tuple(a.shape)))
                continue
            a = unpermute_rows(a, n)
        tensors[new] = a
    if bad:
        raise WeightLoadError(mismatched=bad, source=str(header.path))
    return GGUFCheckpoint(config, tensors, header)


__all__ = ["ARCHITECTURES", "GGUFArchitecture", "GGUFCheckpoint", "build_config", "find_gguf", "grouped_order",
           "hf_name", "hybrid_tensors", "quantization_config", "quantization_of_tensors", "read_checkpoint",
           "unpermute_rows"]

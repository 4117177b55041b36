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

`ARCHITECTURES` maps a GGUF ``general.architecture`` to a `GGUFArchitecture`: which metalnn
architecture it becomes, how its tensors are named, how its config is built and whether Q/K rows
are permuted. Add an entry to support another architecture.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from ..errors import UnsupportedConfigError, WeightLoadError
from ..gguf_file import GGUFHeader, check_supported, find_gguf, load_tensors, quantization_of, read_header

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
            `metalnn.models.ARCHITECTURES` once metalnn implements it).
        model_type: the config's ``model_type``.
        block_names, global_names: GGUF name -> Hugging Face name (without ``.weight`` etc.).
        permute_qk: llama.cpp permuted the Q/K rows (its ``LlamaModel`` converter does).
        config_extra: ``f(header, arch_prefix) -> dict`` of architecture-specific config keys.
    """

    hf_architecture: str
    model_type: str
    block_names: dict = field(default_factory=lambda: dict(LLAMA_BLOCK_NAMES))
    global_names: dict = field(default_factory=lambda: dict(LLAMA_GLOBAL_NAMES))
    permute_qk: bool = False
    config_extra: Callable | None = None


def _qwen2_extra(header, prefix):
    return {"use_sliding_window": False}


ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", permute_qk=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", config_extra=_qwen2_extra),
    "qwen3": GGUFArchitecture("Qwen3ForCausalLM", "qwen3", block_names=dict(QWEN3_BLOCK_NAMES)),
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
                layers[name[: -len(".weight")]] = q
    if not layers:
        return None
    (bits, group), _ = Counter(layers.values()).most_common(1)[0]
    cfg = {"group_size": group, "bits": bits, "mode": "affine"}
    for path, (b, g) in layers.items():
        if (b, g) != (bits, group):
            cfg[path] = {"group_size": g, "bits": b, "mode": "affine"}
    return cfg


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
    q = quantization_config(header, spec)
    if q is not None:
        config["quantization"] = q
    arrays = load_tensors(header)
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


__all__ = ["ARCHITECTURES", "GGUFArchitecture", "GGUFCheckpoint", "build_config", "find_gguf", "hf_name",
           "quantization_config", "read_checkpoint", "unpermute_rows"]

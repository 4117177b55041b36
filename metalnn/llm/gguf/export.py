"""Write a model as a GGUF file that llama.cpp (and so Ollama, LM Studio) loads: `save_gguf`.

The inverse of `metalnn.llm.gguf.convert`: the model's Hugging Face tensor names become gguf-py's
names by the converter's own tables (``model.layers.3.self_attn.q_proj.weight`` ->
``blk.3.attn_q.weight``), llama.cpp's transforms are applied again (the query and key rows of
``llama`` files in llama.cpp's interleaved order), and the metadata, tokenizer and chat template
are written under the keys llama.cpp's ``convert_hf_to_gguf.py`` writes.

Every weight is taken as float (packed GGML, MLX-quantized and LoRA-fused layers are dequantized
first) and packed again by `metalnn.ggml`'s encoders, which write the same bytes as ggml's reference
quantizers. Which type each tensor gets follows llama.cpp's ``llama_tensor_get_type`` for the mix
asked for (`tensor_types`): in Q4_K_M and Q5_K_M the value projections and the feed-forward down
projections of some layers are Q6_K; the output head (or the tied embedding table) is Q6_K; a row
that is not whole 256-value blocks falls back to Q5_0 / Q5_1 / Q8_0 for Q4_K / Q5_K / Q6_K. Norms and
biases stay float32, as in llama.cpp's files.

The file is written by gguf-py's ``GGUFWriter``: header and tensor infos first, then each tensor's
data as it is encoded (one tensor in memory at a time).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...errors import UnsupportedConfigError
from .reader import StringArray, find_gguf, read_header

#: export type -> (GGML type of the mix's ordinary tensors, gguf-py's ``LlamaFileType`` name)
EXPORT_TYPES = {
    "F32": ("F32", "ALL_F32"),
    "F16": ("F16", "MOSTLY_F16"),
    "BF16": ("BF16", "MOSTLY_BF16"),
    "Q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "Q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "Q6_K": ("Q6_K", "MOSTLY_Q6_K"),
    "Q5_K_M": ("Q5_K", "MOSTLY_Q5_K_M"),
    "Q4_K_M": ("Q4_K", "MOSTLY_Q4_K_M"),
}

#: metalnn ``model_type`` -> llama.cpp ``general.architecture`` (Mistral is written as llama, as llama.cpp does)
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

#: llama.cpp's fallback when a row is not whole blocks of the chosen type (``tensor_type_fallback``)
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "Q4_0", "Q3_K": "Q4_0"}

FLOAT_TYPES = ("F32", "F16", "BF16")


def normalize_type(type_name: str) -> str:
    """The export type named by ``type_name`` (case-insensitive); ValueError listing the types."""
    name = str(type_name).upper()
    if name not in EXPORT_TYPES:
        raise ValueError(f"GGUF export type {type_name!r} is not supported; choose one of "
                         f"{', '.join(EXPORT_TYPES)}")
    return name


def gguf_architecture(model) -> str:
    """llama.cpp's architecture name for ``model``; UnsupportedConfigError naming the ones written."""
    arch = GGUF_ARCHITECTURES.get(getattr(model, "model_type", None))
    if arch is None:
        raise UnsupportedConfigError(
            f"GGUF export of a {getattr(model, 'model_type', type(model).__name__)!r} model is not supported; "
            f"metalnn writes {', '.join(sorted(GGUF_ARCHITECTURES))} models")
    return arch


def _converter(arch: str):
    from .converters.llama import LlamaConverter
    from .converters.qwen2 import Qwen2Converter
    from .converters.qwen3 import Qwen3Converter

    return {"llama": LlamaConverter, "qwen2": Qwen2Converter, "qwen3": Qwen3Converter}[arch]


def gguf_name(hf_name: str, converter) -> str | None:
    """gguf-py's name of a Hugging Face tensor name: the inverse of the converter's name tables
    (None when they do not name it)."""
    stem, _, suffix = hf_name.rpartition(".")
    globals_ = {v: k for k, v in converter.global_names.items()}
    if stem in globals_:
        return f"{globals_[stem]}.{suffix}"
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        blocks = {v: k for k, v in converter.block_names.items()}
        if parts[3] in blocks:
            return f"blk.{parts[2]}.{blocks[parts[3]]}.{suffix}"
    return None


def permute_rows(a: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (the inverse of `converters.llama.unpermute_rows`): within each head,
    rows ``[x0, x1, ..., y0, y1, ...]`` are stored ``[x0, y0, x1, y1, ...]``."""
    rows = a.shape[0]
    return a.reshape(n_heads, 2, rows // n_heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def float_weights(model) -> dict:
    """``{Hugging Face name: lazy float32 mx.array}`` of every tensor of ``model``: quantized layers
    (GGML blocks, MLX's affine groups) dequantized, their scales and biases left out."""
    from ...quantization import QUANTIZED

    modules = dict(model.named_modules())
    out = {}
    for name, a in model.export_weights().items():
        path, _, leaf = name.rpartition(".")
        module = modules.get(path)
        if isinstance(module, QUANTIZED):
            if leaf == "weight":
                out[name] = module.dequantized_weight(mx.float32)
            elif leaf in ("scales", "biases"):
                continue
            else:
                out[name] = a.astype(mx.float32)
        elif mx.issubdtype(a.dtype, mx.floating):
            out[name] = a.astype(mx.float32)
        else:
            raise UnsupportedConfigError(f"GGUF export: tensor {name} is {a.dtype} and belongs to no quantized "
                                         "layer metalnn can dequantize")
    return out


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer(name: str) -> int:
    # llama-quantize sorts the weights by layer and counts attn_v / ffn_down in that order
    return int(name.split(".")[1])


def _fits(type_name: str, cols: int) -> bool:
    from ...ggml import get_type

    return cols % get_type(type_name).block_size == 0


def tensor_types(shapes: dict, export_type: str) -> dict:
    """``{GGUF name: GGML type name}`` for tensors ``{GGUF name: shape}`` (in file order) in the mix
    ``export_type``, as llama.cpp's ``llama_tensor_get_type`` chooses them when it quantizes a float
    file without an importance matrix: 1-D tensors float32; the output head (the tied token table when
    there is none) Q8_0 when its rows are not whole blocks of the mix's type, else Q6_K unless the mix
    is Q8_0; in Q4_K_M / Q5_K_M the ``attn_v`` and ``ffn_down`` weights of the layers
    ``use_more_bits`` picks (by layer index: llama-quantize sorts the weights by layer) Q6_K; then the fallback for rows not whole blocks."""
    export_type = normalize_type(export_type)
    base = EXPORT_TYPES[export_type][0]
    tied = "output.weight" not in shapes
    n_v = sum(1 for n in shapes if n.endswith(".attn_v.weight"))
    n_down = sum(1 for n in shapes if n.endswith(".ffn_down.weight"))
    types = {}
    for name, shape in shapes.items():
        if len(shape) < 2:
            types[name] = "F32"
            continue
        if base in FLOAT_TYPES or not name.endswith(".weight") or "_norm." in name:
            types[name] = base if name.endswith(".weight") and "_norm." not in name else "F32"
            continue
        cols, t = shape[-1], base
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            if not _fits(base, cols):
                t = "Q8_0"
            elif base != "Q8_0":
                t = "Q6_K"
        elif name.endswith(".attn_v.weight"):
            if export_type in ("Q4_K_M", "Q5_K_M") and _use_more_bits(_layer(name), n_v):
                t = "Q6_K"
        elif name.endswith(".ffn_down.weight"):
            if export_type in ("Q4_K_M", "Q5_K_M") and _use_more_bits(_layer(name), n_down):
                t = "Q6_K"
        if not _fits(t, cols):
            t = FALLBACK.get(t, "F16")
            if not _fits(t, cols):
                t = "F16"
        types[name] = t
    return types


# -- metadata ---------------------------------------------------------------------------------------
def _model_metadata(writer, model, arch: str, name: str | None, export_type: str):
    import gguf

    c = model.config
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    writer.add_name(name or c.get("_name_or_path") or f"{arch} model")
    writer.add_file_type(int(getattr(gguf.LlamaFileType, EXPORT_TYPES[export_type][1])))
    if export_type not in FLOAT_TYPES:
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(int(c["vocab_size"]))
    writer.add_context_length(int(c.get("max_position_embeddings") or 2048))
    writer.add_embedding_length(int(c["hidden_size"]))
    writer.add_block_count(int(c["num_hidden_layers"]))
    writer.add_feed_forward_length(int(c["intermediate_size"]))
    rope_dims = int(head_dim * float(c.get("partial_rotary_factor") or 1.0))
    writer.add_rope_dimension_count(rope_dims)
    writer.add_head_count(int(c["num_attention_heads"]))
    writer.add_head_count_kv(int(c.get("num_key_value_heads") or c["num_attention_heads"]))
    writer.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-5)))
    writer.add_rope_freq_base(float(c.get("rope_theta", 10000.0)))
    if head_dim != c["hidden_size"] // c["num_attention_heads"] or arch == "qwen3":
        writer.add_key_length(int(head_dim))
        writer.add_value_length(int(head_dim))
    scaling = c.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind not in (None, "default", "llama3") and not c.get("rope_freq_factors"):
        raise UnsupportedConfigError(f"GGUF export: rope scaling {kind!r} is not supported")


def _copy_metadata(writer, metadata: dict):
    """Write ``tokenizer.*`` keys read from a GGUF file as they were."""
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, (list, tuple, StringArray)):
            writer.add_array(key, list(value))


def _pre_type(spec: dict) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a tokenizer.json's pre-tokenizer (by its split rule)."""
    from .tokenizer import _LLAMA3_SPLIT, _QWEN2_SPLIT

    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for p in parts:
        if p.get("type") == "Split":
            regex = (p.get("pattern") or {}).get("Regex")
            if regex == _LLAMA3_SPLIT:
                return "llama-bpe"
            if regex == _QWEN2_SPLIT:
                return "qwen2"
    kinds = [p.get("type") for p in parts]
    if "Digits" in kinds and any(p.get("type") == "Digits" and p.get("individual_digits") for p in parts):
        return "smollm"
    if kinds == ["ByteLevel"]:
        return "gpt-2"
    return "default"


def _tokenizer_metadata(writer, tokenizer, vocab_size: int):
    """The ``tokenizer.ggml.*`` keys and the chat template of a metalnn `Tokenizer` (byte-level BPE, as
    ``gpt2``, or SentencePiece-style BPE with byte fallback, as ``llama``), written as llama.cpp's
    converter writes them: tokens in id order, padded to the model's vocabulary with ``[PADn]``
    (UNUSED); special added tokens CONTROL, other added tokens USER_DEFINED."""
    import json

    from .tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED

    tok = tokenizer.tokenizer
    spec = json.loads(tok.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise UnsupportedConfigError(f"GGUF export: a {model.get('type')!r} tokenizer cannot be written (BPE "
                                     "tokenizers can)")
    vocab = tok.get_vocab(with_added_tokens=True)
    added = {a["id"]: a for a in spec.get("added_tokens") or []}
    size = max(vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [UNUSED] * size
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = (CONTROL if added[i].get("special") else USER_DEFINED) if i in added else NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    spm = bool(model.get("byte_fallback"))
    if spm:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        for i, t in enumerate(tokens):
            if types[i] == NORMAL and len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
                types[i] = BYTE
        unk = model.get("unk_token")
        if unk in vocab:
            types[vocab[unk]] = UNKNOWN
            writer.add_unk_token_id(vocab[unk])
        writer.add_token_list(tokens)
        writer.add_token_scores([-float(i) if types[i] == NORMAL else 0.0 for i in range(size)])
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_pre_type(spec))
        writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(int(tokenizer.bos_token_id))
    if tokenizer.eos_token_id is not None:
        writer.add_eos_token_id(int(tokenizer.eos_token_id))
    pad = getattr(tokenizer, "special_tokens", {}).get("pad_token")
    if isinstance(pad, str) and pad in vocab:
        writer.add_pad_token_id(vocab[pad])
    elif isinstance(pad, int):
        writer.add_pad_token_id(pad)
    probe = tok.encode("a", add_special_tokens=True).ids
    bare = tok.encode("a", add_special_tokens=False).ids
    writer.add_add_bos_token(bool(tokenizer.bos_token_id is not None and len(probe) > len(bare)
                                  and probe[0] == tokenizer.bos_token_id))
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def _gguf_tokenizer_metadata(path) -> dict | None:
    """The ``tokenizer.*`` metadata of a GGUF file (None when ``path`` is no GGUF file)."""
    path = Path(path)
    file = find_gguf(path) if path.exists() else None
    if file is None:
        return None
    meta = read_header(file).metadata
    found = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    return found or None


# -- tensors ----------------------------------------------------------------------------------------
def gguf_tensors(model, arch: str) -> dict:
    """``{GGUF name: lazy float32 mx.array}`` in llama.cpp's order and layout (Q/K rows permuted for
    ``llama``; a tied model has no ``output.weight``; Llama 3's ``rope_freqs``)."""
    converter = _converter(arch)
    c = model.config
    out, unnamed = {}, []
    for name, a in float_weights(model).items():
        if name == "lm_head.weight" and c.get("tie_word_embeddings"):
            continue
        g = gguf_name(name, converter)
        if g is None:
            unnamed.append(name)
            continue
        out[g] = a
    if unnamed:
        raise UnsupportedConfigError(f"GGUF export: no {arch} tensor name for {', '.join(unnamed[:5])}"
                                     + (" ..." if len(unnamed) > 5 else ""))
    factors = c.get("rope_freq_factors")
    if factors:
        out["rope_freqs.weight"] = mx.array(np.asarray(factors, dtype=np.float32))

    def order(name):
        if name.startswith("blk."):
            return (1, int(name.split(".")[1]))
        return (0 if name in ("token_embd.weight", "rope_freqs.weight") else 2, 0)

    return dict(sorted(out.items(), key=lambda kv: order(kv[0])))  # stable: the model's order within a block


def _prepare(name: str, a: mx.array, arch: str, config: dict) -> np.ndarray:
    x = np.array(a.astype(mx.float32))
    if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        n = config["num_attention_heads"] if ".attn_q." in name else (config.get("num_key_value_heads")
                                                                     or config["num_attention_heads"])
        x = permute_rows(x, n)
    return x


def _encode(x: np.ndarray, type_name: str) -> np.ndarray:
    from ...ggml import get_type

    if type_name == "F32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if type_name == "F16":
        return np.ascontiguousarray(x.astype(np.float16))
    return get_type(type_name).encode(x)


def save_gguf(model, path, type: str = "Q4_K_M", tokenizer=None, *, name: str | None = None,
              force: bool = True, progress: bool | None = None) -> Path:
    """Write ``model`` as a GGUF file llama.cpp loads.

    Args:
        model: a llama / mistral / qwen2 / qwen3 `CausalLM` (float, MLX-quantized, GGUF-loaded, or with
            LoRA adapters fused by `metalnn.llm.tuner.lora.fuse`).
        path: the ``.gguf`` file to write.
        type: the mix (``Q4_K_M``, ``Q5_K_M``, ``Q6_K``, ``Q8_0``, ``Q4_0``, ``F16``, ``BF16``, ``F32``).
        tokenizer: a metalnn `Tokenizer`, or a ``.gguf`` file whose ``tokenizer.*`` metadata is copied as
            it is (the exact vocabulary, ``pre`` type and chat template llama.cpp wrote).
        name: ``general.name`` (default: the config's ``_name_or_path``, or the architecture).
        force: overwrite an existing file (False: FileExistsError).
        progress: show a progress bar (default: when stderr is a terminal).
    Raises:
        ValueError: an unknown ``type``, or no tokenizer given.
        UnsupportedConfigError: an architecture or layout llama.cpp's files do not describe.
        FileExistsError: ``path`` exists and ``force`` is False.
    """
    import gguf

    export_type = normalize_type(type)
    arch = gguf_architecture(model)
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(f"{path}: already exists (overwrite it with --force / force=True)")
    if tokenizer is None:
        raise ValueError("save_gguf: a GGUF file needs the model's tokenizer; pass tokenizer= (a metalnn "
                         "Tokenizer, e.g. metalnn.models.load_tokenizer(MODEL), or the model's .gguf file)")
    copied = None
    if isinstance(tokenizer, (str, os.PathLike)):
        copied = _gguf_tokenizer_metadata(tokenizer)
        if copied is None:
            from ..tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
    tensors = gguf_tensors(model, arch)
    types = tensor_types({n: tuple(a.shape) for n, a in tensors.items()}, export_type)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.partial-{os.getpid()}"
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        _model_metadata(writer, model, arch, name, export_type)
        if copied is not None:
            _copy_metadata(writer, copied)
        else:
            _tokenizer_metadata(writer, tokenizer, int(model.config["vocab_size"]))
        from ...ggml import get_type

        for n, a in tensors.items():
            t = get_type(types[n])
            shape = tuple(a.shape)
            nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * t.row_bytes(shape[-1])
            # a float dtype with raw_dtype: gguf-py keeps ``shape`` as the element shape
            writer.add_tensor_info(n, shape, np.dtype(np.float32), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType(t.type_id))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        from tqdm import tqdm

        show = sys.stderr.isatty() if progress is None else progress
        bar = tqdm(tensors.items(), total=len(tensors), desc=f"GGUF {export_type}", unit="tensor",
                   disable=not show, file=sys.stderr)
        for n, a in bar:
            data = _encode(_prepare(n, a, arch, model.config), types[n])
            writer.write_tensor_data(data)
        writer.close()
        os.replace(tmp, path)
    finally:
        writer.close()
        if tmp.exists():
            tmp.unlink()
    return path


__all__ = ["EXPORT_TYPES", "GGUF_ARCHITECTURES", "float_weights", "gguf_name", "gguf_tensors", "normalize_type",
           "permute_rows", "save_gguf", "tensor_types"]

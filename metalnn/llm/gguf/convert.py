"""GGUF checkpoints (llama.cpp / Ollama files) as Hugging Face style configs and tensors: the generic part.

`read_checkpoint(path, converters)` reads the header, picks
the `Converter` of the file's ``general.architecture``, builds the config dict in Hugging Face's keys
from the ``<arch>.*`` / ``tokenizer.ggml.*`` metadata, loads the tensors and lets the converter give
them Hugging Face's names (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``;
tensors read by `metalnn.llm.gguf.tensors`, kept packed) and undo what llama.cpp's converter did to them. The config also gets the ``quantization`` of the layers stored quantized.

One `Converter` subclass per llama.cpp architecture lives in `metalnn.llm.gguf.converters` (as
llama.cpp's ``convert_hf_to_gguf.py`` has one class per model): a tensor-name table and hooks for
its config keys and transforms. Which converter reads which file, and which metalnn model the result
builds, is declared once, by the model's registration (`metalnn.llm.models.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ... import ggml
from ...errors import UnsupportedConfigError, WeightLoadError
from ...quantization import config_from_settings
from .reader import GGUFHeader, read_header
from .tensors import AFFINE, read_tensors

#: gguf-py's tensor names outside the blocks -> Hugging Face module paths
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: gguf-py's tensor names inside block ``blk.N.`` -> Hugging Face names inside ``model.layers.N.``
BLOCK_NAMES = {
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


class Converter:
    """How the files of one llama.cpp architecture become a Hugging Face style checkpoint.

    A subclass sets ``architecture`` (the files' ``general.architecture``) and, when its tensors are
    only renamed, the name tables; it overrides `extra_config` for config keys beyond the common ones
    and `transform` (one tensor) or `convert` (all of them) to undo llama.cpp's transforms.

    Args:
        header: the file's parsed header.
    """

    #: llama.cpp's ``general.architecture`` of the files this converter reads
    architecture = ""
    #: GGUF name -> Hugging Face name (without ``.weight`` etc.), outside and inside the blocks
    global_names = GLOBAL_NAMES
    block_names = BLOCK_NAMES
    #: whether the converter passes GGML blocks through (row transforms only); a converter that regroups
    #: columns sets False and gets Q4_0 ... Q8_0 as MLX's affine groups, the other block types as float32
    keeps_ggml_blocks = True
    #: whether the files carry ``feed_forward_length`` (the dense MLP's width, ``intermediate_size``); False for
    #: models whose every feed-forward block is sparse experts
    has_feed_forward_length = True

    def __init__(self, header: GGUFHeader):
        self.header = header
        self.prefix = f"{header.architecture}."
        #: ``{GGUF weight name: GGML type}`` of the weights kept as blocks (set by `read_checkpoint`)
        self.packed = {}

    # -- config ------------------------------------------------------------------------------------
    def meta_int(self, key: str, default=None) -> int:
        """The integer metadata value ``<arch>.<key>``; UnsupportedConfigError naming the file and key
        when absent (and no default) or given per layer."""
        key = self.prefix + key
        value = self.header.metadata.get(key, default)
        if value is None:
            raise UnsupportedConfigError(f"{self.header.path}: GGUF metadata lacks {key} (needed for a "
                                         f"{self.header.architecture} model)")
        if isinstance(value, list):
            raise UnsupportedConfigError(f"{self.header.path}: {key} varies per layer ({value}); expected one "
                                         "integer")
        return int(value)

    def config(self) -> dict:
        """The Hugging Face config keys the metadata describes (common keys, then `extra_config`)."""
        header, meta, p = self.header, self.header.metadata, self.prefix
        required = ("block_count", "embedding_length", "attention.head_count")
        required += ("feed_forward_length",) if self.has_feed_forward_length else ()
        missing = [k for k in required if p + k not in meta]
        if missing:
            raise UnsupportedConfigError(f"{header.path}: GGUF metadata lacks {', '.join(p + k for k in missing)}")
        for key in required:
            value = meta[p + key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UnsupportedConfigError(f"{header.path}: {p}{key} = {value!r}; expected a positive integer")
        hidden, heads = int(meta[p + "embedding_length"]), int(meta[p + "attention.head_count"])
        kv_heads = meta.get(p + "attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise UnsupportedConfigError(f"{header.path}: {p}attention.head_count_kv varies per layer; not supported")
        head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
        for key, value in (("attention.head_count_kv", kv_heads), ("attention.key_length (head size)", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UnsupportedConfigError(f"{header.path}: {p}{key} = {value!r}; expected a positive integer")
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = meta.get(p + "vocab_size")
        if vocab is None:
            emb = header.tensors.get("token_embd.weight")
            vocab = emb.shape[0] if emb is not None else (len(tokens) if tokens else None)
        if vocab is None:
            raise UnsupportedConfigError(f"{header.path}: cannot tell the vocabulary size ({p}vocab_size, token_embd)")
        cfg = {
            "vocab_size": int(vocab),
            "hidden_size": hidden,
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
        if self.has_feed_forward_length:
            cfg["intermediate_size"] = int(meta[p + "feed_forward_length"])
        rope_dims = meta.get(p + "rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            cfg["partial_rotary_factor"] = int(rope_dims) / head_dim
        kind = meta.get(p + "rope.scaling.type")
        if kind not in (None, "none"):
            if kind not in ("linear", "yarn"):
                raise UnsupportedConfigError(f"{header.path}: {p}rope.scaling.type {kind!r} is not supported "
                                             "(linear, yarn)")
            cfg["rope_scaling"] = {"rope_type": kind, "factor": float(meta[p + "rope.scaling.factor"])}
            if kind == "yarn":  # the keys llama.cpp's converter writes from the YaRN parameters
                cfg["rope_scaling"]["original_max_position_embeddings"] = self.meta_int(
                    "rope.scaling.original_context_length")
                for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                  ("yarn_attn_factor", "attention_factor")):
                    if p + "rope.scaling." + key in meta:
                        cfg["rope_scaling"][name] = float(meta[p + "rope.scaling." + key])
        cfg.update(self.extra_config(cfg))
        self.check_sizes(cfg)
        return cfg

    def check_sizes(self, cfg: dict):
        """The metadata's sizes against the tensors the file holds, before a model of those sizes is built
        (a corrupt ``block_count`` or ``embedding_length`` must not build a huge model): UnsupportedConfigError
        naming the key, its value and the tensors' evidence."""
        header, p = self.header, self.prefix
        blocks = {int(n.split(".")[1]) for n in header.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
        if cfg["num_hidden_layers"] != len(blocks) or (blocks and max(blocks) != len(blocks) - 1):
            raise UnsupportedConfigError(f"{header.path}: {p}block_count = {cfg['num_hidden_layers']}, but the file "
                                         f"holds tensors of {len(blocks)} blocks")
        table = header.tensors.get("token_embd.weight")
        if table is not None and len(table.shape) == 2 and table.shape[1] != cfg["hidden_size"]:
            raise UnsupportedConfigError(f"{header.path}: {p}embedding_length = {cfg['hidden_size']}, but "
                                         f"token_embd.weight has rows of {table.shape[1]}")
        up = header.tensors.get("blk.0.ffn_up.weight")
        if (up is not None and len(up.shape) == 2 and "intermediate_size" in cfg
                and up.shape[0] != cfg["intermediate_size"]):
            raise UnsupportedConfigError(f"{header.path}: {p}feed_forward_length = {cfg['intermediate_size']}, but "
                                         f"blk.0.ffn_up.weight has {up.shape[0]} rows")
        q = header.tensors.get("blk.0.attn_q.weight")
        heads = cfg["num_attention_heads"]
        if q is not None and len(q.shape) == 2 and (heads <= 0 or q.shape[0] != heads * cfg["head_dim"]):
            raise UnsupportedConfigError(f"{header.path}: {p}attention.head_count = {heads} with heads of "
                                         f"{cfg['head_dim']}, but blk.0.attn_q.weight has {q.shape[0]} rows")

    def extra_config(self, config: dict) -> dict:
        """Hook: architecture-specific config keys (``config`` holds the common ones)."""
        return {}

    # -- tensors -----------------------------------------------------------------------------------
    def hf_name(self, name: str) -> str | None:
        """Hugging Face name of a GGUF tensor name by the name tables (None when they do not map it)."""
        stem, _, suffix = name.rpartition(".")
        if not stem:
            return None
        if stem in self.global_names:
            return f"{self.global_names[stem]}.{suffix}"
        parts = stem.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in self.block_names:
            return f"model.layers.{parts[1]}.{self.block_names[parts[2]]}.{suffix}"
        return None

    def convert(self, arrays: dict, config: dict) -> dict:
        """``{GGUF name: array}`` -> ``{Hugging Face name: array}``: renamed by the tables, each tensor
        through `transform`; unmapped tensors keep their GGUF name (a strict load reports them).

        ``arrays`` is consumed (emptied): a tensor `transform` replaces is computed at once and the
        file's version released, so at most one tensor's copy exists beyond the weights at any time.

        Raises:
            WeightLoadError: every tensor `transform` found misshaped.
        """
        tensors, bad = {}, {}
        for name in list(arrays):
            a = arrays.pop(name)
            new = self.hf_name(name)
            if new is None:
                tensors[name] = a
                continue
            try:
                out = self.transform(new, a, config)
            except Misfit as e:
                bad[new] = (e.expected, str(tuple(a.shape)))
                continue
            if out is not a:
                mx.eval(out)
            tensors[new] = out
            del a, out
        if bad:
            raise WeightLoadError(mismatched=bad, source=str(self.header.path))
        return tensors

    def dense(self, arrays: dict, name: str):
        """Tensor ``name`` taken out of ``arrays`` as float32 (GGML blocks decoded, no longer counted as
        packed); None when absent (a strict load then reports the missing parameter)."""
        a = arrays.pop(name, None)
        if a is None:
            return None
        kind = self.packed.pop(name, None)
        a = ggml.get_type(kind).decode(a) if kind is not None else a.astype(mx.float32)
        mx.eval(a)
        return a

    def stacked_experts(self, arrays: dict, layer: int) -> dict:
        """Block ``layer``'s ``ffn_{gate,up,down}_exps`` taken out of ``arrays`` as float32
        ``model.layers.<layer>.mlp.experts.gate_up_proj`` ``[E, 2*I, W]`` (gate rows, then up rows) and
        ``.down_proj`` ``[E, W, I]``; ``{}`` (and ``arrays`` untouched) unless all three are there, so a
        layer missing one keeps its GGUF names for a strict load to report."""
        names = [f"blk.{layer}.ffn_{kind}_exps.weight" for kind in ("gate", "up", "down")]
        if not all(n in arrays for n in names):
            return {}
        gate, up, down = (self.dense(arrays, n) for n in names)
        pre = f"model.layers.{layer}.mlp.experts."
        out = {pre + "gate_up_proj": mx.concatenate([gate, up], axis=1), pre + "down_proj": down}
        mx.eval(out[pre + "gate_up_proj"])
        return out

    def transform(self, name: str, array, config: dict):
        """Hook: undo llama.cpp's transform of one tensor (``name`` already Hugging Face's); raise `Misfit`
        for a tensor whose shape does not fit."""
        return array

    def quantization(self, tensors: dict) -> dict | None:
        """The ``quantization`` config (metalnn / MLX form) of the layers the file stores quantized:
        ``{"ggml_type": ...}`` for those kept as blocks, MLX's affine settings for Q4_0 ... Q8_0 weights
        read as MLX's layout (converters that regroup columns)."""
        affine, blocks = {}, {}
        for info in self.header.tensors.values():
            name = self.hf_name(info.name) if info.name.endswith(".weight") else None
            if name is None:
                continue
            module = name[: -len(".weight")]
            if info.name in self.packed:
                blocks[module] = self.packed[info.name]
            elif info.type in AFFINE:
                affine[module] = (32, AFFINE[info.type][0], "affine")
        return config_from_settings(affine, blocks)


class Misfit(Exception):
    """A tensor whose shape a converter cannot transform (``expected``: what it needs)."""

    def __init__(self, expected: str):
        super().__init__(expected)
        self.expected = expected


def converter_for(header: GGUFHeader, converters: dict) -> type:
    """The converter class of the file's architecture; UnsupportedConfigError naming the supported ones."""
    arch = header.architecture
    if arch not in converters:
        raise UnsupportedConfigError(f"{header.path}: GGUF architecture {arch!r} is not supported; metalnn reads "
                                     f"{', '.join(sorted(converters))}")
    return converters[arch]


def read_checkpoint(path, converters: dict) -> GGUFCheckpoint:
    """Read a ``.gguf`` file: config, tensors under Hugging Face's names (llama.cpp's transforms undone)
    and header.

    Args:
        path: the ``.gguf`` file.
        converters: ``{GGUF architecture: Converter class}`` (`metalnn.llm.models.ARCHITECTURES`
            ``.gguf_converters()``).
    Raises:
        WeightLoadError: not GGUF, truncated, corrupt, tensor types no model uses, or tensors the
            converter cannot place.
        UnsupportedConfigError: an architecture or metadata value metalnn does not support.
    """
    header = read_header(path)
    converter = converter_for(header, converters)(header)
    config = converter.config()
    arrays, converter.packed = read_tensors(header, regroupable=not converter.keeps_ggml_blocks)
    tensors = converter.convert(arrays, config)
    q = converter.quantization(tensors)
    if q is not None:
        config["quantization"] = q
    return GGUFCheckpoint(config, tensors, header)


__all__ = ["BLOCK_NAMES", "Converter", "GGUFCheckpoint", "GLOBAL_NAMES", "Misfit", "converter_for",
           "read_checkpoint"]

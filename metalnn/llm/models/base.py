"""What every language model in `metalnn.llm.models` shares: `BaseModelArgs` (the typed config) and
`CausalLM` (the model-level API: calling, caches, generation support, loading and saving).

An architecture module declares a ``ModelArgs(BaseModelArgs)`` dataclass (every config key it reads,
with its default) and a `CausalLM` subclass that builds its layers from those args, and registers
the class (`metalnn.llm.models.registry.register`). A model can then be used three ways:

* ``model(tokens)`` with integer tokens ``[B, T]`` (or ``[T]``) returns logits ``[B, T, vocab]``
  (``[T, vocab]``) as an ``mx.array``;
* ``model.compile(device, Data(tokens))`` returns the logits as `Data` ``(W=vocab, H=T, D=B)``;
* ``model(tokens, cache=model.make_cache())`` runs incrementally: each call appends its positions
  to the per-layer caches (see `metalnn.generate`).

A model built from a config starts in training mode, like any mlx.nn module; `load_pretrained`
returns it in evaluation mode (as transformers' ``from_pretrained`` does).
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import mlx.core as mx

from ... import init as initializers
from ... import quantization
from ...data import Data, MTLSize
from ...device import Device, resolve
from ...errors import UnsupportedConfigError
from ...functional.decode_step import STACK_POSITIONS
from ...layers.attention import KVCache
from ...layers.base import Layer
from ...weights import load_into, save_safetensors

_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "fp32": mx.float32,
          "fp16": mx.float16, "bf16": mx.bfloat16}


def dtype_name(dtype) -> str:
    return _DTYPE_NAMES.get(dtype, "float32")


def refuse(field: str, value, supported) -> typing.NoReturn:
    """Raise the `UnsupportedConfigError` for a config value metalnn cannot honour: the field, the
    value given and what is supported."""
    raise UnsupportedConfigError(f"{field} = {value!r} is not supported (supported: {supported})")


def _scalar_type(hint):
    """``int``, ``float`` or ``bool`` for a field annotated so (or ``... | None``); None for any other type."""
    if hint in (int, float, bool):
        return hint
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) and len(args) == 2 and type(None) in args:
        other = args[0] if args[1] is type(None) else args[1]
        if other in (int, float, bool):
            return other
    return None


def _coerce(name: str, kind, value):
    """``value`` as ``kind``: JSON and GGUF numbers arrive as int or float, whichever they were written as."""
    if kind is bool:
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
        refuse(name, value, "true or false")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        refuse(name, value, "an integer" if kind is int else "a number")
    if kind is int:
        if float(value) != int(value):
            refuse(name, value, "an integer")
        return int(value)
    return float(value)


def text_config(config: dict) -> dict:
    """The text model's config: ``config["text_config"]`` for a multimodal config (Qwen3.5's, Gemma 3's;
    with the top level's ``tie_word_embeddings``, which decides the tying there, as in transformers),
    else ``config``."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return dict(config)
    out = dict(text)
    if "tie_word_embeddings" in config:
        out["tie_word_embeddings"] = config["tie_word_embeddings"]
    out.pop("architectures", None)
    return out


@dataclass
class BaseModelArgs:
    """Base of every architecture's ``ModelArgs`` dataclass (as in mlx-lm's ``models/base.py``).

    A subclass declares, as fields, every config key its architecture reads with transformers'
    default (required keys have none); derived values (``head_dim`` from the widths, ...) are filled
    in by its ``__post_init__``, which also refuses the values metalnn cannot honour (`refuse`).
    Fields annotated ``int``, ``float`` or ``bool`` (or ``... | None``) are converted to that type
    here; a non-integral number for an ``int`` is refused.
    """

    @classmethod
    def from_dict(cls, params: dict):
        """The args of a Hugging Face style config dict. Keys that are no field are ignored; a key
        given as null takes its field's default unless the field is annotated ``... | None`` (a
        required key given as null is absent).

        Raises:
            UnsupportedConfigError: a required key absent (all of them named) or a value refused.
        """
        declared = [f for f in fields(cls) if f.init]
        required = [f.name for f in declared if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if params.get(name) is None]
        if missing:
            raise UnsupportedConfigError(f"the config lacks {', '.join(missing)} (required)")
        kwargs = {}
        for f in declared:
            value = params.get(f.name)
            if value is not None or (f.name in params and _allows_none(cls, f.name)):
                kwargs[f.name] = value
        return cls(**kwargs)

    def __post_init__(self):
        hints = _hints(type(self))
        for f in fields(self):
            if not f.init:
                continue
            scalar = _scalar_type(hints.get(f.name))
            value = getattr(self, f.name)
            if scalar is None or value is None:
                continue
            setattr(self, f.name, _coerce(f.name, scalar, value))


def _hints(cls) -> dict:
    cached = cls.__dict__.get("_type_hints")
    if cached is None:
        cached = typing.get_type_hints(cls)
        cls._type_hints = cached
    return cached


def _allows_none(cls, name: str) -> bool:
    """Whether field ``name`` is annotated ``... | None`` (an explicit null then stays null)."""
    hint = _hints(cls).get(name)
    return hint is None or type(None) in typing.get_args(hint)


class CausalLM(Layer):
    """Base of decoder-only language models built from a config dict.

    A subclass sets ``args_class`` (its ``ModelArgs``) and creates its layers in ``_build(args)``:
    ``model`` (embedding to final norm, with ``embed_tokens`` and ``layers``) and, unless
    ``tie_word_embeddings``, ``lm_head``; ``forward`` (``model``, then ``lm_head`` or the tied
    embedding) is shared. A model laid out otherwise overrides ``backbone``, ``input_embeddings``
    and ``decoder_layers``. Loading and saving go through
    ``rename_weight`` / ``transform_weight`` (checkpoint -> metalnn) and ``export_weights``
    (metalnn -> checkpoint). `register` sets ``architecture`` and ``model_type``.

    Args:
        config: the Hugging Face style config dict (as in ``config.json``).
        seed: every random initial value derives from it (the same seed, the same model).
    Raises:
        UnsupportedConfigError: the config lacks a required key or holds a value metalnn cannot
            honour (the message starts with the architecture).
    """

    architecture = ""
    model_type = ""
    #: the architecture's ``ModelArgs`` dataclass
    args_class: type[BaseModelArgs] = BaseModelArgs
    #: token ids `metalnn.generate` stops at by default; `load_pretrained` sets them from the
    #: checkpoint's tokenizer (empty: no default stop)
    eos_token_ids = frozenset()

    def __init__(self, config: dict, seed: int = 0):
        super().__init__()
        self._config = dict(config)
        try:
            self.args = self.args_class.from_dict(self._config)
        except UnsupportedConfigError as e:
            raise UnsupportedConfigError(f"{self.architecture or type(self).__name__}: {e}") from None
        with initializers.seeded(seed):
            self._build(self.args)
            self._materialize(seed)

    def _build(self, args):  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}._build")

    @property
    def config(self) -> dict:
        """The Hugging Face style config dict the model was built from (written back by `save_pretrained`)."""
        return self._config

    # -- construction ------------------------------------------------------------------------
    def _materialize(self, seed: int = 0):
        """Create every parameter now (one lazy compile on a dummy token; nothing is computed
        until the parameters are used, so loading weights afterwards costs no initialisation)."""
        dev = Device(kernels="reference", seed=seed)  # the dummy pass is never evaluated
        self.compile(dev, Data(mx.zeros((1, 1), dtype=mx.int32)))

    # Hugging Face's common layout: ``model`` (a `DecoderStack`: ``embed_tokens``, ``layers``, ``norm``);
    # an architecture laid out otherwise (GPT-2's ``transformer``) overrides these three.
    @property
    def backbone(self) -> Layer:
        """The layer from token ids ``(W=T, H=1, D=B)`` to final hidden states ``(W=hidden, H=T, D=B)``."""
        return self.model

    @property
    def input_embeddings(self) -> Layer:
        """The token `Embedding` (the output head when ``tie_word_embeddings``)."""
        return self.backbone.embed_tokens

    @property
    def output_head(self) -> Layer:
        """The layer whose product with the final hidden states gives the logits: ``lm_head``, or
        the token table when ``tie_word_embeddings``."""
        return self.input_embeddings if self.tie_word_embeddings else self.lm_head

    @property
    def decoder_layers(self) -> list:
        """The decoder blocks, in order (one cache entry each)."""
        return self.backbone.layers

    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers)

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether the output head is the transposed token embedding (no ``lm_head``)."""
        return bool(self.args.tie_word_embeddings)

    @property
    def vocab_size(self) -> int:
        return int(self.args.vocab_size)

    @property
    def logit_softcap(self) -> float | None:
        """Soft cap of the output logits (``cap * tanh(logits / cap)``, Gemma 2's
        ``final_logit_softcapping``); None (the default) leaves them."""
        return None

    @property
    def features(self) -> list:
        """The architecture's special features as short phrases (`metalnn info` lists them; none here)."""
        return []

    @property
    def max_positions(self) -> int | None:
        """The hard limit of positions (learned position embeddings); None for rotary models."""
        return None

    @property
    def context_length(self) -> int | None:
        """The most positions the model was trained for: the hard limit of learned position
        embeddings, else the config's ``max_position_embeddings`` (None when it does not say)."""
        limit = self.max_positions
        if limit is None:
            limit = getattr(self.args, "max_position_embeddings", None)
        return int(limit) if limit else None

    def make_cache(self) -> list:
        """One empty `KVCache` per decoder layer."""
        return [KVCache() for _ in range(self.num_layers)]

    def prefill_spans(self, length: int) -> list:
        """The ``(start, end)`` runs of ``length`` prompt positions that only fill the cache, one model
        call each: the whole prompt at once (a pipeline-split model cuts it into micro-batches, see
        `metalnn.llm.distributed.pipeline.PipelineLM`)."""
        return [(0, int(length))] if length > 0 else []

    # -- calling -----------------------------------------------------------------------------
    def __call__(self, tokens, *args, cache=None, device: Device | None = None, last_only=False):
        """Logits for integer ``tokens`` ``[B, T]`` -> ``[B, T, vocab]`` (``[T]`` -> ``[T, vocab]``);
        a `Data` of token ids gives `Data` logits. ``last_only``: True gives the logits of the last
        position alone (``[B, 1, vocab]``, ``[1, vocab]``): the output head reads one position instead
        of ``T`` (a prompt's first token needs no more); a list of ``B`` positions gives row ``b``'s
        logits at position ``last_only[b]`` (right-padded prompts of different lengths run together)."""
        if args:
            raise TypeError(f"{self._describe()}: call it as model(tokens, cache=..., device=...); options are "
                            "keywords")
        last_only = bool(last_only) if last_only is None or isinstance(last_only, bool) else list(last_only)
        options = {"last_only": last_only} if last_only is not False else {}  # (overrides need not know it)
        if isinstance(tokens, Data):
            return self.compile(device, tokens, cache=cache, **options)
        tokens = tokens if isinstance(tokens, mx.array) else mx.array(tokens)
        if tokens.ndim not in (1, 2):
            raise ValueError(f"{self._describe()}: tokens must be [T] or [B, T], got shape {tuple(tokens.shape)}")
        if not mx.issubdtype(tokens.dtype, mx.integer):
            raise TypeError(f"{self._describe()}: tokens must be integers, got {tokens.dtype}")
        b, t = (1, tokens.shape[0]) if tokens.ndim == 1 else tokens.shape
        out = self.compile(device, Data(tokens.reshape(b, t)), cache=cache, **options).array
        return out.reshape(out.shape[1], -1) if tokens.ndim == 1 else out

    def hidden_states(self, tokens, *, device: Device | None = None) -> mx.array:
        """The final hidden states (the backbone's output, after the final norm, before the output
        head) of integer ``tokens`` ``[B, T]`` -> ``[B, T, hidden]`` (``[T]`` -> ``[T, hidden]``).

        Positions attend causally, as in ``model(tokens)``: each row's states at positions ``< t``
        do not depend on the tokens from ``t`` on (so right padding leaves earlier states unchanged).
        """
        tokens = tokens if isinstance(tokens, mx.array) else mx.array(tokens)
        if tokens.ndim not in (1, 2) or tokens.shape[-1] == 0:
            raise ValueError(f"{self._describe()}: tokens must be [T] or [B, T] with T >= 1, got shape "
                             f"{tuple(tokens.shape)}")
        if not mx.issubdtype(tokens.dtype, mx.integer):
            raise TypeError(f"{self._describe()}: tokens must be integers, got {tokens.dtype}")
        b, t = (1, tokens.shape[0]) if tokens.ndim == 1 else tokens.shape
        self._check_positions(None, t)
        device = resolve(device)
        with mx.stream(device.stream):
            h = self.compile_child(self.backbone, device, Data(tokens.reshape(b, t).astype(mx.int32))).array
        h = h.reshape(b, t, -1)
        return h[0] if tokens.ndim == 1 else h

    def forward(self, device, data, cache=None, last_only=False):
        """Token ids ``(W=T, H=1, D=B)`` -> logits ``(W=vocab, H=T, D=B)`` (``H=1`` with
        ``last_only``: the last position's, or each row's position of the list)."""
        ids = self._token_batch(data)
        b, t = ids.shape
        self._check_positions(cache, t)
        rows = None if isinstance(last_only, bool) else self._row_positions(last_only, b, t)
        # (one position a row: the list's positions are all 0, its last)
        fused_last = last_only if isinstance(last_only, bool) else (True if t == 1 else None)
        if cache is not None and t <= STACK_POSITIONS and fused_last is not None and self.logit_softcap is None:
            # a few new positions a sequence (decoding, a prompt's rest after a cached prefix, draft
            # tokens): the blocks, final norm and head as one fused node where the backbone has that
            # step and it runs them (`DecoderStack.fused_logits`)
            fused = getattr(self.backbone, "fused_logits", None)
            logits = None if fused is None else fused(device, ids, cache, self.output_head, last_only=fused_last)
            if logits is not None:
                return Data(logits, MTLSize(logits.shape[-1], logits.shape[1], b))
        h = self.compile_child(self.backbone, device, Data(ids), cache=cache)
        if last_only is not False and t > 1:
            h3 = h.array.reshape(b, h.dims.H, -1)
            if last_only is True:
                h3 = h3[:, -1:, :]
            else:  # (row b's position last_only[b])
                h3 = mx.take_along_axis(h3, rows[:, None, None], axis=1)
            t = 1
            h = Data(h3, MTLSize(h.dims.W, 1, b))
        if self.tie_word_embeddings:
            logits = Data(self.input_embeddings.as_linear(h.array, device=device), MTLSize(self.vocab_size, t, b))
        else:
            logits = self.compile_child(self.lm_head, device, h)
        cap = self.logit_softcap
        if cap is None:
            return logits
        return Data(mx.tanh(logits.array / cap) * cap, logits.dims)

    def _row_positions(self, positions, b: int, t: int) -> mx.array:
        """``last_only``'s list of one position per row (``b`` rows of ``t`` positions), checked: int32 ``[b]``."""
        positions = [int(p) for p in positions]
        if len(positions) != b or any(not 0 <= p < t for p in positions):
            raise ValueError(f"{self._describe()}: last_only must be True, False or one position in [0, {t}) per "
                             f"row ({b} rows), got {positions}")
        return mx.array(positions, dtype=mx.int32)

    def _token_batch(self, data: Data):
        """Token ids ``[B, T]`` from input `Data` (``(W=T, H=1, D=B)``, or ``(W=T, H=B, D=1)``)."""
        d = data.dims
        ids = data.array
        if not mx.issubdtype(ids.dtype, mx.integer):
            ids = ids.astype(mx.int32)
        return ids.reshape(d.H * d.D, d.W)

    def _check_positions(self, cache, t):
        limit = self.max_positions
        start = cache[0].offset if cache else 0
        if limit is not None and start + t > limit:
            raise ValueError(f"{self._describe()}: positions up to {start + t} requested but the model has "
                             f"{limit} (max_position_embeddings / n_positions)")
        if cache is not None and len(cache) != self.num_layers:
            raise ValueError(f"{self._describe()}: cache has {len(cache)} entries, the model {self.num_layers} "
                             f"layers (use model.make_cache())")

    # -- weights -----------------------------------------------------------------------------
    def rename_weight(self, name: str):
        """Checkpoint tensor name -> metalnn parameter name (None drops it): a tied model's
        ``lm_head.weight`` and rotary ``inv_freq`` buffers are dropped."""
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        if name.endswith(".rotary_emb.inv_freq"):
            return None
        return name

    def transform_weight(self, name: str, array):
        """Adjust a checkpoint tensor (already renamed) to metalnn's layout."""
        return array

    def export_weights(self) -> dict:
        """``{checkpoint name: array}`` in the Hugging Face layout."""
        return self.named_parameters()

    def load_weights_from(self, provider, strict: bool = True):
        """Load a checkpoint (folder, file, dict or provider) with this model's rename/transform hooks."""
        return load_into(self, provider, strict=strict, rename=self.rename_weight, transform=self.transform_weight)

    def hf_config(self) -> dict:
        """The config dict written by `save_pretrained`."""
        cfg = dict(self.config)
        cfg["architectures"] = [self.architecture]
        cfg["model_type"] = self.model_type
        floats = [a.dtype for a in self.named_parameters().values() if mx.issubdtype(a.dtype, mx.floating)]
        cfg["torch_dtype"] = cfg["dtype"] = dtype_name(floats[0] if floats else mx.float32)
        cfg.pop("quantization", None)
        cfg.pop("quantization_config", None)
        q = quantization.config_of(self)
        if q is not None:  # MLX's layout: both keys, same dict
            cfg["quantization"] = q
            cfg["quantization_config"] = dict(q)
        return cfg

    def save_pretrained(self, path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` in the Hugging Face layout.

        ``transformers``' ``AutoModelForCausalLM.from_pretrained(path)`` loads the result.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_safetensors(path / "model.safetensors", self.export_weights(), metadata={"format": "pt"})
        tmp = path / ".config.json.tmp"
        tmp.write_text(json.dumps(self.hf_config(), indent=2, sort_keys=True) + "\n")
        tmp.replace(path / "config.json")
        return path

    def save_gguf(self, path, type: str = "Q4_K_M", tokenizer=None, **kwargs) -> Path:
        """Write the model as a GGUF file llama.cpp, Ollama and LM Studio load, in the mix ``type``
        (``Q4_K_M``, ``Q5_K_M``, ``Q6_K``, ``Q8_0``, ``Q4_0``, ``F16``, ``BF16``, ``F32``); ``tokenizer``:
        the model's `Tokenizer` or its ``.gguf`` file. See `metalnn.llm.gguf.export.save_gguf`."""
        from ..gguf.export import save_gguf

        return save_gguf(self, path, type=type, tokenizer=tokenizer, **kwargs)

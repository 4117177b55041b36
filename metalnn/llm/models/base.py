"""`CausalLM`: what every language model in `metalnn.llm.models` shares.

A model is a `metalnn.Layer` built from a Hugging Face style config dict. It can be used three ways:

* ``model(tokens)`` with integer tokens ``[B, T]`` (or ``[T]``) returns logits ``[B, T, vocab]``
  (``[T, vocab]``) as an ``mx.array``;
* ``model.compile(device, Data(tokens))`` returns the logits as `Data` ``(W=vocab, H=T, D=B)``;
* ``model(tokens, cache=model.make_cache())`` runs incrementally: each call appends its positions
  to the per-layer `KVCache` (see `metalnn.generate`).

A model built from a config starts in training mode, like any mlx.nn module; `load_pretrained`
returns it in evaluation mode (as transformers' ``from_pretrained`` does).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from ... import init as initializers
from ... import quantization
from ...data import Data
from ...device import Device
from ...layers.base import Layer
from ...layers.attention import KVCache
from ...weights import load_into, save_safetensors

_DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "fp32": mx.float32,
          "fp16": mx.float16, "bf16": mx.bfloat16}


def dtype_name(dtype) -> str:
    return _DTYPE_NAMES.get(dtype, "float32")


class CausalLM(Layer):
    """Base of decoder-only language models built from a config dict.

    Subclasses set ``architecture`` / ``model_type``, create their layers in ``_build()`` (from
    ``self.config``), and implement ``forward(device, data, cache)``. Loading and saving go through
    ``rename_weight`` / ``transform_weight`` (checkpoint -> metalnn) and ``export_weights``
    (metalnn -> checkpoint).

    Args:
        config: the Hugging Face style config dict (as in ``config.json``).
        seed: every random initial value derives from it (the same seed, the same model).
    """

    architecture = ""
    model_type = ""
    #: token ids `metalnn.generate` stops at by default; `load_pretrained` sets them from the
    #: checkpoint's tokenizer (empty: no default stop)
    eos_token_ids = frozenset()

    def __init__(self, config: dict, seed: int = 0):
        super().__init__()
        self._config = dict(config)
        with initializers.seeded(seed):
            self._build()
            self._materialize(seed)

    def _build(self):  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}._build")

    @property
    def config(self) -> dict:
        """The Hugging Face style config dict the model was built from."""
        return self._config

    # -- construction ------------------------------------------------------------------------
    def _materialize(self, seed: int = 0):
        """Create every parameter now (one lazy compile on a dummy token; nothing is computed
        until the parameters are used, so loading weights afterwards costs no initialisation)."""
        dev = Device(kernels="reference", seed=seed)  # the dummy pass is never evaluated
        self.compile(dev, Data(mx.zeros((1, 1), dtype=mx.int32)))

    @property
    def num_layers(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def max_positions(self) -> int | None:
        return None

    @property
    def context_length(self) -> int | None:
        """The most positions the model was trained for: the hard limit of learned position
        embeddings, else the config's ``max_position_embeddings`` (None when it does not say)."""
        limit = self.max_positions
        if limit is None:
            limit = self.config.get("max_position_embeddings") or self.config.get("n_positions")
        return int(limit) if limit else None

    @property
    def eos_token_id(self):
        return self.config.get("eos_token_id")

    def make_cache(self):
        """One empty `KVCache` per attention layer."""
        return [KVCache() for _ in range(self.num_layers)]

    # -- calling -----------------------------------------------------------------------------
    def __call__(self, tokens, *args, cache=None, device: Device | None = None):
        """Logits for integer ``tokens`` ``[B, T]`` -> ``[B, T, vocab]`` (``[T]`` -> ``[T, vocab]``);
        a `Data` of token ids gives `Data` logits."""
        if args:
            raise TypeError(f"{self._describe()}: call it as model(tokens, cache=..., device=...); options are "
                            "keywords")
        if isinstance(tokens, Data):
            return self.compile(device, tokens, cache=cache)
        tokens = tokens if isinstance(tokens, mx.array) else mx.array(tokens)
        if tokens.ndim not in (1, 2):
            raise ValueError(f"{self._describe()}: tokens must be [T] or [B, T], got shape {tuple(tokens.shape)}")
        if not mx.issubdtype(tokens.dtype, mx.integer):
            raise TypeError(f"{self._describe()}: tokens must be integers, got {tokens.dtype}")
        b, t = (1, tokens.shape[0]) if tokens.ndim == 1 else tokens.shape
        out = self.compile(device, Data(tokens.reshape(b, t)), cache=cache).array
        return out.reshape(t, -1) if tokens.ndim == 1 else out

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
        """Checkpoint tensor name -> metalnn parameter name (None drops it)."""
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

    def forward(self, device, data, cache=None):  # pragma: no cover - abstract
        raise NotImplementedError

"""Pretrained language models: build from a Hugging Face folder, run, generate, save back.

>>> model = metalnn.models.load_pretrained("path/to/folder")      # config.json + *.safetensors
>>> logits = model(mx.array([[1, 2, 3]]))                           # [1, 3, vocab]
>>> new = metalnn.generate(model, [1, 2, 3], max_new_tokens=20)     # greedy
>>> model.save_pretrained("out/")                                   # transformers can load it

Supported architectures: ``LlamaForCausalLM``, ``GPT2LMHeadModel``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Qwen3NextForCausalLM`` and ``Qwen3_5ForCausalLM`` (also
the text model of a ``Qwen3_5ForConditionalGeneration`` folder).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from ..errors import UnsupportedConfigError, WeightLoadError
from ..weights import open_provider
from ..tokenizer import Tokenizer, char_tokenizer, load_tokenizer
from .base import DTYPES, CausalLM
from .gpt2 import GPT2LMHeadModel
from .llama import LlamaForCausalLM, llama_config
from .mistral import MistralForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_5 import Qwen3_5ForCausalLM
from .qwen3_next import Qwen3NextForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,  # its text model
}
_MODEL_TYPES = {"llama": LlamaForCausalLM, "gpt2": GPT2LMHeadModel, "qwen2": Qwen2ForCausalLM,
                "qwen3": Qwen3ForCausalLM, "mistral": MistralForCausalLM, "qwen3_next": Qwen3NextForCausalLM,
                "qwen3_5_text": Qwen3_5ForCausalLM, "qwen3_5": Qwen3_5ForCausalLM}


def read_config(path) -> dict:
    path = Path(path)
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.exists():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model folder)")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedConfigError(f"{cfg_path}: not valid JSON ({e})") from None


def model_class(config: dict):
    """The metalnn class for a config's ``architectures`` (or ``model_type``)."""
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    if not archs and config.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[config["model_type"]]
    named = ", ".join(archs) if archs else f"model_type={config.get('model_type')!r}"
    raise UnsupportedConfigError(f"unsupported architecture {named}; metalnn supports "
                                 f"{', '.join(sorted(ARCHITECTURES))}")


def from_config(config: dict, seed: int = 0, dtype=None) -> CausalLM:
    """A randomly initialised model for a config dict."""
    model = model_class(config)(config, seed=seed)
    if dtype is not None:
        model.set_dtype(_as_dtype(dtype))
    return model


def _as_dtype(dtype):
    if isinstance(dtype, str):
        try:
            return DTYPES[dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}") from None
    return dtype


def load_pretrained(path, dtype=None, strict: bool = True) -> CausalLM:
    """Build the model described by ``path/config.json`` and load its safetensors weights.

    Args:
        path: a Hugging Face folder: ``config.json`` plus ``model.safetensors`` or a sharded
            ``model.safetensors.index.json``.
        dtype: parameter dtype (``mx.float32``, ``"bfloat16"``, ...); default: the checkpoint's.
        strict: every parameter must be present and every tensor used (all problems are listed
            in one `WeightLoadError`).
    Returns:
        the model, in evaluation mode (``model.train()`` before fine-tuning with dropout).
    Raises:
        UnsupportedConfigError: unknown architecture or unsupported feature.
        WeightLoadError: missing, unexpected or mis-shaped tensors, or unreadable files.
    """
    path = Path(path)
    config = read_config(path)
    cls = model_class(config)
    model = cls(config)
    provider = open_provider(path)
    if dtype is None:
        floats = [provider.spec(k)[1] for k in provider.keys()]
        floats = [d for d in floats if mx.issubdtype(d, mx.floating)]
        dtype = floats[0] if floats else mx.float32
    dtype = _as_dtype(dtype)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    try:
        model.load_weights_from(provider, strict=strict)
    except WeightLoadError as e:
        raise WeightLoadError(e.missing, e.unexpected, e.mismatched, source=str(path),
                              message=f"{cls.architecture}: " + e.message) from None
    return model.eval()


__all__ = ["ARCHITECTURES", "CausalLM", "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
           "Qwen3ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Tokenizer", "UnsupportedConfigError",
           "char_tokenizer", "from_config", "llama_config", "load_pretrained", "load_tokenizer", "model_class",
           "read_config"]

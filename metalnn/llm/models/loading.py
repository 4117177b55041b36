"""Pretrained language models: build from a Hugging Face folder, run, generate, save back.

>>> model = metalnn.llm.models.load_pretrained("path/to/folder")      # config.json + *.safetensors
>>> logits = model(mx.array([[1, 2, 3]]))                           # [1, 3, vocab]
>>> new = metalnn.generate(model, [1, 2, 3], max_new_tokens=20)     # greedy
>>> model.save_pretrained("out/")                                   # transformers can load it

Supported architectures: ``LlamaForCausalLM``, ``GPT2LMHeadModel``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Qwen3NextForCausalLM`` and ``Qwen3_5ForCausalLM`` (also
the text model of a ``Qwen3_5ForConditionalGeneration`` folder). Checkpoints: Hugging Face folders
(float or MLX-quantized), GGUF files (`metalnn.llm.gguf.convert`) and Hub names (``"org/name"``).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from ... import quantization
from ...errors import UnsupportedConfigError, WeightLoadError
from ..gguf.reader import find_gguf
from ..hub import MODEL_FILES, local_path
from ...weights import DictProvider, open_provider
from ..tokenizer import Tokenizer, char_tokenizer, gguf_eos_ids, load_tokenizer
from ..gguf import convert as gguf
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
    """Build the model a checkpoint describes and load its weights.

    Args:
        path: a Hugging Face folder (``config.json`` plus ``model.safetensors`` or a sharded
            ``model.safetensors.index.json``; float, or MLX-quantized with a ``quantization``
            config), a ``.gguf`` file or a folder holding one, or a Hub name ``"org/name"``
            (config, safetensors and tokenizer files are fetched with ``huggingface_hub``).
        dtype: float dtype of the parameters (``mx.float32``, ``"bfloat16"``, ...; quantized
            layers keep their packed weights and take it for their scales and biases). Default:
            the checkpoint's first floating type; float32 for GGUF files (llama.cpp keeps norms in
            float32; the scales of Q4_0/Q4_1/Q8_0 blocks are then exact).
        strict: every parameter must be present and every tensor used (all problems are listed
            in one `WeightLoadError`).
    Returns:
        the model, in evaluation mode (``model.train()`` before fine-tuning with dropout). When
        the checkpoint has a tokenizer, ``model.eos_token_ids`` holds its EOS set, which
        `metalnn.generate` stops at by default.
    Raises:
        UnsupportedConfigError: unknown architecture, unsupported feature or quantization.
        WeightLoadError: missing, unexpected or mis-shaped tensors, or unreadable files.
        FileNotFoundError: no such path, and not a Hub model that can be fetched.
    """
    path = local_path(path, MODEL_FILES)
    gguf_file = find_gguf(path) if path.suffix == ".gguf" or not (path / "config.json").exists() else None
    if gguf_file is not None:
        checkpoint = gguf.read_checkpoint(gguf_file)
        config, source = checkpoint.config, gguf_file
        cls = model_class(config)
        model = cls(config)
        provider = DictProvider(checkpoint.tensors, str(gguf_file))
        default_dtype = mx.float32
    else:
        config, source = read_config(path), path
        cls = model_class(config)
        model = cls(config)
        provider = open_provider(path)
        floats = [provider.spec(k)[1] for k in provider.keys()]
        floats = [d for d in floats if mx.issubdtype(d, mx.floating)]
        default_dtype = floats[0] if floats else mx.float32
    qconfig = quantization.read_config(config, str(source))
    if qconfig is not None:
        names = [n for n in (model.rename_weight(k) for k in provider.keys()) if n is not None]
        quantization.prepare(model, qconfig, names, str(source))
    dtype = _as_dtype(default_dtype if dtype is None else dtype)
    if any(p.dtype != dtype and mx.issubdtype(p.dtype, mx.floating) for p in model.named_parameters().values()):
        model.set_dtype(dtype)
    try:
        model.load_weights_from(provider, strict=strict)
    except WeightLoadError as e:
        hint = " (the config's quantization does not fit these tensors)" if qconfig is not None and e.mismatched else ""
        raise WeightLoadError(e.missing, e.unexpected, e.mismatched, source=str(source),
                              message=f"{cls.architecture}: " + e.message + hint) from None
    model.eos_token_ids = _checkpoint_eos(path, checkpoint.header if gguf_file is not None else None)
    return model.eval()


def _checkpoint_eos(path, gguf_header) -> frozenset:
    """The EOS set of the checkpoint's tokenizer (empty when it has none)."""
    if gguf_header is not None:
        return gguf_eos_ids(gguf_header.metadata)
    try:
        return load_tokenizer(path).eos_token_ids
    except (FileNotFoundError, ValueError):
        return frozenset()


__all__ = ["ARCHITECTURES", "CausalLM", "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
           "Qwen3ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Tokenizer", "UnsupportedConfigError",
           "char_tokenizer", "from_config", "gguf", "llama_config", "load_pretrained", "load_tokenizer", "model_class",
           "read_config"]

"""Building and loading models: `from_config` (random weights), `load_pretrained` (a Hugging Face
folder, a GGUF file or a Hub name), `read_config` and `read_gguf`. Which class a config or a GGUF
file builds comes from the registry (`metalnn.llm.models.registry.ARCHITECTURES`).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from ... import quantization
from ...errors import UnsupportedConfigError, WeightLoadError
from ...weights import DictProvider, open_provider
from ..gguf import convert as gguf_convert
from ..gguf.reader import find_gguf
from ..hub import MODEL_FILES, local_path
from ..tokenizer import gguf_eos_ids, load_tokenizer
from .base import DTYPES, CausalLM
from .registry import ARCHITECTURES, model_class


def read_config(path) -> dict:
    """The ``config.json`` of a Hugging Face folder (or the file itself) as a dict.

    Raises:
        FileNotFoundError: no config.json there.
        UnsupportedConfigError: not valid JSON.
    """
    path = Path(path)
    cfg_path = path / "config.json" if path.is_dir() else path
    if not cfg_path.exists():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model folder)")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedConfigError(f"{cfg_path}: not valid JSON ({e})") from None


def read_gguf(path) -> gguf_convert.GGUFCheckpoint:
    """A ``.gguf`` file as a Hugging Face style checkpoint (`metalnn.llm.gguf.convert.read_checkpoint`
    with the converters of the registered architectures), its config naming the architecture it
    builds (``architectures``, ``model_type``)."""
    checkpoint = gguf_convert.read_checkpoint(path, ARCHITECTURES.gguf_converters())
    entry = ARCHITECTURES.for_gguf(checkpoint.header.architecture)
    checkpoint.config = {"architectures": [entry.names[0]], "model_type": entry.model_types[0], **checkpoint.config}
    return checkpoint


def from_config(config: dict, seed: int = 0, dtype=None) -> CausalLM:
    """A randomly initialised model for a config dict (``seed`` decides every initial value)."""
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


def load_pretrained(path, dtype=None, strict: bool = True, *, pipeline=None, tensor=None) -> CausalLM:
    """Build the model a checkpoint describes and load its weights.

    Args:
        path: a Hugging Face folder (``config.json`` plus ``model.safetensors`` or a sharded
            ``model.safetensors.index.json``; float, or MLX-quantized with a ``quantization``
            config), a ``.gguf`` file or a folder holding one, or a Hub name ``"org/name"``
            (config, safetensors and tokenizer files are fetched with ``huggingface_hub``).
        dtype: float dtype of the parameters (``mx.float32``, ``"bfloat16"``, ...; quantized
            layers keep their packed weights and take it for their scales and biases). Default:
            the checkpoint's first floating type; for GGUF files float32 (llama.cpp keeps norms in
            float32), or the file's half type for F16 / BF16 files. A GGUF file's quantized weights stay
            packed (`metalnn.llm.gguf.tensors`): its Q4_0 ... Q8_0 linears keep float16 scales.
        strict: every parameter must be present and every tensor used (all problems are listed
            in one `WeightLoadError`).
        pipeline: an ``mx.distributed`` group (``mx.distributed.init()`` under ``mlx.launch``): this
            rank holds a contiguous run of the blocks, balanced by parameter bytes, rank 0 also the
            token table, the last rank the final norm and head (`metalnn.llm.distributed.pipeline`).
        tensor: a group: this rank holds a share of every block's heads, hidden columns and experts'
            columns and of the vocabulary (`metalnn.llm.distributed.tensor_parallel`). With either, the
            rank reads only the tensors of its part, and every rank must run the same program (each
            call of the model is a collective). A group of one rank loads the whole model.
    Returns:
        the model, in evaluation mode (``model.train()`` before fine-tuning with dropout). When
        the checkpoint has a tokenizer, ``model.eos_token_ids`` holds its EOS set, which
        `metalnn.generate` stops at by default. ``model.generation_config`` is the checkpoint's
        recommended generation settings as a dict (a folder's ``generation_config.json``, a GGUF
        file's ``general.sampling.*`` keys as their ``generation_config.json`` names), or None
        (`metalnn.llm.sampling.SamplingParams.from_generation_config` reads it).
    Raises:
        UnsupportedConfigError: unknown architecture, unsupported feature or quantization.
        WeightLoadError: missing, unexpected or mis-shaped tensors, or unreadable files.
        FileNotFoundError: no such path, and not a Hub model that can be fetched.
    """
    if pipeline is not None and tensor is not None:
        raise UnsupportedConfigError("load_pretrained: give pipeline= or tensor=, not both")
    path = local_path(path, MODEL_FILES)
    gguf_file = find_gguf(path) if path.suffix == ".gguf" or not (path / "config.json").exists() else None
    group = pipeline if pipeline is not None else tensor
    if group is not None and group.size() > 1:
        return _load_part(path, gguf_file, dtype, strict, pipeline=pipeline, tensor=tensor)
    if gguf_file is not None:
        checkpoint = read_gguf(gguf_file)
        config, source = checkpoint.config, gguf_file
        cls = model_class(config)
        model = _build(cls, config, source)
        provider = DictProvider(checkpoint.tensors, str(gguf_file))
        default_dtype = _gguf_float_dtype(checkpoint.header)
    else:
        checkpoint = None
        config, source = read_config(path), path
        cls = model_class(config)
        model = _build(cls, config, source)
        provider = open_provider(path)
        # the model's own floats: the scales and biases of quantized layers may be of another type
        floats = [provider.spec(k)[1] for k in provider.keys() if not k.endswith((".scales", ".biases"))]
        floats = [d for d in floats if mx.issubdtype(d, mx.floating)]
        default_dtype = floats[0] if floats else mx.float32
    qconfig = quantization.read_config(config, str(source))
    if qconfig is not None:
        names = [n for n in (model.rename_weight(k) for k in provider.keys()) if n is not None]
        quantization.prepare(model, qconfig, names, str(source))
    dtype = _as_dtype(default_dtype if dtype is None else dtype)
    if any(p.dtype != dtype and mx.issubdtype(p.dtype, mx.floating) for p in model.named_parameters().values()):
        model.set_dtype(dtype)
    _keep_half_scales(model, provider)
    try:
        model.load_weights_from(provider, strict=strict)
    except WeightLoadError as e:
        hint = " (the config's quantization does not fit these tensors)" if qconfig is not None and e.mismatched else ""
        raise WeightLoadError(e.missing, e.unexpected, e.mismatched, source=str(source),
                              message=f"{cls.architecture}: " + e.message + hint) from None
    model.eos_token_ids = _checkpoint_eos(path, checkpoint.header if checkpoint is not None else None)
    model.generation_config = _generation_config(path, checkpoint.header if checkpoint is not None else None)
    # The buffers freed while loading (a transformed tensor's file version, a cast's source) would stay
    # in MLX's cache, resident, for as long as nothing of their size is allocated: they go back now.
    provider = checkpoint = None
    mx.clear_cache()
    return model.eval()


def _load_part(path, gguf_file, dtype, strict, *, pipeline, tensor) -> CausalLM:
    """`load_pretrained` of one rank's part (`metalnn.llm.distributed`): the model built from the
    config, cut to the part, and only the part's tensors read. ``model.weight_reads`` lists the
    checkpoint tensors read (safetensors names, or the GGUF file's names)."""
    from ..distributed import loader as part

    def cut(config, source, default_dtype, names):
        cls = model_class(config)
        model = _build(cls, config, source)
        qconfig = quantization.read_config(config, str(source))
        if qconfig is not None:
            quantization.prepare(model, qconfig, [n for n in map(model.rename_weight, names) if n is not None],
                                 str(source))
        want = _as_dtype(default_dtype if dtype is None else dtype)
        if any(p.dtype != want and mx.issubdtype(p.dtype, mx.floating) for p in model.named_parameters().values()):
            model.set_dtype(want)
        return part.shard_model(model, pipeline=pipeline, tensor=tensor, dtype=want), qconfig

    if gguf_file is not None:
        config, header, converter = part.gguf_config(gguf_file, ARCHITECTURES.gguf_converters())
        entry = ARCHITECTURES.for_gguf(header.architecture)
        config = {"architectures": [entry.names[0]], "model_type": entry.model_types[0], **config}
        source, default_dtype = gguf_file, _gguf_float_dtype(header)
        names = [converter.hf_name(n) or n for n in header.tensors]
        skeleton, _ = cut(dict(config), source, default_dtype, names)
        tensors, reads = part.read_gguf_part(header, converter, config, lambda own: own not in skeleton._shard.others)
        # the converter may have completed the config from tensors (Llama 3's rope factors): build again
        model, qconfig = cut(config, source, default_dtype, list(tensors))
        provider = DictProvider(tensors, str(gguf_file))
    else:
        header, config, source = None, read_config(path), path
        provider = part.TensorReader(path)
        floats = [provider.spec(k)[1] for k in provider.keys() if not k.endswith((".scales", ".biases"))]
        floats = [d for d in floats if mx.issubdtype(d, mx.floating)]
        model, qconfig = cut(config, source, floats[0] if floats else mx.float32, provider.keys())
        reads = provider.reads
    _keep_half_scales(model, provider)
    try:
        model.load_weights_from(provider, strict=strict)
    except WeightLoadError as e:
        hint = " (the config's quantization does not fit these tensors)" if qconfig is not None and e.mismatched else ""
        raise WeightLoadError(e.missing, e.unexpected, e.mismatched, source=str(source),
                              message=f"{model.architecture}: " + e.message + hint) from None
    object.__setattr__(model, "weight_reads", tuple(reads))
    model.eos_token_ids = _checkpoint_eos(path, header)
    model.generation_config = _generation_config(path, header)
    provider = tensors = None
    mx.clear_cache()
    return model.eval()


def _build(cls, config, source):
    """``cls(config)``; a value no layer accepts (a negative epsilon, a zero size) becomes an
    UnsupportedConfigError naming the checkpoint."""
    try:
        return cls(config)
    except UnsupportedConfigError:
        raise
    except (ValueError, TypeError, ArithmeticError) as e:
        raise UnsupportedConfigError(f"{source}: its config does not describe a {cls.__name__} metalnn can build "
                                     f"({type(e).__name__}: {e})") from None


def _gguf_float_dtype(header):
    """The dtype a GGUF model runs in by default: float16 / bfloat16 when the file stores its token table
    in that type (an F16 / BF16 file stays half precision), else float32 (llama.cpp keeps norms in
    float32; quantized blocks decode exactly in it)."""
    table = header.tensors.get("token_embd.weight")
    return {"F16": mx.float16, "BF16": mx.bfloat16}.get(table.type if table is not None else None, mx.float32)


def _keep_half_scales(model, provider):
    """`QuantizedLinear` layers keep their checkpoint's half-precision scales and biases in a float32
    model (a GGUF file's, or a model saved from one; exact, and the products still compute in the
    input's float32): the model then takes about its file's size."""
    from ...layers.quantized import QuantizedLinear

    for path, m in model.named_modules():
        if not isinstance(m, QuantizedLinear):
            continue
        for key in ("scales", "biases"):
            name = f"{path}.{key}"
            if key in m and name in provider.keys():
                want = provider.spec(name)[1]
                if want != m[key].dtype and mx.issubdtype(want, mx.floating):
                    m[key] = m[key].astype(want)


def _checkpoint_eos(path, gguf_header) -> frozenset:
    """The EOS set of the checkpoint's tokenizer (empty when it has none)."""
    if gguf_header is not None:
        return gguf_eos_ids(gguf_header.metadata)
    try:
        return load_tokenizer(path).eos_token_ids
    except (FileNotFoundError, ValueError):
        return frozenset()


#: GGUF's sampling metadata (llama.cpp's ``general.sampling.*``) -> generation_config.json names
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                      "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


def _generation_config(path, gguf_header) -> dict | None:
    """The checkpoint's generation settings (None when it has none; an unreadable
    ``generation_config.json`` is refused, as an unreadable ``config.json`` is)."""
    if gguf_header is not None:
        found = {name: gguf_header.metadata[key] for key, name in GGUF_SAMPLING_KEYS.items()
                 if key in gguf_header.metadata}
        return found or None
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedConfigError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise UnsupportedConfigError(f"{file}: expected a JSON object, got {type(config).__name__}")
    return config

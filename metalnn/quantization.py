"""Quantizing models: `quantize` swaps layers in place; ``quantization`` configs of MLX checkpoints.

``metalnn.quantize(model, bits=4, group_size=64)`` replaces every `Linear` with a `QuantizedLinear`
and every `Embedding` with a `QuantizedEmbedding` (weights quantized with ``mx.quantize``), except
layers whose input width is not a multiple of the group size (they stay float and the returned
`QuantizationSummary` says why).

MLX-quantized checkpoints describe their layers in ``config.json``::

    "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                     "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},   # per-layer override
                     "model.layers.0.mlp.up_proj": {"ggml_type": "Q4_K"},             # GGML blocks (GGUF)
                     "lm_head": false}                                                # kept in float

A ``ggml_type`` entry keeps the layer's weight in that GGML tensor type's blocks (`metalnn.layers.GGMLLinear`
/ `GGMLEmbedding`), as GGUF files store them.

`config_of` writes that dict for a model, `read_config` validates it and `prepare` builds the
quantized layers a checkpoint needs before its tensors are loaded (a layer without an entry is
quantized when the checkpoint holds its ``<path>.scales``, as MLX's own loaders decide).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten

from .errors import UnsupportedConfigError
from .layers.base import Layer, path_order, set_module
from . import ggml
from .layers.embedding import Embedding
from .layers.ggml import GGMLEmbedding, GGMLLinear
from .layers.linear import Linear
from .layers.quantized import QuantizedEmbedding, QuantizedLinear, quant_settings

#: layers whose weights are stored quantized (frozen; adapters train on top of them)
QUANTIZED = (QuantizedLinear, QuantizedEmbedding, GGMLLinear, GGMLEmbedding)


@dataclass
class QuantizationSummary:
    """What `quantize` did: the layers it quantized, those it kept in float (with the reason) and
    the parameter bytes before and after."""

    bits: int
    group_size: int
    mode: str
    quantized: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    bytes_before: int = 0
    bytes_after: int = 0

    def __str__(self):
        text = (f"quantized {len(self.quantized)} layer(s) to {self.bits} bits (group size {self.group_size}, "
                f"{self.mode}); parameters {self.bytes_before / 2**20:.2f} MiB -> {self.bytes_after / 2**20:.2f} MiB")
        if self.skipped:
            text += f"; kept {len(self.skipped)} in float: " + "; ".join(f"{k} ({v})" for k, v in self.skipped.items())
        return text


def _param_bytes(model) -> int:
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def _path_order(item):
    return path_order(item[0])


def eligible_layers(model) -> list:
    """``[(path, layer)]`` of the float `Linear` / `Embedding` layers of ``model``, in model order."""
    return sorted(((p, m) for p, m in model.named_modules() if p and isinstance(m, (Linear, Embedding))),
                  key=_path_order)


def quantized_layers(model) -> list:
    return sorted(((p, m) for p, m in model.named_modules() if p and isinstance(m, QUANTIZED)), key=_path_order)


def _width(layer) -> int | None:
    if isinstance(layer, Embedding):
        return layer.dims
    return layer.weight.shape[1] if "weight" in layer else None


def _misfit(layer, group_size: int) -> str | None:
    """Why ``layer`` cannot be quantized in groups of ``group_size`` (None when it can)."""
    width = _width(layer)
    if width % group_size:
        what = "dims" if isinstance(layer, Embedding) else "input width"
        return f"{what} {width} is not a multiple of group_size {group_size}"
    return None


def _quantized_copy(layer, group_size, bits, mode):
    if isinstance(layer, Embedding):
        return QuantizedEmbedding.from_embedding(layer, group_size=group_size, bits=bits, mode=mode)
    return QuantizedLinear.from_linear(layer, group_size=group_size, bits=bits, mode=mode)


def quantize(model, bits: int = 4, group_size: int = 64, *, mode: str = "affine", predicate=None
             ) -> QuantizationSummary:
    """Quantize ``model``'s `Linear` and `Embedding` layers in place.

    Args:
        model: a built metalnn model (compiled once, or a loaded pretrained model).
        bits, group_size, mode: as ``mx.quantize`` (affine: bits 1-6 or 8, groups 32/64/128).
        predicate: optional ``f(path, layer)`` returning False (keep the layer in float), True
            (quantize with the defaults) or a dict of ``bits`` / ``group_size`` / ``mode`` for
            that layer.
    Returns:
        a `QuantizationSummary`. A layer whose input width (an embedding's ``dims``) is not a
        multiple of its group size stays float and is listed in ``skipped``. A tied output
        projection follows its embedding (``as_linear`` of the quantized table).
    Raises:
        ValueError: unsupported bits / group size / mode, or a model that is not built yet.
    """
    group_size, bits, mode = quant_settings(group_size, bits, mode, "quantize")
    unbuilt = [p or type(m).__name__ for p, m in model.named_modules() if isinstance(m, Layer) and not m.built]
    if unbuilt:
        raise ValueError(f"quantize: the model is not built (layers create their parameters at the first compile); "
                         f"compile it once first. Not built: {', '.join(unbuilt[:8])}"
                         f"{' ...' if len(unbuilt) > 8 else ''}")
    summary = QuantizationSummary(bits, group_size, mode, bytes_before=_param_bytes(model))
    new_params = []
    for path, layer in eligible_layers(model):
        settings = (group_size, bits, mode)
        if predicate is not None:
            choice = predicate(path, layer)
            if choice is False or choice is None:
                summary.skipped[path] = "excluded by the predicate"
                continue
            if isinstance(choice, dict):
                settings = quant_settings(choice.get("group_size", group_size), choice.get("bits", bits),
                                          choice.get("mode", mode), f"quantize ({path})")
        misfit = _misfit(layer, settings[0])
        if misfit:
            summary.skipped[path] = misfit
            continue
        new = _quantized_copy(layer, *settings)
        set_module(model, path, new)
        new_params.extend(a for _, a in tree_flatten(new.parameters()))
        summary.quantized.append(path)
    mx.eval(new_params)
    summary.bytes_after = _param_bytes(model)
    return summary


def config_of(model) -> dict | None:
    """The ``quantization`` config dict describing ``model``'s quantized layers (None if none).

    The most common settings are the defaults; layers with other settings get a per-layer entry
    and float `Linear` / `Embedding` layers an entry ``False``.
    """
    layers = quantized_layers(model)
    ggml_layers = (GGMLLinear, GGMLEmbedding)
    cfg = config_from_settings({path: (m.group_size, m.bits, m.mode) for path, m in layers
                                if not isinstance(m, ggml_layers)},
                               {path: m.ggml_type for path, m in layers if isinstance(m, ggml_layers)})
    if cfg is None:
        return None
    for path, _ in eligible_layers(model):
        cfg[path] = False
    return cfg


def config_from_settings(layers: dict, ggml_types: dict | None = None) -> dict | None:
    """A ``quantization`` config dict from ``{module path: (group_size, bits, mode)}`` and
    ``{module path: GGML type name}``: the most common affine settings are the defaults, the other layers
    get per-layer entries (None if both are empty; with GGML layers only, the defaults are the config
    format's required keys and no layer uses them)."""
    if not layers and not ggml_types:
        return None
    (g, b, mode), _ = Counter(layers.values()).most_common(1)[0] if layers else ((32, 4, "affine"), 0)
    cfg = {"group_size": g, "bits": b, "mode": mode}
    for path, settings in layers.items():
        if settings != (g, b, mode):
            cfg[path] = dict(zip(("group_size", "bits", "mode"), settings))
    cfg.update({path: {"ggml_type": t} for path, t in (ggml_types or {}).items()})
    return cfg


def read_config(config: dict, source: str) -> dict | None:
    """The validated ``quantization`` dict of a model config (``quantization`` or an MLX-style
    ``quantization_config``); None when the checkpoint is not quantized.

    A ``quantization_config`` with ``quant_method`` ``mxfp4`` (gpt-oss's released folders: MXFP4 experts
    as ``*_blocks`` / ``*_scales`` tensors) gives None too: the architecture's loader decodes those
    tensors to floats (`metalnn.llm.models.gpt_oss`).

    Raises `UnsupportedConfigError` naming ``source`` for other quantization methods (GPTQ, AWQ,
    bitsandbytes, ...) and for bits / group sizes / modes MLX does not support.
    """
    q = config.get("quantization")
    key = "quantization"
    if q is None and config.get("quantization_config") is not None:
        q, key = config["quantization_config"], "quantization_config"
        method = q.get("quant_method") if isinstance(q, dict) else None
        if method == "mxfp4":
            return None
        if method not in (None, "mlx"):
            raise UnsupportedConfigError(f"{source}: quantization_config.quant_method {method!r} is not supported; "
                                         "metalnn loads MLX-quantized checkpoints (config 'quantization': "
                                         "{'group_size': ..., 'bits': ...}) and GGUF files")
    if q is None:
        return None
    if not isinstance(q, dict) or "bits" not in q or "group_size" not in q:
        raise UnsupportedConfigError(f"{source}: config '{key}' must be a dict with 'group_size' and 'bits', "
                                     f"got {q!r}")
    problems = []

    def check(where, entry):
        if "ggml_type" in entry:
            try:
                ggml.get_type(entry["ggml_type"])
            except KeyError as e:
                problems.append(f"{where}: {e.args[0]}")
            return
        try:
            quant_settings(entry.get("group_size", q["group_size"]), entry.get("bits", q["bits"]),
                           entry.get("mode", q.get("mode", "affine")), where)
        except ValueError as e:
            problems.append(str(e))

    check(f"{key}", q)
    for k, v in q.items():
        if k in ("group_size", "bits", "mode", "quant_method"):
            continue
        if isinstance(v, dict):
            check(f"{key}[{k!r}]", v)
        elif v is not False and v is not True:
            problems.append(f"{key}[{k!r}]: expected a dict of settings or false, got {v!r}")
    if problems:
        raise UnsupportedConfigError(f"{source}: unsupported quantization config: " + "; ".join(problems))
    return {k: v for k, v in q.items() if k != "quant_method"}


def prepare(model, qconfig: dict, checkpoint_names, source: str) -> list:
    """Replace the layers a quantized checkpoint stores quantized, before loading it.

    Args:
        model: a built model with float layers.
        qconfig: a dict from `read_config`.
        checkpoint_names: the checkpoint's tensor names (already renamed to the model's).
        source: the checkpoint, for error messages.
    Returns:
        the paths of the layers made quantized.
    Raises:
        UnsupportedConfigError: listing every per-layer entry that names no quantizable layer and
            every layer whose width does not fit its group size; the model is left unchanged.
    """
    names = set(checkpoint_names)
    default = (qconfig["group_size"], qconfig["bits"], qconfig.get("mode", "affine"))
    layers = dict(eligible_layers(model))
    problems = [f"quantization[{k!r}] names no Linear or Embedding layer of the model"
                for k in qconfig if k not in ("group_size", "bits", "mode") and k not in layers]
    plan = []
    for path, layer in layers.items():
        entry = qconfig.get(path)
        if entry is False:
            continue
        if isinstance(entry, dict) and "ggml_type" in entry:
            misfit = _ggml_misfit(layer, entry["ggml_type"])
            if misfit:
                problems.append(f"{path}: {misfit}")
            else:
                plan.append((path, layer, entry["ggml_type"]))
            continue
        if isinstance(entry, dict):
            settings = (entry.get("group_size", default[0]), entry.get("bits", default[1]),
                        entry.get("mode", default[2]))
        elif entry is True or f"{path}.scales" in names:
            settings = default
        else:
            continue
        misfit = _misfit(layer, settings[0])
        if misfit:
            problems.append(f"{path}: {misfit}")
            continue
        plan.append((path, layer, settings))
    if problems:
        raise UnsupportedConfigError(f"{source}: the quantization config does not fit the model: "
                                     + "; ".join(problems))
    for path, layer, settings in plan:
        new = _ggml_copy(layer, settings) if isinstance(settings, str) else _quantized_copy(layer, *settings)
        set_module(model, path, new)
    return [p for p, _, _ in plan]


def _ggml_misfit(layer, ggml_type: str) -> str | None:
    """Why ``layer``'s rows cannot be blocks of ``ggml_type`` (None when they can)."""
    block = ggml.get_type(ggml_type).block_size
    width = _width(layer)
    if width % block:
        what = "dims" if isinstance(layer, Embedding) else "input width"
        return f"{what} {width} is not a multiple of {ggml_type}'s block of {block}"
    return None


def _ggml_copy(layer, ggml_type: str):
    """An all-zero GGML layer of ``layer``'s shape (its blocks come from the checkpoint)."""
    if isinstance(layer, Embedding):
        new = GGMLEmbedding(layer.num_embeddings, layer.dims, ggml_type=ggml_type)
    else:
        out_f, in_f = layer.weight.shape
        new = GGMLLinear(out_f, in_features=in_f, ggml_type=ggml_type, bias="bias" in layer)
    new._path = layer._path
    return new

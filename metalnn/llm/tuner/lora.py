"""LoRA adapters in PEFT's format: `apply`, `save_adapters`, `load_adapters`, `fuse`, `adapters_disabled`.

``apply(model)`` wraps the matching projections (`Linear`, or a quantized linear layer, for QLoRA)
in `LoRALinear`: ``y = base(x) + (alpha / r) * dropout(x) @ A.T @ B.T`` with ``A`` ``[r, in]``
Kaiming-uniform and ``B`` ``[out, r]`` zeros, as PEFT initialises them. Afterwards only the
adapters are trainable; the base weights never change. Adapters are saved as PEFT saves them
(``adapter_config.json`` + ``adapter_model.safetensors`` with keys
``base_model.model.<module path>.lora_A.weight`` / ``lora_B.weight``), so
``peft.PeftModel.from_pretrained(transformers_model, folder)`` reads them, and adapters trained with
PEFT load here.

>>> lora.apply(model, rank=8, alpha=16, targets=("q_proj", "v_proj"))
>>> trainer.fit(...)                                   # trains the adapters only
>>> lora.save_adapters(model, "adapters/")
>>> lora.fuse(model)                                   # merge into the base weights, remove adapters
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ... import init as initializers
from ...data import Data
from ...errors import WeightLoadError
from ...layers.base import Layer, blocks, module_at, set_module
from ...layers.dropout import Dropout
from ...layers.linear import Linear
from ...layers.ggml import GGMLLinear
from ...layers.quantized import QuantizedLinear
from ...quantization import QUANTIZED
from ...weights import load_safetensors, save_safetensors

PEFT_PREFIX = "base_model.model."
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRASettings:
    """What `apply` was asked for (written to ``adapter_config.json``)."""

    r: int
    lora_alpha: float
    lora_dropout: float
    target_modules: tuple
    layers_to_transform: tuple | None = None


def _is_quantized(layer) -> bool:
    return isinstance(layer, (QuantizedLinear, GGMLLinear))


def _in_out(layer):
    """(in_features, out_features) of a `Linear`, `QuantizedLinear` or `GGMLLinear` (its logical width)."""
    if _is_quantized(layer):
        return layer.in_features, layer.out_features
    return layer.weight.shape[1], layer.weight.shape[0]


def _dense_weight(layer):
    """The layer's weight as a float ``[out, in]`` matrix: a quantized layer's dequantized in float32
    (``scales * q + biases`` exactly), a float layer's as it is."""
    if _is_quantized(layer):
        return layer.dequantized_weight(mx.float32)
    return layer.weight


def _adapter_dtype(layer):
    """float32 over half-precision bases (as PEFT's ``autocast_adapter_dtype``: half-precision
    adapters train poorly), else the base's dtype."""
    dtype = layer.dtype if _is_quantized(layer) else layer.weight.dtype
    return mx.float32 if dtype in (mx.float16, mx.bfloat16) else dtype


class LoRALinear(Layer):
    """A frozen projection ``base_layer`` plus a trainable low-rank update.

    ``y = base_layer(x) + scale * dropout(x) @ lora_A.weight.T @ lora_B.weight.T``, ``scale =
    alpha / rank``. Parameter names: ``base_layer.*`` (the base's, frozen), ``lora_A.weight``
    ``[rank, in]``, ``lora_B.weight`` ``[out, rank]`` (PEFT's names).
    """

    fixed_axes = ("W",)

    def __init__(self, base_layer, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRALinear: rank must be positive, got {rank}")
        if "weight" not in base_layer:
            raise ValueError(f"LoRALinear: the base layer {type(base_layer).__name__} has no weight yet (build "
                             "the model before applying LoRA)")
        in_features, out_features = _in_out(base_layer)
        dtype = _adapter_dtype(base_layer)
        self.base_layer = base_layer
        self.rank, self.alpha = int(rank), float(alpha)
        self.scale = self.alpha / self.rank
        self.lora_A = Linear(self.rank, in_features=in_features, bias=False, init=initializers.FanInUniform(),
                             dtype=dtype)
        self.lora_B = Linear(out_features, in_features=self.rank, bias=False, init="zeros", dtype=dtype)
        self.dropout = Dropout(dropout)
        self.enabled = True  # False inside `adapters_disabled`: the base projection alone
        self.mark_built((in_features, 1, 1))

    def forward(self, device, data):
        y = self.compile_child(self.base_layer, device, data)
        if not self.enabled:
            return y
        h = self.compile_child(self.dropout, device, data)
        update = (h.array @ self.lora_A.weight.T) @ self.lora_B.weight.T
        return Data(y.array + self.scale * update.astype(y.array.dtype), y.dims)

    def merged_weight(self):
        """``W + scale * B @ A`` ``[out, in]`` in float32 (a quantized base dequantized first)."""
        w = _dense_weight(self.base_layer)
        delta = (self.lora_B.weight.astype(mx.float32) @ self.lora_A.weight.astype(mx.float32)) * self.scale
        return w.astype(mx.float32) + delta

    def _extra_repr(self):
        return f"rank={self.rank}, alpha={self.alpha}"


def _targets(model, targets, layers):
    """Paths of the linear layers to wrap: last name component in ``targets``; with ``layers``,
    only inside the last ``layers`` blocks."""
    targets = tuple(targets)
    allowed = None
    if layers is not None:
        paths = [p for p, _ in blocks(model)]
        if not paths:
            raise ValueError(f"lora.apply: layers={layers} but {type(model).__name__} has no blocks")
        allowed = paths[-int(layers):] if layers else []
    found = []
    for path, m in model.named_modules():
        name = path.rpartition(".")[2]
        if name not in targets or isinstance(m, LoRALinear):
            continue
        if not (isinstance(m, Linear) or _is_quantized(m)):
            continue
        if allowed is not None and not any(path.startswith(b + ".") for b in allowed):
            continue
        found.append(path)
    return sorted(found)


def _layer_indices(paths, blocks):
    out = set()
    for p in paths:
        for b in blocks:
            if p.startswith(b + ".") and b.rpartition(".")[2].isdigit():
                out.add(int(b.rpartition(".")[2]))
    return sorted(out)


def apply(model, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0, targets=("q_proj", "v_proj"),
          layers: int | None = None) -> list:
    """Wrap the matching projections of ``model`` in `LoRALinear` and freeze everything else.

    Args:
        model: a built model (e.g. from `metalnn.llm.models.load_pretrained`).
        rank, alpha, dropout: PEFT's ``r``, ``lora_alpha``, ``lora_dropout``.
        targets: last components of the module names to adapt (PEFT's ``target_modules``).
        layers: only the last ``layers`` blocks (default: all).
    Returns:
        the module paths that were wrapped.
    """
    paths = _targets(model, targets, layers)
    if not paths:
        raise ValueError(f"lora.apply: no Linear or quantized linear layer of {type(model).__name__} is named one of "
                         f"{list(targets)}")
    _wrap(model, paths, rank, alpha, dropout)
    model.lora_settings = LoRASettings(int(rank), float(alpha), float(dropout), tuple(sorted(set(targets))),
                                       tuple(_layer_indices(paths, [p for p, _ in blocks(model)])) if layers is not None else None)
    return paths


def _wrap(model, paths, rank, alpha, dropout):
    """Wrap the projections at ``paths`` in `LoRALinear` and leave only the adapters trainable."""
    for path in paths:
        set_module(model, path, LoRALinear(module_at(model, path), rank, alpha, dropout))
    model.freeze()
    for path in paths:
        wrapped = module_at(model, path)
        wrapped.lora_A.unfreeze()
        wrapped.lora_B.unfreeze()


@contextmanager
def adapters_disabled(model):
    """Inside the block ``model`` runs as its base model: every `LoRALinear`'s update is left out
    (the reference model of preference training, with no second copy of the weights). Works inside
    traced and compiled functions: the switch is read when the forward pass is built.

    >>> with lora.adapters_disabled(model):
    ...     ref_logits = mx.stop_gradient(model(tokens))
    """
    layers = [m for _, m in model.named_modules() if isinstance(m, LoRALinear)]
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.enabled = was


def adapters(model) -> dict:
    """``{module path: LoRALinear}`` of every adapter in ``model``."""
    return {p: m for p, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_config(model, base_model_name_or_path: str | None = None) -> dict:
    """The ``adapter_config.json`` PEFT writes for these adapters."""
    found = adapters(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no LoRA adapters (use metalnn.llm.tuner.lora.apply first)")
    first = next(iter(found.values()))
    settings = getattr(model, "lora_settings", None) or LoRASettings(
        first.rank, first.alpha, first.dropout.p, tuple(sorted({p.rpartition(".")[2] for p in found})))
    cfg = asdict(settings)
    cfg["target_modules"] = list(cfg["target_modules"])
    if cfg["layers_to_transform"] is not None:
        cfg["layers_to_transform"] = list(cfg["layers_to_transform"])
    base = base_model_name_or_path
    if base is None:
        base = getattr(model, "name_or_path", None)
    out = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": cfg["r"], "lora_alpha": cfg["lora_alpha"], "lora_dropout": cfg["lora_dropout"],
        "target_modules": cfg["target_modules"], "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": cfg["layers_to_transform"],
        "layers_pattern": None,
    }
    return out


def save_adapters(model, folder, base_model_name_or_path: str | None = None) -> Path:
    """Write the adapters in PEFT's layout into ``folder`` (created; files replaced atomically)."""
    import tempfile  # (only saving needs it: not imported with metalnn)

    folder = Path(folder)
    cfg = adapter_config(model, base_model_name_or_path)
    tensors = {}
    for path, m in adapters(model).items():
        tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = m.lora_A.weight
        tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = m.lora_B.weight
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(folder / WEIGHTS_NAME, tensors, metadata={"format": "pt"})
    fd, tmp = tempfile.mkstemp(prefix=".adapter_config.", suffix=".json", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    os.replace(tmp, folder / CONFIG_NAME)
    return folder


def load_adapters(model, folder) -> list:
    """Read PEFT LoRA adapters (saved by metalnn or by PEFT) into ``model``.

    Wraps the adapted projections first if the model has no adapters yet (from the folder's
    ``adapter_config.json``). All or nothing: a missing, unexpected or misshaped tensor raises
    `WeightLoadError` naming the file and every problem, and no adapter value changes.
    Returns the module paths that received adapters.
    """
    folder = Path(folder)
    cfg_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    for p in (cfg_path, weights_path):
        if not p.exists():
            raise FileNotFoundError(f"{folder}: no {p.name} (expected a PEFT adapter folder)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key in ("use_dora", "use_rslora"):
        if cfg.get(key):
            raise ValueError(f"{cfg_path}: {key}=true is not supported")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"{cfg_path}: fan_in_fan_out=true (GPT-2 Conv1D bases) is not supported")
    tensors = load_safetensors(weights_path)
    names = {}
    for key, value in tensors.items():
        if not key.startswith(PEFT_PREFIX) or not (key.endswith(".lora_A.weight") or key.endswith(".lora_B.weight")):
            raise WeightLoadError(source=str(weights_path), message=f"{weights_path}: unexpected tensor {key!r}")
        names[key[len(PEFT_PREFIX):]] = value
    wanted_paths = sorted({k.rsplit(".", 2)[0] for k in names})
    have = adapters(model)
    if not have:
        targets = cfg.get("target_modules") or sorted({p.rpartition(".")[2] for p in wanted_paths})
        if isinstance(targets, str):
            targets = [targets]
        paths = [p for p in _targets(model, targets, None) if p in wanted_paths]
        missing_modules = sorted(set(wanted_paths) - set(paths))
        if missing_modules:
            raise WeightLoadError(source=str(weights_path), message=(
                f"{weights_path}: adapters for modules the model does not have (or that are not linear): "
                f"{missing_modules[:8]}"))
        apply_paths(model, paths, int(cfg["r"]), float(cfg["lora_alpha"]), float(cfg.get("lora_dropout", 0.0)))
        have = adapters(model)
    params = {}
    for path, m in have.items():
        params[f"{path}.lora_A.weight"] = m.lora_A.weight
        params[f"{path}.lora_B.weight"] = m.lora_B.weight
    missing = sorted(set(params) - set(names))
    unexpected = sorted(set(names) - set(params))
    mismatched = {k: (str(tuple(params[k].shape)), str(tuple(v.shape))) for k, v in names.items()
                  if k in params and tuple(v.shape) != tuple(params[k].shape)}
    if missing or unexpected or mismatched:
        raise WeightLoadError(missing, unexpected, mismatched, source=str(weights_path))
    model.update(tree_unflatten([(k, v.astype(params[k].dtype)) for k, v in names.items()]))
    return sorted(have)


def apply_paths(model, paths, rank, alpha, dropout):
    """Wrap exactly the projections at ``paths`` (used when loading adapters)."""
    _wrap(model, paths, rank, alpha, dropout)
    model.lora_settings = LoRASettings(rank, alpha, dropout, tuple(sorted({p.rpartition(".")[2] for p in paths})))


def fuse(model, dequantize: bool = False) -> list:
    """Merge every adapter into its base weight and remove the adapter layers.

    A float base gets ``W + (alpha / r) * B @ A`` (computed in float32, stored in ``W``'s dtype).
    A `QuantizedLinear` base is dequantized, merged and re-quantized with its own group size, bits
    and mode (scales in their own dtype): each weight then moves by at most half a quantization
    step of its group, as in the first quantization. With ``dequantize=True`` it becomes a float
    `Linear` holding the merged weight in the layer's float dtype instead (float32 scales give
    ``scales * q + biases + (alpha / r) * B @ A`` exactly). The model's float parameters are left
    trainable again (as before `apply`; quantized layers stay frozen). Returns the fused module
    paths.
    """
    found = adapters(model)
    for path, m in found.items():
        base = m.base_layer
        merged = m.merged_weight()
        if _is_quantized(base):
            merged = merged.astype(base.dtype)
            if dequantize:
                in_features, out_features = _in_out(base)
                new = Linear(out_features, in_features=in_features, bias="bias" in base, dtype=merged.dtype)
                new.weight = merged
                if "bias" in base:
                    new.bias = base.bias
            elif isinstance(base, GGMLLinear):
                base.weight = _reencode(base, merged, path)
                new = base
            else:
                q = mx.quantize(merged, group_size=base.group_size, bits=base.bits, mode=base.mode)
                base.weight, base.scales = q[0], q[1].astype(base.scales.dtype)
                if len(q) > 2 and q[2] is not None:
                    base.biases = q[2].astype(base.biases.dtype)
                new = base
        else:
            base.weight = merged.astype(base.weight.dtype)
            new = base
        set_module(model, path, new)
    model.unfreeze()
    for _, m in model.named_modules():
        if isinstance(m, QUANTIZED):
            m.freeze()  # packed weights have no gradient
    model.lora_settings = None
    mx.eval(model.parameters())
    return sorted(found)


def _reencode(base, merged, path):
    """``merged`` encoded again in ``base``'s GGML type (ggml's reference encoder)."""
    try:
        return mx.array(base.qtype.encode(np.array(merged.astype(mx.float32))))
    except NotImplementedError:
        raise ValueError(f"lora.fuse: {path}: metalnn cannot encode {base.ggml_type} blocks; fuse with "
                         "dequantize=True to get a float layer") from None


def trainable_names(model) -> list:
    """Dotted names of the trainable parameters (after `apply`: the adapters only)."""
    return sorted(k for k, _ in tree_flatten(model.trainable_parameters()))

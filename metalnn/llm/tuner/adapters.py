"""LoRA adapters at inference: `read_adapter` (a PEFT folder), `check_adapter` (against a model),
`use_adapter` (one adapter for every answer, as ``metalnn generate/chat/serve --adapter DIR``).

An adapter folder is what `metalnn lora` or PEFT's ``save_pretrained`` writes: ``adapter_config.json``
+ ``adapter_model.safetensors`` (keys ``base_model.model.<module path>.lora_A.weight`` ``[r, in]`` and
``.lora_B.weight`` ``[out, r]``). `check_adapter` compares every adapted module with the model's:
the module must exist, be a linear projection, and have the adapter's input and output widths; an
error names the folder, each mismatch and the base model the adapter was trained for
(``base_model_name_or_path``; the name itself is not compared: a Hub name, a local folder and a
GGUF file of the same model all differ, while their module shapes agree).

`use_adapter` merges the adapter into the weights (`metalnn.llm.tuner.lora.fuse`): the model then
runs as a plain one, with the fused native decoding step. Measured with scripts/bench_adapters.py on
SmolLM2-135M (Q4_1 GGUF, CPU, rank 8 on q_proj and v_proj, greedy decoding, ratios to the base model
in the same run on a shared machine): merged into float32 projections 0.88x, kept as `LoRALinear`
(the adapted blocks then run op by op) 0.68x, merged and re-encoded as Q4_1 1.0-1.1x but no longer
the adapter's numbers, installed as a named adapter (`metalnn.llm.tuner.multi_lora`) 0.55x. How it
is merged depends on the base's projections:

* float32: ``W + (alpha / r) B A``, the same numbers as PEFT's unmerged forward up to rounding;
* packed GGML (GGUF) or MLX-quantized: the adapted projections become float layers holding
  ``dequantize(W) + (alpha / r) B A`` (``fuse(dequantize=True)``), so the answers are PEFT's on the
  dequantized model; re-quantizing would move each weight by up to half a quantization step, which
  is as large as a typical adapter's update. Those projections grow (float32: 8x a 4-bit layer's
  bytes), so only the adapted ones are converted;
* float16 / bfloat16: merging would round the small update into the base's precision, so the
  adapter stays a `LoRALinear` (computed in float32, as PEFT does), op by op.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ...layers.base import module_at
from ...layers.ggml import GGMLLinear
from ...layers.linear import Linear
from ...layers.quantized import QuantizedLinear
from ...weights import load_safetensors
from . import lora

__all__ = ["Adapter", "AdapterError", "read_adapter", "check_adapter", "use_adapter"]


class AdapterError(ValueError):
    """An adapter folder that cannot be used with the model (the message names the folder)."""


@dataclass
class Adapter:
    """One PEFT LoRA adapter as read from its folder.

    Attributes:
        folder: where it was read from.
        rank, alpha: PEFT's ``r`` and ``lora_alpha``; ``scale = alpha / rank``.
        base_model: the config's ``base_model_name_or_path`` (None when not recorded).
        weights: ``{module path: (A [rank, in], B [out, rank])}``.
    """

    folder: Path
    rank: int
    alpha: float
    base_model: str | None = None
    weights: dict = field(default_factory=dict)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def paths(self) -> list:
        return sorted(self.weights)

    def trained_for(self) -> str:
        """``" (trained for NAME)"`` when the adapter names its base model, else ``""``."""
        return f" (trained for {self.base_model})" if self.base_model else ""


def read_adapter(folder) -> Adapter:
    """Read a PEFT LoRA folder; `AdapterError` (or FileNotFoundError) names the folder and the problem."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"adapter {folder}: no such folder (expected a PEFT adapter folder with "
                                f"{lora.CONFIG_NAME} and {lora.WEIGHTS_NAME})")
    cfg_path, weights_path = folder / lora.CONFIG_NAME, folder / lora.WEIGHTS_NAME
    for p in (cfg_path, weights_path):
        if not p.exists():
            raise FileNotFoundError(f"adapter {folder}: no {p.name} (expected a PEFT adapter folder with "
                                    f"{lora.CONFIG_NAME} and {lora.WEIGHTS_NAME})")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"adapter {folder}: {cfg_path.name} is not JSON: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {folder}: peft_type is {cfg.get('peft_type')!r}, expected 'LORA'")
    unsupported = [k for k in ("use_dora", "use_rslora", "fan_in_fan_out", "rank_pattern", "alpha_pattern")
                   if cfg.get(k)]
    if unsupported:
        raise AdapterError(f"adapter {folder}: {', '.join(unsupported)} set in {cfg_path.name}; metalnn reads "
                           "plain LoRA adapters only (one rank and alpha, no DoRA, no rsLoRA)")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise AdapterError(f"adapter {folder}: {cfg_path.name} needs a positive {key!r}, got {cfg.get(key)!r}")
    adapter = Adapter(folder, int(cfg["r"]), float(cfg["lora_alpha"]), cfg.get("base_model_name_or_path"))
    parts: dict = {}
    for key, value in load_safetensors(weights_path).items():
        name = key[len(lora.PEFT_PREFIX):] if key.startswith(lora.PEFT_PREFIX) else None
        if name is None or not name.endswith((".lora_A.weight", ".lora_B.weight")):
            raise AdapterError(f"adapter {folder}: unexpected tensor {key!r} in {weights_path.name} (expected "
                               f"{lora.PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
        path, which = name.rsplit(".", 2)[:2]
        parts.setdefault(path, {})[which] = value
    if not parts:
        raise AdapterError(f"adapter {folder}: {weights_path.name} holds no LoRA tensors")
    for path, ab in sorted(parts.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(ab)).pop()
            raise AdapterError(f"adapter {folder}: {path} has no {missing}.weight")
        a, b = ab["lora_A"], ab["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] != adapter.rank:
            raise AdapterError(f"adapter {folder}: {path}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are "
                               f"not [r, in] and [out, r] with r={adapter.rank}")
        adapter.weights[path] = (a, b)
    return adapter


def _linear_widths(module):
    """``(in, out)`` of a projection an adapter can modify, else None."""
    if isinstance(module, lora.LoRALinear):
        module = module.base_layer
    if isinstance(module, (QuantizedLinear, GGMLLinear)):
        return module.in_features, module.out_features
    if isinstance(module, Linear) and "weight" in module:
        return module.weight.shape[1], module.weight.shape[0]
    return None


def check_adapter(model, adapter: Adapter) -> None:
    """Raise `AdapterError` unless every module ``adapter`` adapts is a linear projection of ``model``
    with the adapter's input and output widths (all mismatches named at once)."""
    modules = dict(model.named_modules())
    problems = []
    for path, (a, b) in sorted(adapter.weights.items()):
        module = modules.get(path)
        if module is None:
            problems.append(f"{path}: the model has no such module")
            continue
        widths = _linear_widths(module)
        if widths is None:
            problems.append(f"{path}: a {type(module).__name__}, not a linear projection")
        elif widths != (a.shape[1], b.shape[0]):
            problems.append(f"{path}: the model's projection is {widths[0]} -> {widths[1]}, the adapter's "
                            f"{a.shape[1]} -> {b.shape[0]}")
    if problems:
        shown = problems[:6] + ([f"... and {len(problems) - 6} more"] if len(problems) > 6 else [])
        name = getattr(model, "architecture", type(model).__name__)
        raise AdapterError(f"adapter {adapter.folder} does not fit this {name} model{adapter.trained_for()}: "
                           + "; ".join(shown))


def _half_precision(module) -> bool:
    dtype = module.dtype if isinstance(module, (QuantizedLinear, GGMLLinear)) else module.weight.dtype
    return dtype in (mx.float16, mx.bfloat16)


def use_adapter(model, folder, fuse: bool | None = None) -> str:
    """Apply the adapter in ``folder`` to every answer of ``model`` (in place).

    ``fuse``: True merges it into the weights, False keeps `LoRALinear` layers, None (default)
    chooses as the module docstring says. Returns ``"fused"`` or ``"kept"``. The model must carry
    no other adapter layers.
    """
    adapter = read_adapter(folder)
    check_adapter(model, adapter)
    if lora.adapters(model):
        raise AdapterError(f"adapter {adapter.folder}: the model already carries LoRA layers; fuse them first")
    modules = dict(model.named_modules())
    if fuse is None:
        fuse = not any(_half_precision(modules[p]) for p in adapter.paths)
    lora.apply_paths(model, adapter.paths, adapter.rank, adapter.alpha, 0.0)
    for path, (a, b) in adapter.weights.items():
        wrapped = module_at(model, path)
        wrapped.lora_A.weight = a.astype(wrapped.lora_A.weight.dtype)
        wrapped.lora_B.weight = b.astype(wrapped.lora_B.weight.dtype)
    model.freeze()
    if not fuse:
        mx.eval(model.parameters())
        return "kept"
    lora.fuse(model, dequantize=True)
    model.freeze()
    return "fused"

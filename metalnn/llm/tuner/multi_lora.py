"""Several LoRA adapters in one model, chosen per row of a batch: `MultiLoRALinear`, `AdapterRows`,
`install_adapters`.

A server serving one base model with named adapters decodes requests for different adapters (and
for the base) in the same batched forward pass. Each adapted projection becomes a
`MultiLoRALinear` holding every adapter's ``A`` / ``B`` for it:

    ``y[b] = base(x[b]) + scale_a * (x[b] @ A_a.T) @ B_a.T``   for row ``b`` using adapter ``a``

(rows of the base model, or of an adapter that does not adapt this projection, get ``base(x[b])``).
Which adapter each row uses is set once for the whole model through the `AdapterRows` that
`install_adapters` returns, around each forward pass::

    rows = install_adapters(model, {"fr": read_adapter("fr/"), "sql": read_adapter("sql/")})
    with rows.selected(["fr", None, "sql"]):      # rows 0..2 of the batch
        logits = model(tokens, cache=caches)

The update is computed only for each adapter's own rows (gathered, then added back), so a row costs
one ``[T, in] x [in, r]`` and one ``[T, r] x [r, out]`` product per adapted projection. The blocks
holding adapters run op by op (the fused native decoding step takes plain projections only).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import mlx.core as mx

from ...data import Data
from ...layers.base import Layer, module_at, set_module
from .adapters import Adapter, AdapterError, check_adapter
from .lora import LoRALinear

__all__ = ["MultiLoRALinear", "AdapterRows", "install_adapters"]


class AdapterRows:
    """Which adapter each row of the next forward passes uses (shared by all `MultiLoRALinear` s of
    a model). ``names``: the adapters installed."""

    def __init__(self, names):
        self.names = tuple(names)
        self._local = threading.local()

    @property
    def groups(self) -> dict:
        """``{adapter: row indices}`` (int32 ``[n]``, or None for every row) of the current selection."""
        return getattr(self._local, "groups", {})

    @property
    def rows(self) -> int | None:
        """The number of rows of the current selection (None when nothing is selected)."""
        return getattr(self._local, "rows", None)

    @contextmanager
    def selected(self, per_row):
        """Within the block, row ``b`` of the model's input uses adapter ``per_row[b]`` (None: the
        base model). Unknown names raise `KeyError` naming the adapters installed."""
        per_row = list(per_row)
        unknown = sorted({n for n in per_row if n is not None and n not in self.names})
        if unknown:
            raise KeyError(f"AdapterRows.selected: no adapter named {unknown}; installed: {list(self.names)}")
        groups = {}
        for name in dict.fromkeys(n for n in per_row if n is not None):
            rows = [i for i, n in enumerate(per_row) if n == name]
            groups[name] = None if len(rows) == len(per_row) else mx.array(rows, dtype=mx.int32)
        before = (self.groups, self.rows)
        self._local.groups, self._local.rows = groups, len(per_row)
        try:
            yield self
        finally:
            self._local.groups, self._local.rows = before


class MultiLoRALinear(Layer):
    """A frozen projection ``base_layer`` plus named LoRA adapters chosen per row (see the module
    docstring). Parameters: ``base_layer.*`` and ``lora_A.<name>`` ``[r, in]`` / ``lora_B.<name>``
    ``[out, r]``; input ``[B, T, in]``, output ``[B, T, out]``.

    Args:
        base_layer: the built projection (`Linear`, `QuantizedLinear`, `GGMLLinear`).
        selection: the model's `AdapterRows`.
    """

    fixed_axes = ("W",)

    def __init__(self, base_layer, selection: AdapterRows):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A, self.lora_B = {}, {}
        # (outside the parameter tree: the shared selection and plain floats)
        object.__setattr__(self, "_selection", selection)
        object.__setattr__(self, "scales", {})
        self.mark_built(base_layer._built_dims)

    def add(self, name: str, a, b, scale: float):
        """Add adapter ``name``: ``A`` ``[r, in]``, ``B`` ``[out, r]`` (kept in float32, as PEFT computes
        adapters over half-precision bases), ``scale = alpha / r``."""
        dtype = mx.float32 if a.dtype in (mx.float16, mx.bfloat16) else a.dtype
        self.lora_A[name], self.lora_B[name] = a.astype(dtype), b.astype(dtype)
        self.scales[name] = float(scale)

    def forward(self, device, data):
        y = self.compile_child(self.base_layer, device, data)
        sel = self._selection
        groups = {n: rows for n, rows in sel.groups.items() if n in self.lora_A}
        if not groups:
            return y
        x, out = data.array, y.array
        self.require(x.ndim >= 2 and x.shape[0] == sel.rows, f"{sel.rows} rows (the adapter selection)",
                     f"input {tuple(x.shape)}")
        for name, rows in groups.items():
            a, b, scale = self.lora_A[name], self.lora_B[name], self.scales[name]
            if rows is None:
                out = out + (scale * ((x @ a.T) @ b.T)).astype(out.dtype)
            else:
                delta = scale * ((x[rows] @ a.T) @ b.T)
                out = out.at[rows].add(delta.astype(out.dtype))
        return Data(out, y.dims)

    def _extra_repr(self):
        return f"adapters={list(self.lora_A)}"


def install_adapters(model, adapters: dict) -> AdapterRows:
    """Give ``model`` the named adapters (``{name: Adapter}``, from
    `metalnn.llm.tuner.adapters.read_adapter`), each projection any of them adapts becoming a
    `MultiLoRALinear`; returns the `AdapterRows` that selects them per row. Every adapter is checked
    first (`check_adapter`): on an error nothing changes."""
    if not adapters:
        raise ValueError("install_adapters: no adapters given")
    for name, adapter in adapters.items():
        if not isinstance(adapter, Adapter):
            raise TypeError(f"install_adapters: {name!r} must be an Adapter (read_adapter), got "
                            f"{type(adapter).__name__}")
        check_adapter(model, adapter)
    modules = dict(model.named_modules())
    for path in {p for a in adapters.values() for p in a.weights}:
        if isinstance(modules[path], (LoRALinear, MultiLoRALinear)):
            raise AdapterError(f"install_adapters: {path} already carries adapters (fuse them first)")
    selection = AdapterRows(adapters)
    for path in sorted({p for a in adapters.values() for p in a.weights}):
        set_module(model, path, MultiLoRALinear(module_at(model, path), selection))
    for name, adapter in adapters.items():
        for path, (a, b) in adapter.weights.items():
            module_at(model, path).add(name, a, b, adapter.scale)
    model.freeze()
    mx.eval(model.parameters())
    return selection

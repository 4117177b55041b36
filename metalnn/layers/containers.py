"""`Parallel`: the same input through several branches, their outputs combined. (`Layers` /
`Sequential`, the chain, lives in `metalnn.layers.base`.)"""

from __future__ import annotations

import mlx.core as mx

from ..data import Data, MTLSize
from .base import Layer, Layers
from .linear import Linear

COMBINE_MODES = ("concat", "add", "avg", "filter", "grid_scatter")


class Parallel(Layer):
    """Feed the same input to every branch and combine their outputs.

    Args:
        branches: layers (or lists of layers, chained).
        combine: ``"concat"`` (along W), ``"add"``, ``"avg"``, ``"filter"``: a learned gate
            ``softmax(gate(x))`` over branches weights their outputs per position (a mixture of
            experts; the gate is a `Linear` named ``gate``), or ``"grid_scatter"``: each branch's
            whole per-sample output (``W_i x H_i`` values, flattened) placed in its own cell of the
            output, cell after cell: output ``(W=sum_i W_i*H_i, H=1, D)``.
    Branch outputs must share D; and H (except for ``grid_scatter``), and W (except for ``concat``
    and ``grid_scatter``).
    """

    positional_hint = "{cls}(branches, combine={extra[0]!r})"

    def __init__(self, branches, *, combine: str = "concat"):
        super().__init__()
        if combine not in COMBINE_MODES:
            raise ValueError(f"Parallel: combine must be one of {COMBINE_MODES}, got {combine!r}")
        if not branches:
            raise ValueError("Parallel: needs at least one branch")
        self.branches = [b if isinstance(b, Layer) else Layers(b) for b in branches]
        self.combine = combine
        if combine == "filter":
            self.gate = Linear(len(self.branches))

    def forward(self, device, data):
        outs = [self.compile_child(b, device, data) for i, b in enumerate(self.branches)]
        first = outs[0].dims
        for i, o in enumerate(outs[1:], 1):
            if self.combine == "grid_scatter":
                same = o.dims.D == first.D
            else:
                same = (o.dims.H, o.dims.D) == (first.H, first.D) and (self.combine == "concat" or o.dims.W == first.W)
            self.require(same, f"branch outputs like branch 0 ({first})", f"branch {i}: {o.dims}",
                         f"combine={self.combine}")
        arrays = [o.array for o in outs]
        if self.combine == "grid_scatter":
            y = mx.concatenate([a.reshape(first.D, -1) for a in arrays], axis=-1)
            return Data(y, MTLSize(y.shape[-1], 1, first.D))
        if self.combine == "concat":
            y = mx.concatenate(arrays, axis=-1)
            return Data(y, MTLSize(y.shape[-1], first.H, first.D))
        if self.combine == "add":
            return Data(sum(arrays[1:], arrays[0]), first)
        if self.combine == "avg":
            return Data(sum(arrays[1:], arrays[0]) / len(arrays), first)
        weights = mx.softmax(self.compile_child(self.gate, device, data).array, axis=-1)
        y = sum(weights[..., i:i + 1] * a for i, a in enumerate(arrays))
        return Data(y, first)

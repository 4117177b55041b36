"""`SwiGLU`: gated feed-forward block ``w3(silu(w1 x) * w2 x)``."""

from __future__ import annotations

import mlx.core as mx

from .. import fastmath
from ..data import Data
from ..layer import Layer
from .linear import Linear


class SwiGLU(Layer):
    """Gated feed-forward: ``w3(silu(w1(x)) * w2(x))``; W stays the same from input to output.

    ``w1``, ``w2``: ``[hidden, W]``; ``w3``: ``[W, hidden]`` (no biases). Default init Kaiming normal
    for the gate and value projections, Xavier normal for the output.
    """

    fixed_axes = ("W",)

    def __init__(self, hidden: int, init="kaiming_normal", out_init="xavier_normal"):
        super().__init__()
        self.hidden = int(hidden)
        self.w1 = Linear(self.hidden, bias=False, init=init)
        self.w2 = Linear(self.hidden, bias=False, init=init)
        self._out_init = out_init

    def build(self, device, dims, dtype):
        self.w3 = Linear(dims.W, bias=False, init=self._out_init)

    def forward(self, device, data):
        a = self.compile_child("w1", self.w1, device, data).array
        b = self.compile_child("w2", self.w2, device, data).array
        h = Data(fastmath.silu(a) * b, data.dims._replace(W=self.hidden))
        return self.compile_child("w3", self.w3, device, h)

"""Normalisation layers: `RMSNorm`, `LayerNorm`."""

from __future__ import annotations

import mlx.core as mx

from .. import functional as F
from ..data import Data
from ..layer import Layer


class RMSNorm(Layer):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the W axis.

    Args:
        eps: added to the mean square.
        scale: learn a per-feature gain ``weight[W]`` (initialised to ones), as Llama does;
            ``False`` gives the gain-free form.
    """

    fixed_axes = ("W",)

    def __init__(self, eps: float = 1e-5, scale: bool = True, dims: int | None = None):
        super().__init__()
        self.eps = float(eps)
        self.scale = scale
        if dims is not None and scale:
            self.weight = mx.ones((dims,))

    def build(self, device, dims, dtype):
        if self.scale and "weight" not in self:
            self.weight = mx.ones((dims.W,), dtype=dtype if mx.issubdtype(dtype, mx.floating) else mx.float32)

    def forward(self, device, data):
        w = self.weight if self.scale else None
        return Data(F.rms_norm(data.array, w, self.eps, device=device), data.dims)


class LayerNorm(Layer):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the W axis.

    Args:
        eps: added to the variance.
        affine: learn ``weight`` (ones) and ``bias`` (zeros).
        bias: learn the bias when ``affine`` (some models use a gain only).
    """

    fixed_axes = ("W",)

    def __init__(self, eps: float = 1e-5, affine: bool = True, bias: bool = True, dims: int | None = None):
        super().__init__()
        self.eps = float(eps)
        self.affine = affine
        self.use_bias = bias
        if dims is not None:
            self._create(dims, mx.float32)

    def _create(self, width, dtype):
        if self.affine:
            self.weight = mx.ones((width,), dtype=dtype)
            if self.use_bias:
                self.bias = mx.zeros((width,), dtype=dtype)

    def build(self, device, dims, dtype):
        if self.affine and "weight" not in self:
            self._create(dims.W, dtype if mx.issubdtype(dtype, mx.floating) else mx.float32)

    def forward(self, device, data):
        w = self.weight if self.affine else None
        b = self.bias if (self.affine and self.use_bias) else None
        return Data(mx.fast.layer_norm(data.array, w, b, self.eps), data.dims)

"""`Residual`: ``x + layers(x)``."""

from __future__ import annotations

from ..data import Data
from .base import Layer, Layers


class Residual(Layer):
    """Skip connection around a chain of layers: ``out = x + inner(x)``.

    Args:
        layers: a `Layer`, several layers or a list of layers (chained). Their output must have the
            input's dims.
    """

    def __init__(self, *layers):
        super().__init__()
        if len(layers) == 1 and isinstance(layers[0], Layer):
            self.inner = layers[0]
        else:
            self.inner = Layers(*layers)

    def forward(self, device, data):
        out = self.compile_child(self.inner, device, data)
        self.require(out.dims == data.dims, f"inner output dims equal to input dims {data.dims}", f"{out.dims}")
        return Data(data.array + out.array, data.dims)

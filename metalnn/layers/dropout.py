"""`Dropout`: inverted dropout, active only in training mode (``model.train()``, as in mlx.nn)."""

from __future__ import annotations

import mlx.core as mx

from ..data import Data
from .base import Layer


class Dropout(Layer):
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)`` in training mode.

    In evaluation mode (``model.eval()``) it is the identity; layers start in training mode, as
    mlx.nn's do. The mask is drawn from the device's key, so a seeded device gives the same masks.
    """

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p = float(p)

    def forward(self, device, data):
        if not self.training or self.p == 0.0:
            return data
        keep = mx.random.bernoulli(1.0 - self.p, data.array.shape, key=device.next_key())
        y = mx.where(keep, data.array * (1.0 / (1.0 - self.p)), mx.zeros((), data.array.dtype))
        return Data(y, data.dims)

    def _extra_repr(self):
        return f"p={self.p}"

"""Element-wise activations: `ReLU`, `LeakyReLU`, `SiLU`, `GELU`, `Tanh`, `Sigmoid`."""

from __future__ import annotations

import math

import mlx.core as mx

from .. import fastmath

from ..data import Data
from ..layer import Layer


class _Elementwise(Layer):
    def fn(self, x):  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, device, data):
        return Data(self.fn(data.array), data.dims)


class ReLU(_Elementwise):
    """``max(0, x)``."""

    def fn(self, x):
        return mx.maximum(x, 0)


class LeakyReLU(_Elementwise):
    """``x if x > 0 else slope * x``."""

    def __init__(self, negative_slope: float = 0.01):
        super().__init__()
        self.negative_slope = negative_slope

    def fn(self, x):
        return mx.where(x > 0, x, x * self.negative_slope)


class SiLU(_Elementwise):
    """``x * sigmoid(x)`` (Swish)."""

    def fn(self, x):
        return fastmath.silu(x)


class GELU(_Elementwise):
    """Gaussian error linear unit.

    Args:
        approximate: ``"tanh"`` (``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, GPT-2's form)
            or ``"none"`` (exact, with erf).
    """

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"GELU: approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def fn(self, x):
        return gelu(x, self.approximate)


def gelu(x, approximate="tanh"):
    if approximate == "tanh":
        return fastmath.gelu_tanh(x)
    return 0.5 * x * (1 + mx.erf(x / math.sqrt(2)))


class Tanh(_Elementwise):
    def fn(self, x):
        return fastmath.tanh(x)


class Sigmoid(_Elementwise):
    def fn(self, x):
        return fastmath.sigmoid(x)


ACTIVATIONS = {
    "relu": ReLU,
    "silu": SiLU,
    "swish": SiLU,
    "gelu": GELU,
    "gelu_tanh": lambda: GELU("tanh"),
    "gelu_new": lambda: GELU("tanh"),
    "gelu_exact": lambda: GELU("none"),
    "tanh": Tanh,
    "sigmoid": Sigmoid,
    "leaky_relu": LeakyReLU,
}


def activation(name: str) -> Layer:
    """An activation layer by name (``relu``, ``silu``, ``gelu``, ``gelu_exact``, ``tanh``, ...)."""
    try:
        return ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose from {sorted(ACTIVATIONS)}") from None

"""Element-wise activations: the one registry of activation names, and their layers.

Names mean what they mean in mlx.nn (and PyTorch, and Hugging Face configs): ``"gelu"`` is the
exact erf form; ``"gelu_approx"`` / ``"gelu_tanh"`` (Hugging Face: ``"gelu_new"``,
``"gelu_pytorch_tanh"``) the tanh approximation; ``"gelu_fast"`` ``x * sigmoid(1.702 x)``.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .. import fastmath
from ..data import Data
from ..layer import Layer


def gelu(x):
    """Exact GELU: ``0.5 x (1 + erf(x / sqrt(2)))``."""
    return 0.5 * x * (1 + mx.erf(x * (1 / math.sqrt(2))))


def gelu_fast(x):
    """``x * sigmoid(1.702 x)`` (mlx.nn's ``gelu_fast_approx``)."""
    return x * fastmath.sigmoid(1.702 * x)


def relu2(x):
    """Squared ReLU."""
    return mx.square(mx.maximum(x, 0))


def leaky_relu(x, negative_slope: float = 0.01):
    return mx.where(x > 0, x, x * negative_slope)


#: name -> element-wise function (the single place activation names are defined)
FUNCTIONS = {
    "relu": lambda x: mx.maximum(x, 0),
    "relu2": relu2,
    "leaky_relu": leaky_relu,
    "silu": fastmath.silu,
    "swish": fastmath.silu,
    "gelu": gelu,
    "gelu_approx": fastmath.gelu_tanh,
    "gelu_tanh": fastmath.gelu_tanh,
    "gelu_new": fastmath.gelu_tanh,
    "gelu_pytorch_tanh": fastmath.gelu_tanh,
    "gelu_fast": gelu_fast,
    "tanh": fastmath.tanh,
    "sigmoid": fastmath.sigmoid,
    "identity": lambda x: x,
    "linear": lambda x: x,
}


def activation_fn(name: str):
    """The element-wise function registered under ``name`` (see `FUNCTIONS`)."""
    try:
        return FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose from {sorted(FUNCTIONS)}") from None


class Activation(Layer):
    """An element-wise activation by name: ``Activation("gelu")``. Dims pass through unchanged."""

    def __init__(self, name: str):
        super().__init__()
        self.fn = activation_fn(name)
        self.name = name

    def forward(self, device, data):
        return Data(self.fn(data.array), data.dims)

    def _extra_repr(self):
        return repr(self.name)


class ReLU(Activation):
    """``max(0, x)``."""

    def __init__(self):
        super().__init__("relu")


class LeakyReLU(Activation):
    """``x if x > 0 else negative_slope * x``."""

    def __init__(self, negative_slope: float = 0.01):
        super().__init__("leaky_relu")
        self.negative_slope = float(negative_slope)
        self.fn = lambda x: leaky_relu(x, self.negative_slope)


class SiLU(Activation):
    """``x * sigmoid(x)`` (Swish)."""

    def __init__(self):
        super().__init__("silu")


class GELU(Activation):
    """Gaussian error linear unit, as ``mlx.nn.GELU``.

    Args:
        approx: ``"none"`` (exact, with erf; the default), ``"precise"`` or ``"tanh"`` (the tanh
            approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, GPT-2's), or
            ``"fast"`` (``x * sigmoid(1.702 x)``).
    """

    _BY_APPROX = {"none": "gelu", "precise": "gelu_tanh", "tanh": "gelu_tanh", "fast": "gelu_fast"}

    def __init__(self, approx: str = "none"):
        if approx not in self._BY_APPROX:
            raise ValueError(f"GELU: approx must be one of {sorted(self._BY_APPROX)}, got {approx!r}")
        super().__init__(self._BY_APPROX[approx])
        self.approx = approx


class Tanh(Activation):
    def __init__(self):
        super().__init__("tanh")


class Sigmoid(Activation):
    def __init__(self):
        super().__init__("sigmoid")


def activation(name: str) -> Layer:
    """An activation layer by registered name (``relu``, ``silu``, ``gelu``, ``gelu_approx``, ...)."""
    return Activation(name)

"""Element-wise activation layers. The names and formulas live in `metalnn.functional.activations`
(one registry, mlx.nn's meanings: ``"gelu"`` is exact, ``"gelu_approx"`` the tanh form)."""

from __future__ import annotations

from .. import functional as F
from ..data import Data
from .base import Layer


class Activation(Layer):
    """An element-wise activation by name: ``Activation("gelu")``. Dims pass through unchanged."""

    def __init__(self, name: str, **options):
        super().__init__()
        self.name = F.check_activation(name)
        self.options = dict(options)

    def forward(self, device, data):
        return Data(F.activation(data.array, self.name, device=device, **self.options), data.dims)

    def _extra_repr(self):
        return repr(self.name)


class ReLU(Activation):
    """``max(0, x)``."""

    def __init__(self):
        super().__init__("relu")


class LeakyReLU(Activation):
    """``x if x > 0 else negative_slope * x``."""

    def __init__(self, negative_slope: float = 0.01):
        super().__init__("leaky_relu", negative_slope=float(negative_slope))


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

"""Element-wise activations by name: the one registry of activation names.

Names mean what they mean in mlx.nn (and PyTorch, and Hugging Face configs): ``"gelu"`` is the
exact erf form; ``"gelu_approx"`` / ``"gelu_tanh"`` (Hugging Face: ``"gelu_new"``,
``"gelu_pytorch_tanh"``) the tanh approximation; ``"gelu_fast"`` ``x * sigmoid(1.702 x)``.

``"reference"`` devices run the plain MLX formulas; every other choice runs `metalnn.cpu.fastmath`'s
vectorised primitives where there is one (on the CPU backend; they fall back to the same MLX ops
elsewhere): MLX's Linux CPU backend evaluates ``exp``/``tanh``/``sigmoid`` one element at a time,
10-25x slower (``scripts/bench_fastmath.py``).
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..cpu import fastmath, fused
from ..device import resolve
from ._dispatch import fused_cpu


def _gelu(x):
    return 0.5 * x * (1 + mx.erf(x * (1 / math.sqrt(2))))


def _gelu_tanh(x):
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


def _relu(x):
    return mx.maximum(x, 0)


def _leaky_relu(x, negative_slope=0.01):
    return mx.where(x > 0, x, x * negative_slope)


def _identity(x):
    return x


PLAIN = {
    "relu": _relu,
    "relu2": lambda x: mx.square(_relu(x)),
    "leaky_relu": _leaky_relu,
    "silu": lambda x: x * mx.sigmoid(x),
    "swish": lambda x: x * mx.sigmoid(x),
    "gelu": _gelu,
    "gelu_approx": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": lambda x: x * mx.sigmoid(1.702 * x),
    "tanh": mx.tanh,
    "sigmoid": mx.sigmoid,
    "identity": _identity,
    "linear": _identity,
}

FAST = {
    "silu": fastmath.silu,
    "swish": fastmath.silu,
    "gelu_approx": fastmath.gelu_tanh,
    "gelu_tanh": fastmath.gelu_tanh,
    "gelu_new": fastmath.gelu_tanh,
    "gelu_pytorch_tanh": fastmath.gelu_tanh,
    "gelu_fast": lambda x: x * fastmath.sigmoid(1.702 * x),
    "tanh": fastmath.tanh,
    "sigmoid": fastmath.sigmoid,
}

NAMES = tuple(sorted(PLAIN))

# activation name -> the gate `metalnn.cpu.fused.gated` computes fused with the product
FUSED_GATES = {"silu": "silu", "swish": "silu", "gelu_approx": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "sigmoid": "sigmoid", "tanh": "tanh"}


def check_activation(name: str) -> str:
    """``name`` if it is a registered activation, else a ValueError listing them."""
    if name not in PLAIN:
        raise ValueError(f"unknown activation {name!r}; choose from {list(NAMES)}")
    return name


def activation(x, name: str, device=None, **kwargs):
    """The activation ``name`` applied to ``x`` (any shape); ``kwargs``: ``negative_slope`` for
    ``leaky_relu``."""
    check_activation(name)
    if resolve(device).kernels == "reference":
        return PLAIN[name](x, **kwargs)
    return FAST.get(name, PLAIN[name])(x, **kwargs)


def gated_activation(gate, up, name: str, device=None):
    """``activation(gate, name) * up``: the product of a gated MLP (SwiGLU, GeGLU, GLU, ReGLU).

    On devices other than ``"reference"``, on the CPU backend, for float32 arrays of one shape and
    the gates of `FUSED_GATES`, `metalnn.cpu.fused.gated` computes the gate and the product in one
    multi-threaded pass (and both gradients in one more): about 20x less CPU time forward+backward
    than ``nn.silu(a) * b`` (``scripts/bench_kernels.py --ops gated --cpu-time``, one thread).
    """
    check_activation(name)
    device = resolve(device)
    if (device.kernels != "reference" and name in FUSED_GATES and gate.shape == up.shape
            and fused_cpu(gate, up)):
        return fused.gated(gate, up, FUSED_GATES[name])
    return activation(gate, name, device=device) * up

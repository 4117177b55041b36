"""Fast, differentiable CPU element-wise ops and softmax for MLX.

On Linux x86_64, MLX's CPU backend evaluates transcendental functions one element
at a time (~13-18 ns per element for ``mx.exp``/``mx.sigmoid``/``mx.softmax``).
This module provides the same functions as custom MLX primitives with AVX2+FMA
kernels (``metalnn.cpu._fastmath``, built from ``metalnn/cpu/native/fastmath``), about
10-15x faster. They are ordinary MLX ops: they work inside ``mx.grad``,
``mx.vjp``, ``mx.jvp``, ``mx.vmap`` and ``mx.compile``, and their backward passes
are fused vectorised primitives too.

When the extension is not built (it never is on macOS), was built against another
MLX version or nanobind ABI (see ``metalnn.cpu.native_ext``), or the computation runs on
a GPU stream (Metal), every function falls back to the equivalent MLX ops, so callers
can use this module unconditionally; ``unavailable_reason()`` says why.

* float32 is computed natively; float16/bfloat16 inputs are converted to float32
  and the result converted back; integer inputs are promoted to float32 (like
  ``mx.exp``); float64 and complex inputs use the MLX ops.
* Any layout is accepted (non-contiguous inputs are gathered row by row).
* Set ``METALNN_FASTMATH=0`` in the environment to force the MLX fallbacks.

Accuracy: ``exp`` is within ~1e-7 relative of the exact result over the float32
range (denormal results lose relative precision); the other functions are within
a few float32 ulps of MLX's own ops.
"""

from __future__ import annotations

import math

import mlx.core as mx

from . import native_ext as _native_ext

__all__ = [
    "available",
    "unavailable_reason",
    "exp",
    "sigmoid",
    "silu",
    "tanh",
    "gelu_tanh",
    "softmax",
    "softmax_grad",
]

# The loaded extension module or None; read at every call, so tests can swap in None to
# exercise the MLX-op fallback.
_ext = _native_ext.extension()


def available() -> bool:
    """True when the native kernels are loaded (CPU streams use them)."""
    return _ext is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (``None`` when it is True)."""
    return None if _ext is not None else (_native_ext.unavailable_reason() or "replaced by the MLX ops")


def has_avx2() -> bool:
    """True when the AVX2+FMA kernels run (otherwise the scalar C++ kernels do)."""
    return _ext is not None and bool(_ext.has_avx2())


# --------------------------------------------------------------------------- fallbacks

_GELU_C = math.sqrt(2.0 / math.pi)


def _float32_inside(fn):
    """Run ``fn`` in float32 for float16/bfloat16 inputs and cast the result back, as the
    native kernels do (a multi-op formula rounded to half precision after every op loses
    several bits more)."""

    def wrapped(x, *args, stream=None):
        if x.dtype in (mx.float16, mx.bfloat16):
            args = [a.astype(mx.float32, stream=stream) if isinstance(a, mx.array) else a for a in args]
            y = fn(x.astype(mx.float32, stream=stream), *args, stream=stream)
            return y.astype(x.dtype, stream=stream)
        return fn(x, *args, stream=stream)

    wrapped.__doc__ = fn.__doc__
    return wrapped


@_float32_inside
def _mlx_silu(x, stream=None):
    return mx.multiply(x, mx.sigmoid(x, stream=stream), stream=stream)


@_float32_inside
def _mlx_gelu_tanh(x, stream=None):
    inner = _GELU_C * (x + 0.044715 * mx.power(x, 3, stream=stream))
    return 0.5 * x * (1 + mx.tanh(inner, stream=stream))


@_float32_inside
def _mlx_softmax_grad(y, g, stream=None):
    d = mx.sum(g * y, axis=-1, keepdims=True, stream=stream)
    return mx.multiply(y, g - d, stream=stream)


def _to_array(x):
    return x if isinstance(x, mx.array) else mx.array(x)


# --------------------------------------------------------------------------- public ops


def exp(x, *, stream=None):
    """Element-wise ``exp(x)`` (like ``mx.exp``)."""
    x = _to_array(x)
    if _ext is None:
        return mx.exp(x, stream=stream)
    return _ext.exp(x, stream=stream)


def sigmoid(x, *, stream=None):
    """Element-wise ``1 / (1 + exp(-x))`` (like ``mx.sigmoid``)."""
    x = _to_array(x)
    if _ext is None:
        return mx.sigmoid(x, stream=stream)
    return _ext.sigmoid(x, stream=stream)


def silu(x, *, stream=None):
    """Element-wise ``x * sigmoid(x)`` (like ``mlx.nn.silu``), fused forward and backward."""
    x = _to_array(x)
    if _ext is None:
        return _mlx_silu(x, stream=stream)
    return _ext.silu(x, stream=stream)


def tanh(x, *, stream=None):
    """Element-wise ``tanh(x)`` (like ``mx.tanh``)."""
    x = _to_array(x)
    if _ext is None:
        return mx.tanh(x, stream=stream)
    return _ext.tanh(x, stream=stream)


def gelu_tanh(x, *, stream=None):
    """Tanh-approximated GELU ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``
    (like ``mlx.nn.gelu_approx``), fused forward and backward."""
    x = _to_array(x)
    if _ext is None:
        return _mlx_gelu_tanh(x, stream=stream)
    return _ext.gelu_tanh(x, stream=stream)


def softmax(x, axis: int = -1, *, stream=None):
    """Softmax along ``axis`` (default: the last axis; like ``mx.softmax(x, axis)``).

    The native kernel works on the last axis; another axis is swapped to the end
    and back (the kernel reads the strided rows directly, no extra copy op).
    """
    x = _to_array(x)
    if x.ndim == 0:  # softmax of a scalar is 1
        return mx.softmax(x.reshape(1), axis=-1, stream=stream).reshape(())
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"[softmax] axis {axis} out of range for {x.ndim}-d input")
    if _ext is None:
        return mx.softmax(x, axis=axis, stream=stream)
    ax = axis % x.ndim
    if ax == x.ndim - 1:
        return _ext.softmax(x, stream=stream)
    y = _ext.softmax(mx.swapaxes(x, ax, -1, stream=stream), stream=stream)
    return mx.swapaxes(y, ax, -1, stream=stream)


def softmax_grad(y, g, *, stream=None):
    """``y * (g - sum(g * y, -1, keepdims=True))``: the softmax VJP over the last axis."""
    y = _to_array(y)
    g = _to_array(g)
    if _ext is None:
        return _mlx_softmax_grad(y, g, stream=stream)
    return _ext.softmax_grad(y, g, stream=stream)

"""im2col / col2im for 1-D, 2-D and 3-D windows, differentiable, fast on the CPU.

Layouts are those of ``torch.nn.functional.unfold`` / ``fold`` (channels first):

* ``im2col(x, kernel_size, stride=, padding=, dilation=)``: ``x [N, C, *S]`` ->
  ``cols [N, C*K, L]`` with ``K = prod(kernel_size)`` and ``L = prod(out)``,
  ``out_i = (S_i + 2 p_i - d_i (k_i - 1) - 1) // s_i + 1``. Row ``c*K + k`` holds channel
  ``c`` at kernel offset ``k`` (offsets row-major), column ``l`` the output position
  (row-major); zero padding.
* ``col2im(cols, output_size, kernel_size, ...)``: the adjoint, ``[N, C*K, L]`` ->
  ``[N, C, *output_size]``, summing the values that land on the same position.

A convolution is ``W @ im2col(x)`` and a transposed convolution ``col2im(W^T @ x)``; the
gradient of each op is the other one, so both directions of both convolutions are one
GEMM plus one of these primitives.

On CPU streams they run as native MLX primitives from metalnn's extension
(``metalnn.cpu._fastmath``): strided gathers / unit-stride adds, multi-threaded over rows and
planes (``METALNN_NUM_THREADS`` caps the threads, :func:`set_num_threads` too), any input
layout (``im2col`` reads strided and transposed views directly). They work under
``mx.grad``, ``mx.vjp``, ``mx.jvp``, ``mx.vmap`` and ``mx.compile`` (shapeless too).
Without the extension (macOS, a failed build, another mlx; see ``unavailable_reason()``) or
on a GPU stream they fall back to MLX ops (strided slices and their VJP), with the same
results (those cannot be compiled ``shapeless``: MLX's pad does not infer shapes).

``im2col`` accepts any dtype (it only moves data); ``col2im`` needs a floating dtype and
sums float16/bfloat16 in float32, rounding once.
"""

from __future__ import annotations

import itertools
import math
import operator

import mlx.core as mx

from . import native_ext as _native_ext

__all__ = ["im2col", "col2im", "available", "unavailable_reason", "set_num_threads", "get_num_threads"]

# The loaded extension or None; read at every call (tests swap in None for the fallback).
_ext = _native_ext.extension()


def available() -> bool:
    """True when the native primitives are loaded (CPU streams use them)."""
    return _ext is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (``None`` when it is True)."""
    return None if _ext is not None else (_native_ext.unavailable_reason() or "replaced by the MLX ops")


def set_num_threads(n: int) -> None:
    """Threads (the calling one included) the native CPU primitives may use."""
    if _ext is not None:
        _ext.set_num_threads(int(n))


def get_num_threads() -> int:
    """Threads the native CPU primitives use (1 without the extension)."""
    return int(_ext.get_num_threads()) if _ext is not None else 1


# ----------------------------------------------------------------------------- arguments


def _ints(value, n: int, name: str, op: str, minimum: int) -> tuple[int, ...]:
    vals = tuple(value) if isinstance(value, (list, tuple)) else (value,) * n
    try:
        if len(vals) != n or any(isinstance(v, bool) for v in vals):
            raise TypeError
        vals = tuple(operator.index(v) for v in vals)
    except TypeError:
        raise ValueError(f"{op}: {name} must be an int or a tuple of {n} ints, got {value!r}") from None
    if any(v < minimum for v in vals):
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value!r}")
    return vals


def _window(op, n, kernel_size, stride, padding, dilation):
    return (
        _ints(kernel_size, n, "kernel_size", op, 1),
        _ints(stride, n, "stride", op, 1),
        _ints(padding, n, "padding", op, 0),
        _ints(dilation, n, "dilation", op, 1),
    )


def _out_sizes(op, size, k, s, p, d):
    out = tuple((si + 2 * pi - di * (ki - 1) - 1) // st + 1 for si, ki, st, pi, di in zip(size, k, s, p, d))
    if any(o < 1 for o in out):
        raise ValueError(
            f"{op}: a window of kernel_size {k}, dilation {d} does not fit the spatial size {tuple(size)} "
            f"with padding {p}: no output positions"
        )
    return out


def _native_ok(stream) -> bool:
    if _ext is None:
        return False
    if stream is None:
        device = mx.default_device()
    elif isinstance(stream, mx.Stream):
        device = stream.device
    else:
        device = stream
    kind = device if isinstance(device, mx.DeviceType) else device.type
    return kind == mx.DeviceType.cpu


# ----------------------------------------------------------------------------- MLX-op fallbacks


def _im2col_mlx(x, k, s, p, d, out):
    n, c = x.shape[:2]
    if any(p):
        x = mx.pad(x, [(0, 0), (0, 0)] + [(pi, pi) for pi in p])
    pieces = []
    for offs in itertools.product(*[range(ki) for ki in k]):
        idx = (slice(None), slice(None)) + tuple(
            slice(o * di, o * di + si * (oi - 1) + 1, si) for o, di, si, oi in zip(offs, d, s, out)
        )
        pieces.append(x[idx])
    cols = mx.stack(pieces, axis=2)  # [N, C, K, *out]
    return cols.reshape(n, c * len(pieces), math.prod(out))


def _col2im_mlx(cols, size, k, s, p, d, out):
    n = cols.shape[0]
    c = cols.shape[1] // math.prod(k)
    dtype = cols.dtype
    wide = cols.astype(mx.float32) if dtype in (mx.float16, mx.bfloat16) else cols
    zeros = mx.zeros((n, c, *size), dtype=wide.dtype)
    # col2im is the adjoint of im2col, i.e. its VJP (which MLX derives from the slices).
    _, (y,) = mx.vjp(lambda t: _im2col_mlx(t, k, s, p, d, out), [zeros], [wide])
    return y.astype(dtype)


# ----------------------------------------------------------------------------- public ops


def im2col(x: mx.array, kernel_size, *, stride=1, padding=0, dilation=1, native=True, stream=None) -> mx.array:
    """Sliding windows of ``x [N, C, *S]`` (1 to 3 spatial axes) as columns ``[N, C*K, L]``.

    Same values as ``torch.nn.functional.unfold`` (which covers 2-D only). ``kernel_size``,
    ``stride``, ``padding`` (zeros, both sides) and ``dilation`` are ints or tuples with one
    value per spatial axis. ``native=False`` computes it with plain MLX ops (the reference).
    """
    if not isinstance(x, mx.array):
        raise TypeError(f"im2col: x must be an mx.array, got {type(x).__name__}")
    if not 3 <= x.ndim <= 5:
        raise ValueError(f"im2col: x must be [N, C, *spatial] with 1 to 3 spatial axes, got shape {tuple(x.shape)}")
    n = x.ndim - 2
    k, s, p, d = _window("im2col", n, kernel_size, stride, padding, dilation)
    out = _out_sizes("im2col", x.shape[2:], k, s, p, d)
    if native and _native_ok(stream):
        return _ext.im2col(x, list(k), list(s), list(p), list(d), stream=stream)
    if stream is not None:
        with mx.stream(stream):
            return _im2col_mlx(x, k, s, p, d, out)
    return _im2col_mlx(x, k, s, p, d, out)


def col2im(
    cols: mx.array, output_size, kernel_size, *, stride=1, padding=0, dilation=1, native=True, stream=None
) -> mx.array:
    """Sum columns ``[N, C*K, L]`` back into ``[N, C, *output_size]`` (the adjoint of :func:`im2col`).

    Same values as ``torch.nn.functional.fold`` (2-D only there). ``output_size`` is a tuple
    with 1 to 3 spatial sizes; the other arguments as in :func:`im2col`. ``L`` must equal the
    number of window positions that ``output_size`` gives.
    """
    if not isinstance(cols, mx.array):
        raise TypeError(f"col2im: cols must be an mx.array, got {type(cols).__name__}")
    if not isinstance(output_size, (list, tuple)) or not 1 <= len(output_size) <= 3:
        raise ValueError(f"col2im: output_size must be a tuple of 1 to 3 spatial sizes, got {output_size!r}")
    n = len(output_size)
    size = _ints(tuple(output_size), n, "output_size", "col2im", 1)
    k, s, p, d = _window("col2im", n, kernel_size, stride, padding, dilation)
    out = _out_sizes("col2im", size, k, s, p, d)
    K, L = math.prod(k), math.prod(out)
    if cols.ndim != 3 or cols.shape[1] % K or cols.shape[2] != L:
        raise ValueError(
            f"col2im: expected cols [N, C*{K}, {L}] for output_size {size}, kernel_size {k}, stride {s}, "
            f"padding {p}, dilation {d}; got shape {tuple(cols.shape)}"
        )
    if not mx.issubdtype(cols.dtype, mx.floating):
        raise TypeError(f"col2im: sums overlapping windows, so cols must be floating point, got {cols.dtype}")
    if native and _native_ok(stream):
        return _ext.col2im(cols, list(size), list(k), list(s), list(p), list(d), stream=stream)
    if stream is not None:
        with mx.stream(stream):
            return _col2im_mlx(cols, size, k, s, p, d, out)
    return _col2im_mlx(cols, size, k, s, p, d, out)

"""Convolutions in plain MLX ops (channels-first, PyTorch layouts), 1 to 3 spatial axes.

Two implementations on the same building blocks (arguments already validated and normalised to
``n``-tuples by `metalnn.functional.conv`; ``out`` is the output's spatial shape):

* the reference (`conv_reference`, `conv_transpose_reference`): im2col (strided slices of the
  padded input, stacked) and one batched GEMM; the transposed convolution is the same convolution
  of the zero-inserted, padded input with the flipped weight. MLX differentiates them.
* the CPU path (`conv_cpu`, `conv_transpose_cpu`): the same forward GEMM, with a hand-written
  backward in ``mx.custom_function`` (built once per geometry):

  - ``conv``'s input gradient is ``conv_transpose`` of the output gradient, and
    ``conv_transpose``'s input gradient is ``conv`` of the output gradient (the two ops are
    adjoint for the same weight tensor);
  - ``conv_transpose`` itself runs as one GEMM ``W^T @ pad(x)`` (on the zero-inserted input when
    stride > 1) followed by a sum of ``prod(kernel)`` shifted *views* of the product (a "gather"
    col2im: no scatter, no per-offset padding);
  - weight gradients are one batched GEMM against the im2col matrix (kept from the forward pass
    for ``conv``; built from the output gradient for ``conv_transpose``).
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import mlx.core as mx

__all__ = ["conv_reference", "conv_transpose_reference", "conv_cpu", "conv_transpose_cpu"]


# ----------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------
def _pad_or_crop(x, lo_hi, first_axis=2):
    """Pad (positive) or crop (negative) the trailing axes by ``[(lo, hi), ...]``."""
    widths = [(0, 0)] * first_axis + [(max(lo, 0), max(hi, 0)) for lo, hi in lo_hi]
    if any(w != (0, 0) for w in widths):
        x = mx.pad(x, widths)
    if any(lo < 0 or hi < 0 for lo, hi in lo_hi):
        idx = [slice(None)] * first_axis
        for (lo, hi), size in zip(lo_hi, x.shape[first_axis:]):
            idx.append(slice(max(-lo, 0), size - max(-hi, 0)))
        x = x[tuple(idx)]
    return x


def _zero_insert(x, stride, first_axis=2):
    """Insert ``stride-1`` zeros between elements along each trailing spatial axis."""
    for i, s in enumerate(stride):
        if s == 1:
            continue
        ax = first_axis + i
        size = x.shape[ax]
        x = mx.expand_dims(x, ax + 1)
        widths = [(0, 0)] * x.ndim
        widths[ax + 1] = (0, s - 1)
        x = mx.pad(x, widths)
        shape = list(x.shape)
        x = x.reshape(shape[:ax] + [size * s] + shape[ax + 2:])
        idx = [slice(None)] * x.ndim
        idx[ax] = slice(0, s * (size - 1) + 1)
        x = x[tuple(idx)]
    return x


def _im2col(x, kernel, stride, padding, dilation, out):
    """``[N, C, *S]`` -> ``[N, C, K, prod(out)]`` with ``K = prod(kernel)`` (kernel offsets row-major)."""
    n, c = x.shape[:2]
    xp = _pad_or_crop(x, [(p, p) for p in padding])
    # Keep only the extent the windows touch (PyTorch floors the output size).
    pieces = []
    for offs in itertools.product(*[range(k) for k in kernel]):
        idx = [slice(None), slice(None)]
        for o, d, s, sz in zip(offs, dilation, stride, out):
            start = o * d
            idx.append(slice(start, start + s * (sz - 1) + 1, s))
        pieces.append(xp[tuple(idx)])
    cols = mx.expand_dims(pieces[0], 2) if len(pieces) == 1 else mx.stack(pieces, axis=2)
    return cols.reshape(n, c, len(pieces), math.prod(out))


def _conv_forward(x, weight, stride, padding, dilation, groups, out):
    """Conv via im2col + one batched GEMM; returns ``(y [N, O, *out], cols [N, G, C/G*K, P])``."""
    n, c = x.shape[:2]
    o = weight.shape[0]
    kernel = tuple(weight.shape[2:])
    cols = _im2col(x, kernel, stride, padding, dilation, out)
    cols = cols.reshape(n, groups, (c // groups) * math.prod(kernel), math.prod(out))
    wm = weight.reshape(groups, o // groups, -1)
    y = wm @ cols
    return y.reshape(n, o, *out), cols


def _conv_transpose_forward(x, weight, stride, padding, dilation, groups, out):
    """Transposed conv as ``W^T @ pad(zero_insert(x))`` + a sum of shifted views.

    ``weight`` is ``[C, O/G, *k]``; ``out`` the output spatial shape (output_padding included).
    """
    n, c = x.shape[:2]
    og = weight.shape[1]
    o = og * groups
    kernel = tuple(weight.shape[2:])
    K = math.prod(kernel)
    xs = _zero_insert(x, stride)
    # xpad[q] = xs[q - lo] with lo = d(k-1) - p; length out + d(k-1).
    lohi = []
    for size, k, p, d, so in zip(xs.shape[2:], kernel, padding, dilation, out):
        lo = d * (k - 1) - p
        hi = so + d * (k - 1) - size - lo
        lohi.append((lo, hi))
    xp = _pad_or_crop(xs, lohi)
    qshape = tuple(xp.shape[2:])
    xm = xp.reshape(n, groups, c // groups, math.prod(qshape))
    # [G, C/G, O/G*K] -> transposed: [G, O/G*K, C/G]
    wt = weight.reshape(groups, c // groups, og * K).swapaxes(1, 2)
    prod = (wt @ xm).reshape(n, o, K, *qshape)
    y = None
    for ki, offs in enumerate(itertools.product(*[range(k) for k in kernel])):
        idx = [slice(None), slice(None), ki]
        for off, k, d, so in zip(offs, kernel, dilation, out):
            start = d * (k - 1 - off)
            idx.append(slice(start, start + so))
        v = prod[tuple(idx)]
        y = v if y is None else y + v
    return y


def _weight_grad(a, cols, weight_shape, groups):
    """``sum_n a[n] @ cols[n]^T`` per group: a ``[N, A, P]``, cols ``[N, G, B, P]`` -> ``[G, A/G, B]``."""
    n = a.shape[0]
    am = a.reshape(n, groups, a.shape[1] // groups, -1)
    g = (am @ cols.swapaxes(2, 3)).sum(axis=0)
    return g.reshape(weight_shape)


# ----------------------------------------------------------------------------------------------
# reference: plain ops, MLX autodiff
# ----------------------------------------------------------------------------------------------
def conv_reference(x, weight, stride, padding, dilation, groups, out):
    """``y [N, O, *out]`` of ``x [N, C, *S]`` and ``weight [O, C/G, *k]``: im2col + GEMM."""
    return _conv_forward(x, weight, stride, padding, dilation, groups, out)[0]


def conv_transpose_reference(x, weight, stride, padding, output_padding, dilation, groups, out):
    """``y [N, O, *out]`` of ``x [N, C, *S]`` and ``weight [C, O/G, *k]``.

    The definition: zero-insert ``x`` (``stride - 1`` zeros between elements), pad it by
    ``d(k-1) - p`` before and ``d(k-1) - p + output_padding`` after (cropping where negative) and
    correlate it (stride 1, dilation d) with the spatially flipped weight, read as ``[O, C/G, *k]``.
    """
    kernel = tuple(weight.shape[2:])
    c, og = weight.shape[:2]
    xs = _zero_insert(x, stride)
    xp = _pad_or_crop(xs, [(d * (k - 1) - p, d * (k - 1) - p + op)
                           for k, p, op, d in zip(kernel, padding, output_padding, dilation)])
    w = weight.reshape(groups, c // groups, og, *kernel).swapaxes(1, 2).reshape(groups * og, c // groups, *kernel)
    w = w[(slice(None), slice(None)) + (slice(None, None, -1),) * len(kernel)]
    return _conv_forward(xp, w, (1,) * len(kernel), (0,) * len(kernel), dilation, groups, out)[0]


# ----------------------------------------------------------------------------------------------
# CPU path: hand-written backward
# ----------------------------------------------------------------------------------------------
@lru_cache(maxsize=256)
def _conv_function(stride, padding, dilation, groups, out, in_spatial):
    @mx.custom_function
    def conv(x, weight):
        return _conv_forward(x, weight, stride, padding, dilation, groups, out)

    @conv.vjp
    def conv_vjp(primals, cotangents, outputs):
        x, weight = primals
        dy = cotangents[0]
        cols = outputs[1]
        # Input gradient: the adjoint op, sized back to the input (output_padding absorbs the floor).
        dx = _conv_transpose_forward(dy, weight, stride, padding, dilation, groups, in_spatial)
        dw = _weight_grad(dy.reshape(dy.shape[0], dy.shape[1], -1), cols, weight.shape, groups)
        return dx.astype(x.dtype), dw.astype(weight.dtype)

    return conv


@lru_cache(maxsize=256)
def _conv_transpose_function(stride, padding, dilation, groups, out, in_spatial):
    @mx.custom_function
    def tconv(x, weight):
        return _conv_transpose_forward(x, weight, stride, padding, dilation, groups, out)

    @tconv.vjp
    def tconv_vjp(primals, cotangents, output):
        x, weight = primals
        dy = cotangents[0] if isinstance(cotangents, (list, tuple)) else cotangents
        # dx = conv(dy, W) (W read as a conv weight [C, O/G, *k] mapping O -> C channels).
        dx, cols = _conv_forward(dy, weight, stride, padding, dilation, groups, in_spatial)
        dw = _weight_grad(x.reshape(x.shape[0], x.shape[1], -1), cols, weight.shape, groups)
        return dx.astype(x.dtype), dw.astype(weight.dtype)

    return tconv


def conv_cpu(x, weight, stride, padding, dilation, groups, out):
    """As `conv_reference`, with the hand-written backward."""
    return _conv_function(stride, padding, dilation, groups, tuple(out), tuple(x.shape[2:]))(x, weight)[0]


def conv_transpose_cpu(x, weight, stride, padding, output_padding, dilation, groups, out):
    """As `conv_transpose_reference`, with the hand-written backward (``output_padding`` is in ``out``)."""
    return _conv_transpose_function(stride, padding, dilation, groups, tuple(out), tuple(x.shape[2:]))(x, weight)

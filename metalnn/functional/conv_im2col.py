"""Convolutions as im2col + GEMM (channels-first, PyTorch layouts), 1 to 3 spatial axes.

Two implementations (arguments already validated and normalised to ``n``-tuples by
`metalnn.functional.conv`; ``out`` is the output's spatial shape), both differentiated by MLX:

* the reference (`conv_reference`, `conv_transpose_reference`): im2col from strided slices of
  the padded input, stacked, and one batched GEMM; the transposed convolution is the same
  convolution of the zero-inserted, padded input with the flipped weight. Plain MLX ops only.
* the CPU path (`conv_cpu`, `conv_transpose_cpu`): `metalnn.cpu.im2col`'s native primitives
  (multi-threaded data movement; MLX-op fallbacks without the extension) around one batched
  GEMM: ``conv = W @ im2col(x)``, ``conv_transpose = col2im(W^T @ x)``. Each primitive's VJP is
  the other, so forward and backward are GEMMs plus one im2col or col2im each.
"""

from __future__ import annotations

import itertools
import math

import mlx.core as mx

from ..cpu.im2col import col2im, im2col

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
# CPU path: native im2col / col2im + GEMM, MLX autodiff
# ----------------------------------------------------------------------------------------------
def _add_bias(y, bias):
    """``y [N, O, L] + bias[O]`` as ``y + bias[:, None] @ ones[1, L]``: the same sum, but the bias
    gradient becomes a sum over N of ``[O, L]`` rows and a matrix-vector product, about 2x faster
    on the CPU than MLX's reduction of the broadcast over the N and L axes."""
    if bias is None:
        return y
    ones = mx.ones((1, y.shape[-1]), dtype=y.dtype)
    return y + bias.astype(y.dtype)[:, None] @ ones


def conv_cpu(x, weight, bias, stride, padding, dilation, groups, out):
    """``y [N, O, *out]`` of ``x [N, C, *S]``, ``weight [O, C/G, *k]`` and ``bias [O]`` (or None):
    ``W @ im2col(x) + bias``.

    The backward (MLX autodiff) is two GEMMs and one `col2im` (the VJP of `im2col`).
    """
    n, c = x.shape[:2]
    o = weight.shape[0]
    kernel = tuple(weight.shape[2:])
    cols = im2col(x, kernel, stride=stride, padding=padding, dilation=dilation)  # [N, C*K, L]
    if groups == 1:
        y = weight.reshape(o, -1) @ cols
    else:
        cols = cols.reshape(n, groups, -1, cols.shape[-1])
        y = weight.reshape(groups, o // groups, -1) @ cols
    return _add_bias(y.reshape(n, o, -1), bias).reshape(n, o, *out)


def conv_transpose_cpu(x, weight, bias, stride, padding, output_padding, dilation, groups, out):
    """``y [N, O, *out]`` of ``x [N, C, *S]``, ``weight [C, O/G, *k]`` and ``bias [O]`` (or None):
    ``col2im(W^T @ x) + bias``.

    No zero insertion: the product's columns are the input positions and `col2im` scatters
    each one to its window of the output (``out`` includes ``output_padding``). When
    ``output_padding >= stride`` (allowed below the dilation) the output holds ``output_padding //
    stride`` more window positions than the input has; the input is zero-padded to match.
    """
    extra = [op // s for op, s in zip(output_padding, stride)]
    if any(extra):
        x = mx.pad(x, [(0, 0), (0, 0)] + [(0, e) for e in extra])
    n, c = x.shape[:2]
    og = weight.shape[1]
    kernel = tuple(weight.shape[2:])
    K = math.prod(kernel)
    wt = weight.reshape(groups, c // groups, og * K).swapaxes(1, 2)  # [G, O/G*K, C/G]
    if groups == 1:
        cols = wt[0] @ x.reshape(n, c, -1)
    else:
        cols = wt @ x.reshape(n, groups, c // groups, -1)
    cols = cols.reshape(n, og * groups * K, -1)  # [N, O*K, L_in]
    y = col2im(cols, out, kernel, stride=stride, padding=padding, dilation=dilation)
    return _add_bias(y.reshape(n, og * groups, -1), bias).reshape(y.shape)

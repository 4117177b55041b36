"""Convolutions: ``conv1d/2d/3d`` and ``conv_transpose1d/2d/3d`` in PyTorch layouts.

Layouts (the same as ``torch.nn.functional``):

* ``conv{n}d``: input ``[N, C, *spatial]``, weight ``[O, C/groups, *kernel]``, bias ``[O]``,
  output ``[N, O, *out]`` with ``out = (in + 2*pad - dil*(k-1) - 1) // stride + 1``.
* ``conv_transpose{n}d``: input ``[N, C, *spatial]``, weight ``[C, O/groups, *kernel]``, bias ``[O]``,
  output ``[N, O, *out]`` with ``out = (in-1)*stride - 2*pad + dil*(k-1) + output_padding + 1``.

Reference implementation (``device.kernels == "reference"``, plain MLX ops), chosen by profiling on
a 2-core x86_64 CPU with MLX bound to OpenBLAS (conv2d forward+backward, batch 16, 32->64
channels, 32x32, 3x3, padding 1; see ``scripts/bench_conv.py``):

* ``mx.conv_general`` forward + MLX autodiff: ~220 ms;
* im2col (strided slices of the padded input, stacked) + one batched GEMM, autodiff: ~90 ms;
* the formulation used here, ~25 ms: im2col + GEMM forward, with a hand-written backward (both
  ops are wrapped in ``mx.custom_function``):

  - ``conv``'s input gradient is ``conv_transpose`` of the output gradient, and
    ``conv_transpose``'s input gradient is ``conv`` of the output gradient (the two ops are
    adjoint for the same weight tensor);
  - ``conv_transpose`` itself runs as one GEMM ``W^T @ pad(x)`` (on the zero-inserted input when
    stride > 1) followed by a sum of ``prod(kernel)`` shifted *views* of the product (a "gather"
    col2im: no scatter, no per-offset padding);
  - weight gradients are one batched GEMM against the im2col matrix (kept from the forward pass
    for ``conv``; built from the output gradient for ``conv_transpose``).

Every path is differentiable with ``mx.grad`` / ``nn.value_and_grad`` in input, weight and bias.
"""

from __future__ import annotations

import itertools
import math
import operator

import mlx.core as mx

from ..device import resolve

__all__ = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
           "conv_nd", "conv_transpose_nd", "conv_output_size", "conv_transpose_output_size"]


# ----------------------------------------------------------------------------------------------
# argument handling
# ----------------------------------------------------------------------------------------------
def _tuple(value, n, name, op):
    vals = tuple(value) if isinstance(value, (list, tuple)) else (value,) * n
    if len(vals) != n:
        raise ValueError(f"{op}: {name} must be an int or a tuple of {n} ints, got {value!r}")
    try:
        if any(isinstance(v, bool) for v in vals):
            raise TypeError
        return tuple(operator.index(v) for v in vals)
    except TypeError:
        raise ValueError(f"{op}: {name} must be an int or a tuple of {n} ints, got {value!r}") from None


def conv_output_size(size, kernel, stride=1, padding=0, dilation=1):
    """Output length of a convolution along one axis: ``(in + 2p - d(k-1) - 1) // s + 1``."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def conv_transpose_output_size(size, kernel, stride=1, padding=0, output_padding=0, dilation=1):
    """Output length of a transposed convolution: ``(in-1)s - 2p + d(k-1) + output_padding + 1``."""
    return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def _check(op, n, x, weight, bias, stride, padding, dilation, groups, output_padding=None, transposed=False):
    """Validate arguments; return normalised tuples and the output spatial shape."""
    if not isinstance(x, mx.array) or not isinstance(weight, mx.array):
        raise TypeError(f"{op}: input and weight must be mx.array, got {type(x).__name__} and "
                        f"{type(weight).__name__}")
    if x.ndim != n + 2:
        raise ValueError(f"{op}: expected input of rank {n + 2} [N, C, {', '.join('DHW'[3 - n:])}], "
                         f"got shape {tuple(x.shape)}")
    if weight.ndim != n + 2:
        lay = "[C_in, O/groups, *kernel]" if transposed else "[O, C/groups, *kernel]"
        raise ValueError(f"{op}: expected weight of rank {n + 2} {lay}, got shape {tuple(weight.shape)}")
    stride = _tuple(stride, n, "stride", op)
    padding = _tuple(padding, n, "padding", op)
    dilation = _tuple(dilation, n, "dilation", op)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"{op}: groups must be a positive int, got {groups!r}")
    if any(s < 1 for s in stride):
        raise ValueError(f"{op}: stride must be >= 1, got {stride}")
    if any(p < 0 for p in padding):
        raise ValueError(f"{op}: padding must be >= 0, got {padding}")
    if any(d < 1 for d in dilation):
        raise ValueError(f"{op}: dilation must be >= 1, got {dilation}")
    c = x.shape[1]
    kernel = tuple(weight.shape[2:])
    if any(k < 1 for k in kernel):
        raise ValueError(f"{op}: kernel sizes must be >= 1, got weight shape {tuple(weight.shape)}")
    if c % groups:
        raise ValueError(f"{op}: input channels {c} not divisible by groups={groups}")
    if transposed:
        output_padding = _tuple(output_padding, n, "output_padding", op)
        if weight.shape[0] != c:
            raise ValueError(f"{op}: weight [C_in, O/groups, *kernel] needs C_in = input channels {c}, "
                             f"got weight shape {tuple(weight.shape)}")
        out_channels = weight.shape[1] * groups
        for i, (op_, s, d) in enumerate(zip(output_padding, stride, dilation)):
            if op_ < 0 or (op_ >= s and op_ >= d):
                raise ValueError(f"{op}: output_padding must be >= 0 and smaller than stride or dilation "
                                 f"(axis {i}: stride={s}, dilation={d}), got {output_padding}")
        out = tuple(conv_transpose_output_size(sz, k, s, p, o, d) for sz, k, s, p, o, d in
                    zip(x.shape[2:], kernel, stride, padding, output_padding, dilation))
    else:
        if weight.shape[1] * groups != c:
            raise ValueError(f"{op}: weight [O, C/groups, *kernel] needs C/groups = {c}/{groups} = "
                             f"{c // groups}, got weight shape {tuple(weight.shape)}")
        out_channels = weight.shape[0]
        if out_channels % groups:
            raise ValueError(f"{op}: output channels {out_channels} not divisible by groups={groups}")
        out = tuple(conv_output_size(sz, k, s, p, d) for sz, k, s, p, d in
                    zip(x.shape[2:], kernel, stride, padding, dilation))
    if any(o < 1 for o in out):
        raise ValueError(f"{op}: output size {out} is smaller than 1 for input {tuple(x.shape)}, kernel "
                         f"{kernel}, stride {stride}, padding {padding}, dilation {dilation}")
    if bias is not None:
        if not isinstance(bias, mx.array) or tuple(bias.shape) != (out_channels,):
            raise ValueError(f"{op}: expected bias of shape ({out_channels},), got "
                             f"{tuple(getattr(bias, 'shape', ())) if isinstance(bias, mx.array) else type(bias).__name__}")
    return stride, padding, dilation, output_padding, out


# ----------------------------------------------------------------------------------------------
# building blocks (N-d, channels-first)
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
    if len(pieces) == 1:
        cols = mx.expand_dims(pieces[0], 2)
    else:
        cols = mx.stack(pieces, axis=2)
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


def _make_conv(stride, padding, dilation, groups, out, in_spatial):
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


def _make_conv_transpose(stride, padding, dilation, groups, out, in_spatial):
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


def _add_bias(y, bias, n):
    if bias is None:
        return y
    return y + bias.astype(y.dtype).reshape((1, -1) + (1,) * n)


def _kernels_path(op, device):
    if device.kernels == "reference":
        return None
    from ..kernels import conv as kernel

    return kernel


# ----------------------------------------------------------------------------------------------
# public ops
# ----------------------------------------------------------------------------------------------
def conv_nd(n, x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, device=None, op=None):
    """N-d convolution (``n`` in 1..3) in PyTorch layout; see `conv2d`."""
    op = op or f"conv{n}d"
    stride, padding, dilation, _, out = _check(op, n, x, weight, bias, stride, padding, dilation, groups)
    device = resolve(device)
    kernel = _kernels_path(op, device)
    if kernel is not None:
        return kernel.conv_nd(n, x, weight, bias, stride, padding, dilation, groups, device)
    fn = _make_conv(stride, padding, dilation, groups, out, tuple(x.shape[2:]))
    y = fn(x, weight)[0]
    return _add_bias(y, bias, n)


def conv_transpose_nd(n, x, weight, bias=None, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                      device=None, op=None):
    """N-d transposed convolution (``n`` in 1..3) in PyTorch layout; see `conv_transpose2d`."""
    op = op or f"conv_transpose{n}d"
    stride, padding, dilation, output_padding, out = _check(op, n, x, weight, bias, stride, padding, dilation,
                                                            groups, output_padding, transposed=True)
    device = resolve(device)
    kernel = _kernels_path(op, device)
    if kernel is not None:
        return kernel.conv_transpose_nd(n, x, weight, bias, stride, padding, output_padding, dilation, groups,
                                        device)
    fn = _make_conv_transpose(stride, padding, dilation, groups, out, tuple(x.shape[2:]))
    y = fn(x, weight)
    return _add_bias(y, bias, n)


def conv1d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, device=None):
    """1-D convolution: x ``[N, C, L]``, weight ``[O, C/groups, k]``, bias ``[O]`` -> ``[N, O, L_out]``."""
    return conv_nd(1, x, weight, bias, stride, padding, dilation, groups, device)


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, device=None):
    """2-D convolution, same semantics as ``torch.nn.functional.conv2d``.

    Args:
        x: ``[N, C, H, W]``.
        weight: ``[O, C/groups, kH, kW]``.
        bias: ``[O]`` or None.
        stride, padding, dilation: int or ``(h, w)``; padding is zero padding on both sides.
        groups: split channels into this many independent groups.
        device: `Device` whose ``kernels`` picks the implementation.
    Returns:
        ``[N, O, H_out, W_out]`` with ``out = (in + 2*pad - dil*(k-1) - 1) // stride + 1``.
    Raises:
        ValueError: invalid shapes or arguments (before any work).
    """
    return conv_nd(2, x, weight, bias, stride, padding, dilation, groups, device)


def conv3d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, device=None):
    """3-D convolution: x ``[N, C, D, H, W]``, weight ``[O, C/groups, kD, kH, kW]``."""
    return conv_nd(3, x, weight, bias, stride, padding, dilation, groups, device)


def conv_transpose1d(x, weight, bias=None, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                     device=None):
    """1-D transposed convolution: x ``[N, C, L]``, weight ``[C, O/groups, k]`` -> ``[N, O, L_out]``."""
    return conv_transpose_nd(1, x, weight, bias, stride, padding, output_padding, dilation, groups, device)


def conv_transpose2d(x, weight, bias=None, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                     device=None):
    """2-D transposed convolution, same semantics as ``torch.nn.functional.conv_transpose2d``.

    Args:
        x: ``[N, C, H, W]``.
        weight: ``[C, O/groups, kH, kW]``.
        bias: ``[O]`` or None.
        output_padding: extra size added to one side of the output (must be smaller than stride
            or dilation).
    Returns:
        ``[N, O, H_out, W_out]`` with ``out = (in-1)*stride - 2*pad + dil*(k-1) + output_padding + 1``.
    """
    return conv_transpose_nd(2, x, weight, bias, stride, padding, output_padding, dilation, groups, device)


def conv_transpose3d(x, weight, bias=None, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                     device=None):
    """3-D transposed convolution: x ``[N, C, D, H, W]``, weight ``[C, O/groups, kD, kH, kW]``."""
    return conv_transpose_nd(3, x, weight, bias, stride, padding, output_padding, dilation, groups, device)

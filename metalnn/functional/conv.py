"""Convolutions: ``conv1d/2d/3d`` and ``conv_transpose1d/2d/3d`` in PyTorch layouts.

Layouts (the same as ``torch.nn.functional``):

* ``conv{n}d``: input ``[N, C, *spatial]``, weight ``[O, C/groups, *kernel]``, bias ``[O]``,
  output ``[N, O, *out]`` with ``out = (in + 2*pad - dil*(k-1) - 1) // stride + 1``.
* ``conv_transpose{n}d``: input ``[N, C, *spatial]``, weight ``[C, O/groups, *kernel]``, bias ``[O]``,
  output ``[N, O, *out]`` with ``out = (in-1)*stride - 2*pad + dil*(k-1) + output_padding + 1``.

Implementation by ``device.kernels`` (every path is differentiable with ``mx.grad`` /
``nn.value_and_grad`` in input, weight and bias):

* ``"reference"``: `metalnn.functional.conv_im2col.conv_reference` / ``conv_transpose_reference``
  (im2col + GEMM in plain MLX ops, MLX autodiff).
* ``"auto"``: MLX's ``mx.conv_general`` (channels moved last and back), except where MLX cannot
  (grouped 3-D convolutions; transposed convolutions with ``output_padding > padding``, whose MLX
  input gradient has the wrong shape in MLX 0.32), which run the CPU path below. On the CPU backend
  every convolution runs the CPU path (`conv_im2col.conv_cpu` / ``conv_transpose_cpu``:
  ``W @ im2col(x)`` and ``col2im(W^T @ x)`` with `metalnn.cpu.im2col`'s native multi-threaded
  primitives, each the other's VJP, so forward and backward are GEMMs plus one im2col or col2im
  each). One thread, CPU time (``scripts/bench_kernels.py --ops conv2d,conv_transpose2d
  --cpu-time``): conv2d (batch 16, 32 -> 64 channels, 32x32, 3x3) forward+backward 1.8x less than
  ``mx.conv_general`` with MLX autodiff, conv_transpose2d (64 -> 32 channels, 16x16, 4x4, stride 2)
  about 40x less; ``python scripts/bench_conv.py`` compares conv2d with PyTorch's CPU convolution
  (README, "Speed on Linux CPU").
* ``"metal"``/``"emulate"``: the implicit-GEMM kernels of `metalnn.kernels.conv` (every
  convolution of one float dtype with no empty axis); otherwise ``"auto"``.

Integer inputs are promoted to float32, mixed float dtypes to their common dtype. Empty inputs (a
zero batch or channel count) give zeros.
"""

from __future__ import annotations

import operator

import mlx.core as mx

from ..device import resolve
from ..kernels import conv as kernels
from ..kernels.op_math import conv_output_size, conv_transpose_output_size
from ._dispatch import emulator_options, kernel_backend, on_cpu
from .conv_im2col import conv_cpu, conv_reference, conv_transpose_cpu, conv_transpose_reference

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
# dispatch
# ----------------------------------------------------------------------------------------------
def mlx_conv_supports(n: int, groups: int, padding=None, output_padding=None) -> bool:
    """Whether ``mx.conv_general`` computes this convolution and its gradients (MLX 0.32)."""
    if n == 3 and groups > 1:
        return False  # "[conv] Can only handle groups != 1 in 1D or 2D convolutions."
    if output_padding is not None and any(op > p for op, p in zip(output_padding, padding)):
        return False  # the input gradient comes back smaller than the input
    return True


def conv_mlx(x, weight, stride, padding, dilation, groups):
    """``mx.conv_general`` in PyTorch layout: x ``[N, C, *S]``, weight ``[O, C/G, *k]``."""
    y = mx.conv_general(mx.moveaxis(x, 1, -1), mx.moveaxis(weight, 1, -1), stride=list(stride),
                        padding=list(padding), kernel_dilation=list(dilation), groups=groups)
    return mx.moveaxis(y, -1, 1)


def conv_transpose_mlx(x, weight, stride, padding, output_padding, dilation, groups):
    """Transposed convolution through ``mx.conv_general`` (input dilation, flipped kernel).

    x ``[N, C, *S]``, weight ``[C, O/G, *k]``. The zero-inserted input is padded by
    ``lo = d(k-1) - p`` before and ``lo + output_padding`` after; MLX gets one symmetric padding
    (the larger of the two, at least 0) and the surplus is cropped.
    """
    c, og = weight.shape[:2]
    kernel = tuple(weight.shape[2:])
    w = weight.reshape(groups, c // groups, og, *kernel)
    w = mx.moveaxis(w, 1, -1).reshape(groups * og, *kernel, c // groups)
    lo = [d * (k - 1) - p for k, p, d in zip(kernel, padding, dilation)]
    hi = [a + op for a, op in zip(lo, output_padding)]
    pad = [max(0, a, b) for a, b in zip(lo, hi)]
    y = mx.conv_general(mx.moveaxis(x, 1, -1), w, stride=1, padding=pad, kernel_dilation=list(dilation),
                        input_dilation=list(stride), groups=groups, flip=True)
    crop = tuple(slice(P - a, size - (P - b)) for P, a, b, size in zip(pad, lo, hi, y.shape[1:-1]))
    return mx.moveaxis(y[(slice(None),) + crop], -1, 1)


def _promote(x, weight):
    dtype = mx.result_type(x.dtype, weight.dtype)
    if not mx.issubdtype(dtype, mx.floating):
        dtype = mx.float32
    return x.astype(dtype), weight.astype(dtype)


def _empty(x, weight, out_channels, out):
    # Zeros that still depend on x and weight, so that their gradients are (zero) arrays.
    return mx.zeros((x.shape[0], out_channels, *out), dtype=x.dtype) + 0 * (x.sum() + weight.sum())


def _add_bias(y, bias, n):
    if bias is None:
        return y
    return y + bias.astype(y.dtype).reshape((1, -1) + (1,) * n)


# ----------------------------------------------------------------------------------------------
# public ops
# ----------------------------------------------------------------------------------------------
def conv_nd(n, x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, device=None, op=None):
    """N-d convolution (``n`` in 1..3) in PyTorch layout; see `conv2d`."""
    op = op or f"conv{n}d"
    stride, padding, dilation, _, out = _check(op, n, x, weight, bias, stride, padding, dilation, groups)
    device = resolve(device)
    x, weight = _promote(x, weight)
    backend = kernel_backend(device)
    if x.size == 0 or weight.size == 0:
        y = _empty(x, weight, weight.shape[0], out)
    elif device.kernels == "reference":
        y = conv_reference(x, weight, stride, padding, dilation, groups, out)
    elif backend and kernels.supports(x, weight):
        y = kernels.conv(x, weight, stride, padding, dilation, groups, backend, emulator_options(device))
    elif not on_cpu() and mlx_conv_supports(n, groups):
        y = conv_mlx(x, weight, stride, padding, dilation, groups)
    else:
        return conv_cpu(x, weight, bias, stride, padding, dilation, groups, out)
    return _add_bias(y, bias, n)


def conv_transpose_nd(n, x, weight, bias=None, stride=1, padding=0, output_padding=0, dilation=1, groups=1,
                      device=None, op=None):
    """N-d transposed convolution (``n`` in 1..3) in PyTorch layout; see `conv_transpose2d`."""
    op = op or f"conv_transpose{n}d"
    stride, padding, dilation, output_padding, out = _check(op, n, x, weight, bias, stride, padding, dilation,
                                                            groups, output_padding, transposed=True)
    device = resolve(device)
    x, weight = _promote(x, weight)
    backend = kernel_backend(device)
    args = (stride, padding, output_padding, dilation, groups)
    if x.size == 0 or weight.size == 0:
        y = _empty(x, weight, weight.shape[1] * groups, out)
    elif device.kernels == "reference":
        y = conv_transpose_reference(x, weight, *args, out)
    elif backend and kernels.supports(x, weight):
        y = kernels.conv_transpose(x, weight, *args, backend, emulator_options(device))
    elif not on_cpu() and mlx_conv_supports(n, groups, padding, output_padding):
        y = conv_transpose_mlx(x, weight, *args)
    else:
        return conv_transpose_cpu(x, weight, bias, *args, out)
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

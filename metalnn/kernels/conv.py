"""Convolutions on custom kernels (``metal_kernels/conv.metal``): conv and conv_transpose, 1-D/2-D/3-D.

Three implicit-GEMM kernels cover every op and gradient, in the geometry of one convolution
``x [N, C, *S] * w [O, C/G, *k] -> y [N, O, *P]``:

* ``conv2d_forward``: ``y`` from ``x`` and ``w``;
* ``conv2d_dgrad``: the input gradient ``dx`` from ``dy`` and ``w`` (a gather: no atomics);
* ``conv2d_wgrad``: the weight gradient ``dw`` from ``dy`` and ``x`` (split along the reduction,
  float32 partials summed here).

``conv`` runs ``forward`` with a VJP of ``dgrad`` (dx) and ``wgrad`` (dw). ``conv_transpose`` is the
adjoint: with its weight ``[C_in, O/G, *k]`` read as a conv weight mapping ``O`` to ``C_in`` channels
(the conv's input is the transposed conv's output, size ``output_padding`` included), its forward is
``dgrad``, its input gradient is ``forward`` and its weight gradient is ``wgrad`` with ``x`` in the
role of ``dy`` and ``dy`` in the role of ``x``. Bias (``+ b``, ``db = sum(dy)``) uses MLX ops.

Routing: the kernels are written for three spatial axes; 2-D runs with ``D = 1`` and 1-D with
``D = H = 1`` (inputs reshaped, no copies), 3-D natively, so every ``conv{1,2,3}d`` and
``conv_transpose{1,2,3}d`` with any stride, padding, dilation, groups and output_padding runs on the
kernels. Inputs of different dtypes are cast to their promoted dtype; accumulation is float32.
Empty tensors (a zero batch or channel count) return zeros without a launch.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .launch import run

FAMILY = "conv"

THREADS = 128           # threads per threadgroup (4 SIMD groups)
TILE_M = 32             # output rows (channels) per threadgroup
TILE_N = 32             # output columns (pixels, or weight columns for wgrad) per threadgroup
TILE_K = 16             # reduction chunk staged in threadgroup memory
#: The weight gradient's reduction (over N * prod(out)) is split into slices along grid z so that
#: small weights still give about WGRAD_TARGET_THREADGROUPS threadgroups; slices are at least
#: WGRAD_MIN_SLICE long (rounded up to TILE_K). Each slice writes a float32 partial of dw
#: (at most ~WGRAD_TARGET_THREADGROUPS * 32 * 32 floats beyond dw itself), summed with MLX.
WGRAD_MIN_SLICE = 512
WGRAD_TARGET_THREADGROUPS = 256


def _cdiv(a, b):
    return -(-a // b)


class _Geom:
    """One convolution's sizes in the kernels' 3-D form (``x [N, C, D, H, W]``, ``y [N, O, OD, OH, OW]``)."""

    def __init__(self, n, c, spatial, o, out, kernel, stride, padding, dilation, groups):
        pad3 = lambda t, fill: (fill,) * (3 - len(t)) + tuple(int(v) for v in t)  # noqa: E731
        self.N, self.C, self.O, self.G = int(n), int(c), int(o), int(groups)
        self.S = pad3(spatial, 1)
        self.P = pad3(out, 1)
        self.K = pad3(kernel, 1)
        self.stride = pad3(stride, 1)
        self.padding = pad3(padding, 0)
        self.dilation = pad3(dilation, 1)
        self.Cg, self.Og = self.C // self.G, self.O // self.G
        self.KK = math.prod(self.K)

    def params(self, kps=0):
        vals = [self.N, self.C, *self.S, self.O, *self.P, *self.K, *self.stride, *self.padding,
                *self.dilation, self.G, kps]
        return mx.array(vals, dtype=mx.int32)

    def x_shape(self):
        return (self.N, self.C, *self.S)

    def y_shape(self):
        return (self.N, self.O, *self.P)

    def w_shape(self):
        return (self.O, self.Cg, *self.K)


def _launch(name, geom, inputs, out_shape, out_dtype, grid, device, kps=0):
    (out,) = run(FAMILY, name, device.kernels, [*inputs, geom.params(kps)], [out_shape], [out_dtype],
                 grid=grid, threadgroup=(THREADS, 1, 1), template=[("T", inputs[0].dtype)],
                 emulator_options=getattr(device, "emulator_options", None))
    return out


def _forward(x, w, geom, device):
    """``y [N, O, *P]`` of the convolution."""
    cols = geom.N * math.prod(geom.P)
    grid = (_cdiv(cols, TILE_N) * THREADS, _cdiv(geom.Og, TILE_M), geom.G)
    return _launch("conv2d_forward", geom, [x, w], geom.y_shape(), x.dtype, grid, device)


def _dgrad(dy, w, geom, device):
    """``dx [N, C, *S]``: the input gradient (the adjoint of `_forward`)."""
    cols = geom.N * math.prod(geom.S)
    grid = (_cdiv(cols, TILE_N) * THREADS, _cdiv(geom.Cg, TILE_M), geom.G)
    return _launch("conv2d_dgrad", geom, [dy, w], geom.x_shape(), dy.dtype, grid, device)


def _wgrad(dy, x, geom, device, dtype):
    """``dw [O, C/G, *k]`` from ``dy [N, O, *P]`` and ``x [N, C, *S]``."""
    ktot = geom.N * math.prod(geom.P)
    ncols = geom.Cg * geom.KK
    tiles = _cdiv(ncols, TILE_N) * _cdiv(geom.Og, TILE_M) * geom.G
    splits = max(1, min(_cdiv(WGRAD_TARGET_THREADGROUPS, tiles), ktot // max(1, WGRAD_MIN_SLICE)))
    kps = _cdiv(_cdiv(ktot, splits), TILE_K) * TILE_K
    splits = _cdiv(ktot, kps)
    grid = (_cdiv(ncols, TILE_N) * THREADS, _cdiv(geom.Og, TILE_M), geom.G * splits)
    dwp = _launch("conv2d_wgrad", geom, [dy, x.astype(dy.dtype)], (splits, geom.O, ncols), mx.float32, grid,
                  device, kps=kps)
    dw = dwp[0] if splits == 1 else dwp.sum(axis=0)
    return dw.reshape(geom.w_shape()).astype(dtype)


def _make_conv(geom, device):
    @mx.custom_function
    def conv(x, w):
        return _forward(x, w, geom, device)

    @conv.vjp
    def conv_vjp(primals, cotangents, output):
        x, w = primals
        dy = cotangents[0] if isinstance(cotangents, (list, tuple)) else cotangents
        dy = dy.astype(x.dtype)
        return _dgrad(dy, w, geom, device), _wgrad(dy, x, geom, device, w.dtype)

    return conv


def _make_conv_transpose(geom, device):
    # ``geom`` is the adjoint convolution's: its input is this op's output, its output this op's input.
    @mx.custom_function
    def tconv(x, w):
        return _dgrad(x, w, geom, device)

    @tconv.vjp
    def tconv_vjp(primals, cotangents, output):
        x, w = primals
        dy = cotangents[0] if isinstance(cotangents, (list, tuple)) else cotangents
        dy = dy.astype(x.dtype)
        return _forward(dy, w, geom, device), _wgrad(x, dy, geom, device, w.dtype)

    return tconv


def _common_dtype(x, weight):
    dtype = mx.result_type(x.dtype, weight.dtype)
    if not mx.issubdtype(dtype, mx.floating):
        dtype = mx.float32
    return dtype


def _add_bias(y, bias, n):
    if bias is None:
        return y
    return y + bias.astype(y.dtype).reshape((1, -1) + (1,) * n)


def conv_nd(n, x, weight, bias, stride, padding, dilation, groups, device):
    """Kernel-backed ``conv{n}d``; arguments already validated and normalised to ``n``-tuples."""
    from ..functional.conv import conv_output_size

    dtype = _common_dtype(x, weight)
    x, weight = x.astype(dtype), weight.astype(dtype)
    kernel = tuple(weight.shape[2:])
    out = tuple(conv_output_size(s, k, st, p, d) for s, k, st, p, d in
                zip(x.shape[2:], kernel, stride, padding, dilation))
    geom = _Geom(x.shape[0], x.shape[1], x.shape[2:], weight.shape[0], out, kernel, stride, padding, dilation,
                 groups)
    if 0 in (geom.N, geom.C, geom.O):
        y = mx.zeros(geom.y_shape(), dtype=dtype) + 0 * (x.sum() + weight.sum())
    else:
        x3 = x.reshape(geom.x_shape())
        w3 = weight.reshape(geom.w_shape())
        y = _make_conv(geom, device)(x3, w3)
    return _add_bias(y.reshape(x.shape[0], weight.shape[0], *out), bias, n)


def conv_transpose_nd(n, x, weight, bias, stride, padding, output_padding, dilation, groups, device):
    """Kernel-backed ``conv_transpose{n}d``; arguments already validated and normalised."""
    from ..functional.conv import conv_transpose_output_size

    dtype = _common_dtype(x, weight)
    x, weight = x.astype(dtype), weight.astype(dtype)
    kernel = tuple(weight.shape[2:])
    out = tuple(conv_transpose_output_size(s, k, st, p, op, d) for s, k, st, p, op, d in
                zip(x.shape[2:], kernel, stride, padding, output_padding, dilation))
    out_channels = weight.shape[1] * groups
    # The adjoint convolution maps [N, out_channels, *out] -> [N, C_in, *x_spatial].
    geom = _Geom(x.shape[0], out_channels, out, x.shape[1], x.shape[2:], kernel, stride, padding, dilation,
                 groups)
    if 0 in (geom.N, geom.C, geom.O):
        y = mx.zeros(geom.x_shape(), dtype=dtype) + 0 * (x.sum() + weight.sum())
    else:
        x3 = x.reshape(geom.y_shape())
        w3 = weight.reshape(geom.w_shape())
        y = _make_conv_transpose(geom, device)(x3, w3)
    return _add_bias(y.reshape(x.shape[0], out_channels, *out), bias, n)

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
role of ``dy`` and ``dy`` in the role of ``x``. `metalnn.functional` adds the bias with MLX ops.

Routing: the kernels are written for three spatial axes; 2-D runs with ``D = 1`` and 1-D with
``D = H = 1`` (inputs reshaped, no copies), 3-D natively, so every ``conv{1,2,3}d`` and
``conv_transpose{1,2,3}d`` with any stride, padding, dilation, groups and output_padding runs on the
kernels. `supports` asks for non-empty inputs of one float dtype (`metalnn.functional` promotes
dtypes and handles empty tensors); accumulation is float32. The ``mx.custom_function`` of each
geometry (strides, padding, dilation, groups, output_padding, backend) is built once.
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx

from .op_math import conv_output_size, conv_transpose_output_size
from . import launch

FAMILY = "conv"
DTYPES = (mx.float32, mx.float16, mx.bfloat16)

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


def supports(x, weight) -> bool:
    """Whether the kernels take ``x [N, C, *S]`` and ``weight`` (1 to 3 spatial axes): one float
    dtype, no empty axis."""
    return (2 < x.ndim <= 5 and x.dtype == weight.dtype and x.dtype in DTYPES and x.size > 0
            and weight.size > 0)


def _cdiv(a, b):
    return -(-a // b)


def _pad3(values, fill):
    return (fill,) * (3 - len(values)) + tuple(int(v) for v in values)


class _Geom:
    """One convolution's sizes in the kernels' 3-D form (``x [N, C, D, H, W]``, ``y [N, O, OD, OH, OW]``)."""

    def __init__(self, n, c, spatial, o, out, kernel, stride, padding, dilation, groups):
        self.N, self.C, self.O, self.G = int(n), int(c), int(o), int(groups)
        self.S = _pad3(spatial, 1)
        self.P = _pad3(out, 1)
        self.K = _pad3(kernel, 1)
        self.stride = _pad3(stride, 1)
        self.padding = _pad3(padding, 0)
        self.dilation = _pad3(dilation, 1)
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


def _launch(name, geom, inputs, out_shape, out_dtype, grid, backend, options, kps=0):
    (out,) = launch.run(FAMILY, name, backend, [*inputs, geom.params(kps)], [out_shape], [out_dtype], grid=grid,
                        threadgroup=(THREADS, 1, 1), template=[("T", inputs[0].dtype)], emulator_options=options)
    return out


def _forward(x, w, geom, backend, options):
    """``y [N, O, *P]`` of the convolution."""
    cols = geom.N * math.prod(geom.P)
    grid = (_cdiv(cols, TILE_N) * THREADS, _cdiv(geom.Og, TILE_M), geom.G)
    return _launch("conv2d_forward", geom, [x, w], geom.y_shape(), x.dtype, grid, backend, options)


def _dgrad(dy, w, geom, backend, options):
    """``dx [N, C, *S]``: the input gradient (the adjoint of `_forward`)."""
    cols = geom.N * math.prod(geom.S)
    grid = (_cdiv(cols, TILE_N) * THREADS, _cdiv(geom.Cg, TILE_M), geom.G)
    return _launch("conv2d_dgrad", geom, [dy, w], geom.x_shape(), dy.dtype, grid, backend, options)


def _wgrad(dy, x, geom, backend, options, dtype):
    """``dw [O, C/G, *k]`` from ``dy [N, O, *P]`` and ``x [N, C, *S]``."""
    ktot = geom.N * math.prod(geom.P)
    ncols = geom.Cg * geom.KK
    tiles = _cdiv(ncols, TILE_N) * _cdiv(geom.Og, TILE_M) * geom.G
    splits = max(1, min(_cdiv(WGRAD_TARGET_THREADGROUPS, tiles), ktot // max(1, WGRAD_MIN_SLICE)))
    kps = _cdiv(_cdiv(ktot, splits), TILE_K) * TILE_K
    splits = _cdiv(ktot, kps)
    grid = (_cdiv(ncols, TILE_N) * THREADS, _cdiv(geom.Og, TILE_M), geom.G * splits)
    dwp = _launch("conv2d_wgrad", geom, [dy, x.astype(dy.dtype)], (splits, geom.O, ncols), mx.float32, grid,
                  backend, options, kps=kps)
    dw = dwp[0] if splits == 1 else dwp.sum(axis=0)
    return dw.reshape(geom.w_shape()).astype(dtype)


def _cotangent(cotangents, dtype):
    dy = cotangents[0] if isinstance(cotangents, (list, tuple)) else cotangents
    return dy.astype(dtype)


@lru_cache(maxsize=256)
def _conv_function(stride, padding, dilation, groups, backend, options):
    # Arguments are 3-tuples; the function takes x [N, C, D, H, W] and w [O, C/G, kD, kH, kW].
    def geometry(x, w):
        kernel = w.shape[2:]
        out = [conv_output_size(*a) for a in zip(x.shape[2:], kernel, stride, padding, dilation)]
        return _Geom(x.shape[0], x.shape[1], x.shape[2:], w.shape[0], out, kernel, stride, padding, dilation, groups)

    @mx.custom_function
    def conv(x, w):
        return _forward(x, w, geometry(x, w), backend, options)

    @conv.vjp
    def conv_vjp(primals, cotangents, output):
        x, w = primals
        geom = geometry(x, w)
        dy = _cotangent(cotangents, x.dtype)
        return _dgrad(dy, w, geom, backend, options), _wgrad(dy, x, geom, backend, options, w.dtype)

    return conv


@lru_cache(maxsize=256)
def _conv_transpose_function(stride, padding, output_padding, dilation, groups, backend, options):
    # The geometry is the adjoint convolution's: its input is this op's output (x_shape), its output
    # this op's input (y_shape); the weight [C_in, O/G, *k] is read as that convolution's weight.
    def geometry(x, w):
        kernel = w.shape[2:]
        out = [conv_transpose_output_size(*a) for a in zip(x.shape[2:], kernel, stride, padding, output_padding,
                                                           dilation)]
        return _Geom(x.shape[0], w.shape[1] * groups, out, x.shape[1], x.shape[2:], kernel, stride, padding,
                     dilation, groups)

    @mx.custom_function
    def tconv(x, w):
        return _dgrad(x, w, geometry(x, w), backend, options)

    @tconv.vjp
    def tconv_vjp(primals, cotangents, output):
        x, w = primals
        geom = geometry(x, w)
        dy = _cotangent(cotangents, x.dtype)
        return _forward(dy, w, geom, backend, options), _wgrad(x, dy, geom, backend, options, w.dtype)

    return tconv


def _as_3d(a):
    return a.reshape(*a.shape[:2], *_pad3(a.shape[2:], 1))


def conv(x, weight, stride, padding, dilation, groups, backend, emulator_options=()):
    """``conv{n}d`` without bias on the kernels: x ``[N, C, *S]``, weight ``[O, C/G, *k]`` -> ``[N, O, *P]``.

    Arguments validated and normalised to ``n``-tuples (`metalnn.functional.conv_nd`); check
    `supports` first. Differentiable in x and weight.
    """
    fn = _conv_function(_pad3(stride, 1), _pad3(padding, 0), _pad3(dilation, 1), int(groups), backend,
                        launch.options_key(emulator_options))
    y = fn(_as_3d(x), _as_3d(weight))
    return y.reshape(*y.shape[:2], *y.shape[5 - (x.ndim - 2):])


def conv_transpose(x, weight, stride, padding, output_padding, dilation, groups, backend, emulator_options=()):
    """``conv_transpose{n}d`` without bias on the kernels: x ``[N, C, *S]``, weight ``[C, O/G, *k]``.

    Arguments validated and normalised (`metalnn.functional.conv_transpose_nd`); check `supports`
    first. Returns ``[N, O, *P]``; differentiable in x and weight.
    """
    fn = _conv_transpose_function(_pad3(stride, 1), _pad3(padding, 0), _pad3(output_padding, 0),
                                  _pad3(dilation, 1), int(groups), backend, launch.options_key(emulator_options))
    y = fn(_as_3d(x), _as_3d(weight))
    return y.reshape(*y.shape[:2], *y.shape[5 - (x.ndim - 2):])

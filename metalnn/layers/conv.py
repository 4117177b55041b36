"""Convolution layers: `Conv1D`, `Conv2D`, `Conv3D`, `ConvTransposed1D`, `ConvTransposed2D`, `ConvTransposed3D`.

Plain arrays are channels-last, as ``mx.conv2d`` and mlx.nn take them: ``[N, L, C]``,
``[N, H, W, C]``, ``[N, D, H, W, C]`` in, the same layout out; the input channels (and a 3-D
input's depth) are then read from the array.

`Data` is planar (the builder's layout): channels are stacked along D, sample after sample.

=========================  ==================================  ====================================
layer                      input dims ``(W, H, D)``            output dims
=========================  ==================================  ====================================
``Conv1D``                 ``(L, 1, N*C)``                     ``(L_out, 1, N*out_channels)``
``Conv2D``                 ``(W, H, N*C)``                     ``(W_out, H_out, N*out_channels)``
``Conv3D``                 ``(W, H, N*C*depth)``               ``(W_out, H_out, N*out_channels*depth_out)``
=========================  ==================================  ====================================

(``ConvTransposed*`` use the same layouts.) `causal_conv` runs a depthwise `Conv1D` causally over
``[B, T, C]`` tokens with a decoding cache's last inputs in front (the recurrent mixers' and LFM2's
short convolutions). ``Data.array`` is ``(D, H, W)``, so for 2-D it is the
``[N, C, H, W]`` tensor with N and C merged, and for 3-D the ``[N, C, depth, H, W]`` tensor with
N, C and depth merged: ``Data.from_nchw(x)`` builds 2-D input, ``data.to_nchw(out_channels)``
reads the output back.

Channel rule: the number of input channels cannot be read from a `Data` (D mixes batch and
channels), so a convolution fed `Data` is told it: ``in_channels=C`` at construction. When
chaining convs, the next layer's ``in_channels`` is the previous layer's ``out_channels`` (pooling
and activations keep it). A layer compiled on `Data` without ``in_channels`` raises a `ShapeError`
naming itself. ``Conv3D`` also needs ``depth=`` (the input depth); its output depth is
``Conv3D.out_depth(depth)``.

Parameters use PyTorch names and layouts, so ``torch.nn.Conv2d`` state dicts load by name:
``weight`` ``[out_channels, in_channels/groups, *kernel]`` (transposed: ``[in_channels,
out_channels/groups, *kernel]``) and ``bias`` ``[out_channels]``. Initialisation as mlx.nn: weights
U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan-in ``in_channels/groups * prod(kernel)``, biases zero.

Constructor rule (as every metalnn layer): the sizes metalnn cannot infer are positional
(``out_channels``, ``kernel_size``), everything else is a keyword: mlx.nn's ``Conv2d(3, 16, 3)`` is
``Conv2D(16, 3)`` (or ``Conv2D(16, 3, in_channels=3)``).
"""

from __future__ import annotations

import mlx.core as mx

from .. import init as initializers
from ..data import Data, MTLSize
from ..functional import conv as Fconv
from .base import Layer
from .linear import float_dtype


def _tup(v, n, name, layer):
    vals = tuple(v) if isinstance(v, (list, tuple)) else (v,) * n
    if len(vals) != n or any(isinstance(x, bool) or not isinstance(x, int) for x in vals):
        raise ValueError(f"{layer}: {name} must be an int or a tuple of {n} ints, got {v!r}")
    return tuple(int(x) for x in vals)


class _ConvBase(Layer):
    _n = 2
    _transposed = False

    @staticmethod
    def positional_hint(a):  # mlx.nn's Conv2d(in_channels, out_channels, kernel_size)
        return (f"{a.cls}({a.kernel_size}, {a.extra[0]}, in_channels={a.out_channels}) for mlx.nn's "
                f"{a.cls[:-2]}{a.cls[-2:].lower()}({a.out_channels}, {a.kernel_size}, {a.extra[0]})")

    def __init__(self, out_channels: int, kernel_size, *, stride=1, padding=0, dilation=1, groups: int = 1,
                 bias: bool = True, in_channels: int | None = None, depth: int | None = None, output_padding=0,
                 init=None, bias_init=None, dtype=None):
        super().__init__()
        name = type(self).__name__
        n = self._n
        if isinstance(out_channels, bool) or not isinstance(out_channels, int) or out_channels < 1:
            raise ValueError(f"{name}: out_channels must be a positive int, got {out_channels!r}")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"{name}: groups must be a positive int, got {groups!r}")
        if output_padding != 0 and not self._transposed:
            raise TypeError(f"{name}: output_padding is an argument of the transposed convolutions")
        self.out_channels = int(out_channels)
        self.kernel_size = _tup(kernel_size, n, "kernel_size", name)
        self.stride = _tup(stride, n, "stride", name)
        self.padding = _tup(padding, n, "padding", name)
        self.dilation = _tup(dilation, n, "dilation", name)
        self.output_padding = _tup(output_padding, n, "output_padding", name)
        if any(k < 1 for k in self.kernel_size) or any(s < 1 for s in self.stride) \
                or any(d < 1 for d in self.dilation) or any(p < 0 for p in self.padding):
            raise ValueError(f"{name}: kernel_size, stride, dilation must be >= 1 and padding >= 0, got "
                             f"kernel_size={self.kernel_size}, stride={self.stride}, dilation={self.dilation}, "
                             f"padding={self.padding}")
        if self.out_channels % groups:
            raise ValueError(f"{name}: out_channels={out_channels} not divisible by groups={groups}")
        self.groups = int(groups)
        self.use_bias = bool(bias)
        self.in_channels = None
        self.depth = None if depth is None else int(depth)
        self.init = initializers.get(init, initializers.FanInUniform())
        self.bias_init = initializers.get(bias_init, initializers.Zeros())
        self._dtype = dtype
        if in_channels is not None:
            self._set_in_channels(in_channels)
            self._create(dtype or mx.float32, initializers.construction_key)
            self._built = True

    def _set_in_channels(self, c):
        name = type(self).__name__
        if isinstance(c, bool) or not isinstance(c, int) or c < 1 or c % self.groups:
            raise ValueError(f"{name}: in_channels must be a positive multiple of groups={self.groups}, got {c!r}")
        if self.in_channels is not None and self.in_channels != c:
            raise ValueError(f"{name}: built for in_channels={self.in_channels}, got an input with {c} channels")
        self.in_channels = int(c)

    # -- parameters --------------------------------------------------------------------------
    def _weight_shape(self):
        if self._transposed:
            return (self.in_channels, self.out_channels // self.groups, *self.kernel_size)
        return (self.out_channels, self.in_channels // self.groups, *self.kernel_size)

    def _create(self, dtype, next_key):
        shape = self._weight_shape()
        receptive = 1
        for k in self.kernel_size:
            receptive *= k
        fan_in = self.in_channels // self.groups * receptive  # mlx.nn's, for both directions
        fan_out = self.out_channels // self.groups * receptive
        self.weight = self.init(shape, fan_in, fan_out, next_key(), dtype)
        if self.use_bias:
            self.bias = self.bias_init((self.out_channels,), fan_in, fan_out, next_key(), dtype)

    def build(self, device, dims, dtype):
        self.require(self.in_channels is not None, "in_channels= given at construction", "in_channels=None",
                     "D mixes batch and channels; pass in_channels=<input channels> (for a chained conv: the "
                     "previous layer's out_channels), or call the layer on a channels-last array")
        if self._n == 3:
            self.require(self.depth is not None, "depth= given at construction (input depth of Conv3D)",
                         "depth=None")
        if "weight" not in self:
            self._create(self._dtype or float_dtype(dtype), device.next_key)

    # -- channels-last arrays ----------------------------------------------------------------
    def to_data(self, x):
        name = type(self).__name__
        if x.ndim != self._n + 2:
            layout = {1: "[N, L, C]", 2: "[N, H, W, C]", 3: "[N, D, H, W, C]"}[self._n]
            raise ValueError(f"{self._describe()}: expected a channels-last array {layout}, got shape "
                             f"{tuple(x.shape)}")
        self._set_in_channels(int(x.shape[-1]))
        if self._n == 3:
            if self.depth is None:
                self.depth = int(x.shape[1])
            elif self.depth != x.shape[1]:
                raise ValueError(f"{name}: built for depth={self.depth}, got an input of depth {x.shape[1]}")
        planar = mx.moveaxis(x, -1, 1)  # [N, C, *spatial]
        n, c = planar.shape[:2]
        rows = planar.reshape(n * c * (planar.shape[2] if self._n == 3 else 1), *planar.shape[-2:]) \
            if self._n > 1 else planar.reshape(n * c, 1, planar.shape[-1])
        return Data(rows)

    def from_data(self, out, x):
        n = x.shape[0]
        d = out.dims
        if self._n == 1:
            y = out.array.reshape(n, self.out_channels, d.W)
        elif self._n == 2:
            y = out.array.reshape(n, self.out_channels, d.H, d.W)
        else:
            y = out.array.reshape(n, self.out_channels, -1, d.H, d.W)
        return mx.moveaxis(y, 1, -1)

    # -- shapes ------------------------------------------------------------------------------
    def _out_spatial(self, spatial):
        if self._transposed:
            return tuple(Fconv.conv_transpose_output_size(s, k, st, p, op, d) for s, k, st, p, op, d in
                         zip(spatial, self.kernel_size, self.stride, self.padding, self.output_padding,
                             self.dilation))
        return tuple(Fconv.conv_output_size(s, k, st, p, d) for s, k, st, p, d in
                     zip(spatial, self.kernel_size, self.stride, self.padding, self.dilation))

    def out_depth(self, depth: int) -> int:
        """Output depth of a 3-D layer for input ``depth`` (the ``depth=`` of the next Conv3D)."""
        return self._out_spatial((depth,) + (1,) * (self._n - 1))[0] if self._n == 3 else 1

    def _to_tensor(self, data):
        d = data.dims
        c = self.in_channels
        if self._n == 1:
            self.require(d.H == 1, "dims (W=length, H=1, D=batch*channels)", f"{d}")
            per = c
        elif self._n == 2:
            per = c
        else:
            per = c * self.depth
        self.require(d.D % per == 0, f"D divisible by {'in_channels*depth' if self._n == 3 else 'in_channels'}="
                     f"{per}", f"D={d.D} ({d})")
        n = d.D // per
        x = data.array
        if self._n == 1:
            return x.reshape(n, c, d.W)
        if self._n == 2:
            return x.reshape(n, c, d.H, d.W)
        return x.reshape(n, c, self.depth, d.H, d.W)

    def forward(self, device, data):
        x = self._to_tensor(data)
        spatial = tuple(x.shape[2:])
        out = self._out_spatial(spatial)
        self.require(all(o >= 1 for o in out), f"input large enough for kernel {self.kernel_size} "
                     f"(stride {self.stride}, padding {self.padding}, dilation {self.dilation})",
                     f"spatial size {spatial} -> output {out}")
        bias = self.bias if self.use_bias else None
        w = self.weight
        if w.dtype != x.dtype and mx.issubdtype(x.dtype, mx.floating):
            x = x.astype(w.dtype)
        elif not mx.issubdtype(x.dtype, mx.floating):
            x = x.astype(w.dtype)
        if self._transposed:
            y = Fconv.conv_transpose_nd(self._n, x, w, bias, self.stride, self.padding, self.output_padding,
                                        self.dilation, self.groups, device=device, op=type(self).__name__)
        else:
            y = Fconv.conv_nd(self._n, x, w, bias, self.stride, self.padding, self.dilation, self.groups,
                              device=device, op=type(self).__name__)
        n, o = y.shape[:2]
        if self._n == 1:
            return Data(y.reshape(n * o, 1, out[0]), MTLSize(out[0], 1, n * o))
        if self._n == 2:
            return Data(y.reshape(n * o, out[0], out[1]), MTLSize(out[1], out[0], n * o))
        return Data(y.reshape(n * o * out[0], out[1], out[2]), MTLSize(out[2], out[1], n * o * out[0]))

    def _extra_repr(self):
        s = (f"in_channels={self.in_channels}, out_channels={self.out_channels}, kernel_size={self.kernel_size}, "
             f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, groups={self.groups}")
        if self._transposed:
            s += f", output_padding={self.output_padding}"
        return s + f", bias={self.use_bias}"


class Conv1D(_ConvBase):
    """1-D convolution: ``[N, L, C]`` arrays, or planar data ``(W=length, H=1, D=batch*channels)``.

    Args:
        out_channels: output channels.
        kernel_size, stride, padding, dilation: int or 1-tuple (PyTorch semantics, zero padding).
        groups: channel groups (``in_channels`` and ``out_channels`` divisible by it;
            ``groups=in_channels`` is a depthwise convolution).
        bias: learn a bias per output channel.
        in_channels: input channels (read from arrays; required for planar `Data`).
        init, bias_init, dtype: parameter initializers and dtype.
    Output: ``(W=L_out, H=1, D=batch*out_channels)``, ``L_out = (L + 2p - d(k-1) - 1) // s + 1``.
    """

    _n = 1


class Conv2D(_ConvBase):
    """2-D convolution: ``[N, H, W, C]`` arrays, or planar images ``(W, H, D=batch*channels)``.

    Args:
        out_channels: output channels.
        kernel_size, stride, padding, dilation: int or ``(h, w)`` (PyTorch semantics, zero padding).
        groups: channel groups (``in_channels`` and ``out_channels`` divisible by it).
        bias: learn a bias per output channel.
        in_channels: input channels (read from arrays; required for planar `Data`: for a chained
            conv, the previous layer's ``out_channels``).
        init, bias_init, dtype: parameter initializers and dtype.
    Output: ``(W_out, H_out, D=batch*out_channels)`` with ``out = (in + 2p - d(k-1) - 1) // s + 1``.
    Parameters: ``weight [out_channels, in_channels/groups, kh, kw]``, ``bias [out_channels]`` (as
    ``torch.nn.Conv2d``).
    """

    _n = 2


class Conv3D(_ConvBase):
    """3-D convolution: ``[N, D, H, W, C]`` arrays, or planar volumes ``(W, H, D=batch*channels*depth)``.

    Args: as `Conv2D` (3-tuples), plus ``depth``: the input depth (read from arrays; required for
    planar `Data`; the next Conv3D's ``depth`` is ``out_depth(depth)``).
    Output: ``(W_out, H_out, D=batch*out_channels*depth_out)``.
    """

    _n = 3


class ConvTransposed1D(_ConvBase):
    """1-D transposed convolution, layouts as `Conv1D`; ``weight [in_channels, out_channels/groups, k]``.

    ``output_padding`` (smaller than stride or dilation) adds to the output length
    ``(L-1)s - 2p + d(k-1) + output_padding + 1``.
    """

    _n = 1
    _transposed = True


class ConvTransposed2D(_ConvBase):
    """2-D transposed convolution (upsampling), layouts as `Conv2D`; weight
    ``[in_channels, out_channels/groups, kh, kw]``.

    Output size per axis: ``(in-1)*stride - 2*pad + dil*(k-1) + output_padding + 1``.
    """

    _n = 2
    _transposed = True


class ConvTransposed3D(_ConvBase):
    """3-D transposed convolution, layouts as `Conv3D` (planar `Data` needs ``in_channels`` and ``depth``)."""

    _n = 3
    _transposed = True


__all__ = ["Conv1D", "Conv2D", "Conv3D", "ConvTransposed1D", "ConvTransposed2D", "ConvTransposed3D"]


def causal_conv(layer, device, conv, x, cache, keep: int):
    """Causal convolution of tokens ``x`` ``[B, T, C]`` by ``conv`` (a depthwise `Conv1D` of width
    ``keep + 1``, a child of ``layer``) -> ``[B, T, C]``: the ``keep`` inputs before ``x`` are
    ``cache.conv_state`` ``[B, keep, C]`` (zeros without a cache or before its first call), and the
    cache's ``conv_state`` becomes the last ``keep`` inputs. No activation."""
    B, T, C = x.shape
    if cache is not None and cache.conv_state is not None:
        prev = cache.conv_state.astype(x.dtype)
    else:
        prev = mx.zeros((B, keep, C), x.dtype)
    xp = mx.concatenate([prev, x], axis=1) if keep else x                  # [B, keep + T, C]
    if cache is not None:
        cache.conv_state = xp[:, xp.shape[1] - keep:]
    return layer.compile_child_array(conv, device, xp)                     # [B, T, C] (no padding)

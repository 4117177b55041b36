"""Convolution layers: `Conv1D`, `Conv2D`, `Conv3D`, `ConvTransposed1D`, `ConvTransposed2D`, `ConvTransposed3D`.

Planar layout (the seed library's): channels are stacked along D, sample after sample.

=========================  ==================================  ====================================
layer                      input dims ``(W, H, D)``            output dims
=========================  ==================================  ====================================
``Conv1D``                 ``(L, 1, N*C)``                     ``(L_out, 1, N*filters)``
``Conv2D``                 ``(W, H, N*C)``                     ``(W_out, H_out, N*filters)``
``Conv3D``                 ``(W, H, N*C*depth)``               ``(W_out, H_out, N*filters*depth_out)``
=========================  ==================================  ====================================

(``ConvTransposed*`` use the same layouts.) ``Data.array`` is ``(D, H, W)``, so for 2-D it is the
``[N, C, H, W]`` tensor with N and C merged, and for 3-D the ``[N, C, depth, H, W]`` tensor with
N, C and depth merged: ``Data.from_nchw(x)`` builds 2-D input, ``data.to_nchw(filters)`` reads
the output back.

Channel rule: the number of input channels cannot be read from a `Data` (D mixes batch and
channels), so every convolution is told it: ``channels=C`` at construction. When chaining convs,
the next layer's ``channels`` is the previous layer's ``filters`` (pooling and activations keep
it). A layer built without ``channels`` raises a `ShapeError` naming itself. ``Conv3D`` also
needs ``depth=`` (the input depth); its output depth is ``Conv3D.out_depth(depth)``.

Parameters use PyTorch names and layouts, so ``torch.nn.Conv2d`` state dicts load by name:
``weight`` ``[filters, C/groups, *kernel]`` (transposed: ``[C, filters/groups, *kernel]``) and
``bias`` ``[filters]``. Weights are Kaiming-normal by default (fan-in ``C/groups * prod(kernel)``),
biases zero.
"""

from __future__ import annotations

import mlx.core as mx

from .. import init as initializers
from ..data import Data, MTLSize
from ..functional import conv as Fconv
from ..layer import Layer


def _tup(v, n, name, layer):
    vals = tuple(v) if isinstance(v, (list, tuple)) else (v,) * n
    if len(vals) != n or any(isinstance(x, bool) or not isinstance(x, int) for x in vals):
        raise ValueError(f"{layer}: {name} must be an int or a tuple of {n} ints, got {v!r}")
    return tuple(int(x) for x in vals)


class _ConvBase(Layer):
    _n = 2
    _transposed = False

    def __init__(self, filters: int, kernel_size, stride=1, padding=0, dilation=1, groups: int = 1,
                 bias: bool = True, channels: int | None = None, init="kaiming_normal", output_padding=0,
                 depth: int | None = None, seed: int | None = None, dtype=mx.float32):
        super().__init__()
        name = type(self).__name__
        n = self._n
        if isinstance(filters, bool) or not isinstance(filters, int) or filters < 1:
            raise ValueError(f"{name}: filters must be a positive int, got {filters!r}")
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
            raise ValueError(f"{name}: groups must be a positive int, got {groups!r}")
        self.filters = int(filters)
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
        if self.filters % groups:
            raise ValueError(f"{name}: filters={filters} not divisible by groups={groups}")
        if channels is not None and (channels < 1 or channels % groups):
            raise ValueError(f"{name}: channels must be a positive multiple of groups={groups}, got {channels}")
        self.groups = int(groups)
        self.use_bias = bias
        self.channels = None if channels is None else int(channels)
        self.depth = None if depth is None else int(depth)
        self.init = initializers.get(init)
        self.seed = seed
        self._dtype = dtype
        if self.channels is not None:
            self._create(self.channels, dtype, mx.random.key(seed or 0) if seed is not None else None)

    # -- parameters --------------------------------------------------------------------------
    def _weight_shape(self, channels):
        if self._transposed:
            return (channels, self.filters // self.groups, *self.kernel_size)
        return (self.filters, channels // self.groups, *self.kernel_size)

    def _create(self, channels, dtype, key):
        if key is None:
            return  # created on first compile with the device's key
        shape = self._weight_shape(channels)
        fan_in, fan_out = initializers.fans(shape)
        self.weight = self.init(shape, fan_in, fan_out, key, dtype)
        if self.use_bias:
            self.bias = mx.zeros((self.filters,), dtype=dtype)

    def build(self, device, dims, dtype):
        self.require(self.channels is not None, "channels= given at construction",
                     "channels=None", "D mixes batch and channels; pass channels=<input channels> "
                     "(for a chained conv: the previous layer's filters)")
        if self._n == 3:
            self.require(self.depth is not None, "depth= given at construction (input depth of Conv3D)",
                         "depth=None")
        if "weight" not in self:
            key = mx.random.key(self.seed) if self.seed is not None else device.next_key()
            dt = dtype if mx.issubdtype(dtype, mx.floating) else mx.float32
            self._create(self.channels, dt, key)

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
        c = self.channels
        if self._n == 1:
            self.require(d.H == 1, "dims (W=length, H=1, D=batch*channels)", f"{d}")
            per = c
        elif self._n == 2:
            per = c
        else:
            per = c * self.depth
        self.require(d.D % per == 0, f"D divisible by {'channels*depth' if self._n == 3 else 'channels'}={per}",
                     f"D={d.D} ({d})")
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
        s = (f"filters={self.filters}, kernel_size={self.kernel_size}, stride={self.stride}, "
             f"padding={self.padding}, dilation={self.dilation}, groups={self.groups}, channels={self.channels}")
        if self._transposed:
            s += f", output_padding={self.output_padding}"
        return s + f", bias={self.use_bias}"


class Conv1D(_ConvBase):
    """1-D convolution over planar data ``(W=length, H=1, D=batch*channels)``.

    Args:
        filters: output channels.
        kernel_size, stride, padding, dilation: int or 1-tuple (PyTorch semantics, zero padding).
        groups: channel groups (``channels`` and ``filters`` divisible by it).
        bias: learn a bias per filter.
        channels: input channels (required; see the module docstring).
        init: weight initializer (default Kaiming normal).
    Output: ``(W=L_out, H=1, D=batch*filters)``, ``L_out = (L + 2p - d(k-1) - 1) // s + 1``.
    """

    _n = 1


class Conv2D(_ConvBase):
    """2-D convolution over planar images ``(W, H, D=batch*channels)``.

    Args:
        filters: output channels.
        kernel_size, stride, padding, dilation: int or ``(h, w)`` (PyTorch semantics, zero padding).
        groups: channel groups (``channels`` and ``filters`` divisible by it).
        bias: learn a bias per filter.
        channels: input channels (required; for a chained conv, the previous layer's ``filters``).
        init: weight initializer (default Kaiming normal).
    Output: ``(W_out, H_out, D=batch*filters)`` with ``out = (in + 2p - d(k-1) - 1) // s + 1``.
    Parameters: ``weight [filters, channels/groups, kh, kw]``, ``bias [filters]`` (as ``torch.nn.Conv2d``).
    """

    _n = 2


class Conv3D(_ConvBase):
    """3-D convolution over planar volumes ``(W, H, D=batch*channels*depth)``.

    Args: as `Conv2D` (3-tuples), plus ``depth``: the input depth (required; the next Conv3D's
    ``depth`` is ``out_depth(depth)``).
    Output: ``(W_out, H_out, D=batch*filters*depth_out)``.
    """

    _n = 3


class ConvTransposed1D(_ConvBase):
    """1-D transposed convolution, layouts as `Conv1D`; ``weight [channels, filters/groups, k]``.

    ``output_padding`` (smaller than stride or dilation) adds to the output length
    ``(L-1)s - 2p + d(k-1) + output_padding + 1``.
    """

    _n = 1
    _transposed = True


class ConvTransposed2D(_ConvBase):
    """2-D transposed convolution (upsampling), layouts as `Conv2D`; weight ``[channels, filters/groups, kh, kw]``.

    Output size per axis: ``(in-1)*stride - 2*pad + dil*(k-1) + output_padding + 1``.
    """

    _n = 2
    _transposed = True


class ConvTransposed3D(_ConvBase):
    """3-D transposed convolution, layouts as `Conv3D` (needs ``channels`` and ``depth``)."""

    _n = 3
    _transposed = True


__all__ = ["Conv1D", "Conv2D", "Conv3D", "ConvTransposed1D", "ConvTransposed2D", "ConvTransposed3D"]

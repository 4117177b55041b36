"""Pooling layers on images: `MaxPool2D`, `AvgPool2D`, `GlobalAvgPool`.

Plain arrays are channels-last ``[N, H, W, C]`` (as mlx.nn's pooling takes them). `Data` is
planar, dims ``(W, H, D)``: every one of the D planes (``D = batch*channels``) is pooled on its
own, so pooling needs no channel count. Semantics follow ``torch.nn.MaxPool2d`` /
``torch.nn.AvgPool2d`` (``ceil_mode=False``): output ``(in + 2*pad - kernel) // stride + 1`` per
axis; max pooling pads with -inf, average pooling pads with zeros and counts them
(``count_include_pad=True``, PyTorch's default) unless ``count_include_pad=False``.
"""

from __future__ import annotations

import itertools

import mlx.core as mx

from ..data import Data, MTLSize
from .base import Layer


def _pair(v, name, layer):
    vals = tuple(v) if isinstance(v, (list, tuple)) else (v, v)
    if len(vals) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in vals):
        raise ValueError(f"{layer}: {name} must be an int or a pair of ints, got {v!r}")
    return tuple(int(x) for x in vals)


def _windows(x, kernel, stride, out, fill):
    """``x [D, Hp, Wp]`` (already padded) -> ``[kh*kw, D, Ho, Wo]`` window elements (row-major offsets)."""
    pieces = []
    for i, j in itertools.product(range(kernel[0]), range(kernel[1])):
        pieces.append(x[:, i:i + stride[0] * (out[0] - 1) + 1:stride[0], j:j + stride[1] * (out[1] - 1) + 1:stride[1]])
    return mx.stack(pieces, axis=0)


class _Image2D(Layer):
    """Plain-array calls on channels-last images ``[N, H, W, C]``."""

    def to_data(self, x):
        if x.ndim != 4:
            raise ValueError(f"{self._describe()}: expected a channels-last array [N, H, W, C], got shape "
                             f"{tuple(x.shape)}")
        return Data.from_nhwc(x)

    def from_data(self, out, x):
        return out.to_nhwc(out.dims.D // x.shape[0])  # planar D = batch * channels


class _Pool2D(_Image2D):
    positional_hint = "{cls}({kernel_size}, stride={extra[0]})"

    def __init__(self, kernel_size, *, stride=None, padding=0):
        super().__init__()
        name = type(self).__name__
        self.kernel_size = _pair(kernel_size, "kernel_size", name)
        self.stride = self.kernel_size if stride is None else _pair(stride, "stride", name)
        self.padding = _pair(padding, "padding", name)
        if any(k < 1 for k in self.kernel_size) or any(s < 1 for s in self.stride):
            raise ValueError(f"{name}: kernel_size and stride must be >= 1, got {self.kernel_size}, {self.stride}")
        if any(p < 0 or 2 * p > k for p, k in zip(self.padding, self.kernel_size)):
            raise ValueError(f"{name}: padding must be >= 0 and at most half the kernel size, got "
                             f"padding={self.padding}, kernel_size={self.kernel_size}")

    def _out(self, dims):
        return tuple((s + 2 * p - k) // st + 1 for s, p, k, st in
                     zip((dims.H, dims.W), self.padding, self.kernel_size, self.stride))

    def _prepare(self, data, fill):
        d = data.dims
        out = self._out(d)
        self.require(all(o >= 1 for o in out), f"H, W >= kernel {self.kernel_size} (after padding {self.padding})",
                     f"H={d.H}, W={d.W}")
        x = data.array
        ph, pw = self.padding
        if ph or pw:
            x = mx.pad(x, [(0, 0), (ph, ph), (pw, pw)], constant_values=fill)
        return x, out

    def _extra_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class MaxPool2D(_Pool2D):
    """Maximum over ``kernel_size`` windows of each plane (PyTorch ``MaxPool2d`` semantics).

    Args:
        kernel_size: int or ``(kh, kw)``.
        stride: default ``kernel_size``.
        padding: implicit -inf padding on both sides (at most half the kernel).
    Output dims ``(W_out, H_out, D)``. The gradient goes to the first maximum of each window
    (row-major), as in PyTorch.
    """

    def forward(self, device, data):
        x, out = self._prepare(data, -float("inf") if mx.issubdtype(data.dtype, mx.floating) else 0)
        kh, kw = self.kernel_size
        d = data.dims
        if (kh, kw) == self.stride and self.padding == (0, 0):
            # Non-overlapping windows: a reshape, no copies of the windows.
            x = x[:, :out[0] * kh, :out[1] * kw].reshape(d.D, out[0], kh, out[1], kw)
            x = x.transpose(0, 1, 3, 2, 4).reshape(d.D, out[0], out[1], kh * kw)
            axis = -1
        else:
            x = _windows(x, self.kernel_size, self.stride, out, None)
            axis = 0
        idx = mx.stop_gradient(mx.argmax(x, axis=axis, keepdims=True))
        y = mx.take_along_axis(x, idx, axis=axis).squeeze(axis)
        return Data(y, MTLSize(out[1], out[0], d.D))


class AvgPool2D(_Pool2D):
    """Mean over ``kernel_size`` windows of each plane (PyTorch ``AvgPool2d`` semantics).

    Args:
        kernel_size: int or ``(kh, kw)``.
        stride: default ``kernel_size``.
        padding: zero padding on both sides (at most half the kernel).
        count_include_pad: divide by the full window size (default, as PyTorch) or by the number
            of non-padding elements.
    """

    positional_hint = _Pool2D.positional_hint

    def __init__(self, kernel_size, *, stride=None, padding=0, count_include_pad: bool = True):
        super().__init__(kernel_size, stride=stride, padding=padding)
        self.count_include_pad = count_include_pad

    def forward(self, device, data):
        x, out = self._prepare(data, 0)
        d = data.dims
        kh, kw = self.kernel_size
        if (kh, kw) == self.stride and self.padding == (0, 0):
            x = x[:, :out[0] * kh, :out[1] * kw].reshape(d.D, out[0], kh, out[1], kw)
            y = x.sum(axis=(2, 4))
        else:
            y = _windows(x, self.kernel_size, self.stride, out, None).sum(axis=0)
        if self.count_include_pad or self.padding == (0, 0):
            y = y / (kh * kw)
        else:
            ones = mx.pad(mx.ones((1, d.H, d.W), dtype=y.dtype), [(0, 0), self.padding[:1] * 2, self.padding[1:] * 2])
            count = _windows(ones, self.kernel_size, self.stride, out, None).sum(axis=0)
            y = y / count
        return Data(y.astype(data.dtype) if mx.issubdtype(data.dtype, mx.floating) else y,
                    MTLSize(out[1], out[0], d.D))


class GlobalAvgPool(_Image2D):
    """Mean over each whole plane.

    A plain array ``[N, H, W, C]`` gives ``[N, C]``.

    Args:
        channels: with ``channels=C`` the output is ready for `Linear`: dims ``(W=C, H=1, D=batch)``
            (``D = batch*C`` on input). Without it the output is ``(W=1, H=1, D)``, one value per plane
            (read from the array on plain-array calls).
    """

    def __init__(self, *, channels: int | None = None):
        super().__init__()
        if channels is not None and channels < 1:
            raise ValueError(f"GlobalAvgPool: channels must be positive, got {channels}")
        self.channels = channels

    def forward(self, device, data):
        d = data.dims
        y = data.array.mean(axis=(1, 2))
        if self.channels is None:
            return Data(y, MTLSize(1, 1, d.D))
        self.require(d.D % self.channels == 0, f"D divisible by channels={self.channels}", f"D={d.D} ({d})")
        return Data(y, MTLSize(self.channels, 1, d.D // self.channels))

    def to_data(self, x):
        data = super().to_data(x)
        if self.channels is None:
            self.channels = int(x.shape[-1])
        return data

    def from_data(self, out, x):
        return out.to_array(2)

    def _extra_repr(self):
        return f"channels={self.channels}"


__all__ = ["MaxPool2D", "AvgPool2D", "GlobalAvgPool"]

"""`MTLSize` and `Data`: an MLX array together with its (W, H, D) dims.

metalnn keeps the layout of the Go library it descends from: W is the fastest axis (features or
image width), H the rows (sequence positions or image height), D the depth (batch, or batch x
channels for planar images). ``Data.array`` always has shape ``(D, H, W)``.

Plain arrays map onto it batch-first, as mlx.nn reads them: the last axis is W, the first is the
batch D, and a middle axis (sequence positions) is H. ``[F]`` -> ``(W=F, H=1, D=1)``, ``[B, F]`` ->
``(W=F, H=1, D=B)``, ``[B, T, F]`` -> ``(W=F, H=T, D=B)``. `Data.to_array` maps back.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx


class MTLSize(NamedTuple):
    """Dims of a `Data`: ``W`` fastest, then ``H``, then ``D``."""

    W: int
    H: int = 1
    D: int = 1

    @property
    def shape(self):
        """The matching MLX array shape ``(D, H, W)``."""
        return (self.D, self.H, self.W)

    @property
    def length(self):
        return self.W * self.H * self.D

    def __repr__(self):
        return f"MTLSize(W={self.W}, H={self.H}, D={self.D})"


class Data:
    """An ``mx.array`` shaped ``(D, H, W)`` plus its `MTLSize`.

    Args:
        array: an ``mx.array`` (or anything ``mx.array`` accepts), batch-first: ``[F]``, ``[B, F]``
            or ``[B, T, F]`` (see the module docstring).
        dims: optional `MTLSize`; when given, the array is reshaped to ``dims.shape`` (its number of
            elements must match).
    """

    __slots__ = ("array", "dims")

    def __init__(self, array, dims: MTLSize | tuple | None = None):
        if not isinstance(array, mx.array):
            array = mx.array(array)
        if dims is None:
            if array.ndim == 1:
                dims = MTLSize(array.shape[0], 1, 1)
            elif array.ndim == 2:
                dims = MTLSize(array.shape[1], 1, array.shape[0])
            elif array.ndim == 3:
                dims = MTLSize(array.shape[2], array.shape[1], array.shape[0])
            else:
                raise ValueError(f"Data: expected a 1-D, 2-D or 3-D array (or explicit dims), got shape "
                                 f"{tuple(array.shape)}; images: Data.from_nhwc / Data.from_nchw")
        else:
            dims = MTLSize(*dims)
            if dims.length != array.size:
                raise ValueError(f"Data: dims {dims} hold {dims.length} elements, array of shape "
                                 f"{tuple(array.shape)} has {array.size}")
        if tuple(array.shape) != dims.shape:
            array = array.reshape(dims.shape)
        self.array = array
        self.dims = dims

    # -- convenience -------------------------------------------------------------------------
    @property
    def dtype(self):
        return self.array.dtype

    @property
    def shape(self):
        return tuple(self.array.shape)

    def rows(self) -> mx.array:
        """The array as a ``[D*H, W]`` matrix (one row per position)."""
        return self.array.reshape(-1, self.dims.W)

    def to_array(self, ndim: int = 3) -> mx.array:
        """The array, batch-first, with ``ndim`` axes where the dims allow it.

        ``ndim=1`` gives ``[W]`` (when ``D == H == 1``), ``ndim=2`` gives ``[D, W]`` (when ``H == 1``);
        otherwise (and for ``ndim=3``) the full ``[D, H, W]``. The inverse of ``Data(array)``.
        """
        d = self.dims
        if ndim == 1 and d.D == 1 and d.H == 1:
            return self.array.reshape(d.W)
        if ndim == 2 and d.H == 1:
            return self.array.reshape(d.D, d.W)
        return self.array

    def reshape(self, dims) -> "Data":
        """Same elements viewed with other dims (no copy in the graph)."""
        return Data(self.array, MTLSize(*dims))

    def __repr__(self):
        return f"Data({self.dims}, dtype={self.array.dtype})"

    # -- image layouts -----------------------------------------------------------------------
    @classmethod
    def from_nchw(cls, x) -> "Data":
        """Planar image batch ``[N, C, H, W]`` -> Data with ``D = N * C``."""
        x = x if isinstance(x, mx.array) else mx.array(x)
        if x.ndim != 4:
            raise ValueError(f"Data.from_nchw: expected [N, C, H, W], got shape {tuple(x.shape)}")
        n, c, h, w = x.shape
        return cls(x.reshape(n * c, h, w), MTLSize(w, h, n * c))

    @classmethod
    def from_nhwc(cls, x) -> "Data":
        """Channels-last image batch ``[N, H, W, C]`` -> planar Data with ``D = N * C``."""
        x = x if isinstance(x, mx.array) else mx.array(x)
        if x.ndim != 4:
            raise ValueError(f"Data.from_nhwc: expected [N, H, W, C], got shape {tuple(x.shape)}")
        return cls.from_nchw(x.transpose(0, 3, 1, 2))

    def to_nchw(self, channels: int) -> mx.array:
        """Planar Data (``D = N * channels``) -> ``[N, C, H, W]``."""
        d, h, w = self.shape
        if channels <= 0 or d % channels:
            raise ValueError(f"Data.to_nchw: depth {d} is not a multiple of channels={channels}")
        return self.array.reshape(d // channels, channels, h, w)

    def to_nhwc(self, channels: int) -> mx.array:
        """Planar Data (``D = N * channels``) -> ``[N, H, W, C]``."""
        return self.to_nchw(channels).transpose(0, 2, 3, 1)

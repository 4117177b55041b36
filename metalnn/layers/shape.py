"""Layers that only change how data is viewed: `Reshape`, `Flatten`, `Identity`."""

from __future__ import annotations

from ..data import Data, MTLSize
from .base import Layer


class Identity(Layer):
    """Returns its input unchanged."""

    def forward(self, device, data):
        return data


class Reshape(Layer):
    """View the input with other dims (same number of elements; gradients pass unchanged).

    Args:
        dims: the output `MTLSize` (or a ``(W, H, D)`` tuple). One entry may be ``-1``: it is inferred.
    """

    def __init__(self, dims):
        super().__init__()
        self.target = tuple(int(v) for v in dims) + (1,) * (3 - len(tuple(dims)))

    def _resolve(self, dims):
        target = list(self.target)
        if target.count(-1) > 1:
            raise ValueError(f"{self._describe()}: at most one -1 in {self.target}")
        if -1 in target:
            known = 1
            for v in target:
                if v != -1:
                    known *= v
            self.require(known > 0 and dims.length % known == 0, f"a size divisible by {known}",
                         f"{dims} ({dims.length} elements)")
            target[target.index(-1)] = dims.length // known
        out = MTLSize(*target)
        self.require(out.length == dims.length, f"{out.length} elements ({out})",
                     f"{dims.length} elements ({dims})")
        return out

    def forward(self, device, data):
        return data.reshape(self._resolve(data.dims))


class Flatten(Layer):
    """Fold each sample into one row: ``(W, H, D)`` -> ``(W*H*per_sample, 1, batch)``.

    A plain array ``[B, ...]`` gives ``[B, prod(...)]`` (row-major, as ``mx.flatten(x, 1)``).

    Args:
        channels: for planar images (``D = batch x channels``) the number of channels per sample,
            so the output has ``D = batch`` and ``W = C*H*W`` in channel-major order (PyTorch's
            flatten of NCHW). Default 1 (D is the batch).
    """

    def __init__(self, *, channels: int = 1):
        super().__init__()
        if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
            raise ValueError(f"Flatten: channels must be a positive int, got {channels!r}")
        self.channels = int(channels)

    def to_data(self, x):
        if x.ndim > 3:
            x = x.reshape(x.shape[0], -1)
        return Data(x)

    def from_data(self, out, x):
        return out.to_array(2)

    def forward(self, device, data):
        d = data.dims
        self.require(d.D % self.channels == 0, f"depth divisible by channels={self.channels}", f"D={d.D}")
        batch = d.D // self.channels
        return data.reshape(MTLSize(d.W * d.H * self.channels, 1, batch))

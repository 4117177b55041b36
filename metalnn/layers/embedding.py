"""`Embedding`: token ids in, vectors out."""

from __future__ import annotations

import math

import mlx.core as mx

from .. import init as initializers
from ..data import Data, MTLSize
from .base import Layer


class TokenLookup:
    """What token tables share (`Embedding`, `QuantizedEmbedding`, `GGMLEmbedding`): ids in, rows out.

    A subclass implements ``lookup(ids)``: ``ids`` ``[N, T]`` integers -> ``[N, T, dims]`` rows. Ids of
    dims ``(W=T, H, D)`` give ``(W=dims, H=T, D=H*D)``; a plain ``[B, T]`` (or ``[T]``) array gives
    ``[B, T, dims]`` (``[T, dims]``)."""

    def forward(self, device, data):
        ids = data.array
        if not mx.issubdtype(ids.dtype, mx.integer):
            ids = ids.astype(mx.int32)
        d = data.dims
        batch = d.H * d.D
        return Data(self.lookup(ids.reshape(batch, d.W)), MTLSize(self.dims, d.W, batch))

    def to_data(self, x):
        if x.ndim not in (1, 2):
            raise ValueError(f"{self._describe()}: token ids must be [T] or [B, T], got shape {tuple(x.shape)}")
        return Data(x.reshape(-1, x.shape[-1]))

    def from_data(self, out, x):
        return out.array.reshape(*x.shape, self.dims)


class Embedding(TokenLookup, Layer):
    """Look up rows of a ``[num_embeddings, dims]`` table (as ``mlx.nn.Embedding``).

    Input: token ids (integers, or floats holding integers). A plain array ``[B, T]`` (or ``[T]``)
    gives ``[B, T, dims]`` (``[T, dims]``). As `Data`, ids of dims ``(W=T, H, D)`` give
    ``(W=dims, H=T, D=H*D)``: each row of ids is one sequence.

    Args:
        num_embeddings: number of rows (the vocabulary size).
        dims: vector width.
        init: table initializer (default N(0, 1/dims), as mlx.nn).
        dtype: table dtype (default float32).
    """

    positional_hint = "{cls}({num_embeddings}, {dims}, init=...)"

    def __init__(self, num_embeddings: int, dims: int, *, init=None, dtype=None):
        super().__init__()
        for name, v in (("num_embeddings", num_embeddings), ("dims", dims)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Embedding: {name} must be a positive int, got {v!r}")
        self.num_embeddings, self.dims = int(num_embeddings), int(dims)
        init = initializers.get(init, initializers.Normal(math.sqrt(1.0 / self.dims)))
        self.weight = init((self.num_embeddings, self.dims), self.dims, self.num_embeddings,
                           initializers.construction_key(), dtype or mx.float32)
        self._built = True

    def lookup(self, ids):
        return self.weight[ids]

    def as_linear(self, x, *, device=None):
        """``x @ weight.T``: use the table as an output projection (tied embeddings). ``device`` is
        accepted for symmetry with `QuantizedEmbedding.as_linear` (a float product has one form)."""
        return x @ self.weight.T

    def _extra_repr(self):
        return f"{self.num_embeddings}, {self.dims}"

"""`Embeddings`: token ids in, vectors out."""

from __future__ import annotations

import mlx.core as mx

from .. import init as initializers
from ..data import Data, MTLSize
from ..layer import Layer


class Embeddings(Layer):
    """Look up rows of a ``[vocab_size, dim]`` table.

    Input: token ids (integers, or floats holding integers) with dims ``(W=T, H=B, D=1)`` — the
    natural dims of a ``[B, T]`` array — or ``(W=T, H=1, D=B)``. Output: ``(W=dim, H=T, D=B)``.

    Args:
        vocab_size: number of rows.
        dim: vector width.
        init: table initializer (default N(0, 1), as ``torch.nn.Embedding``).
    """

    def __init__(self, vocab_size: int, dim: int, init="normal_1", dtype=mx.float32):
        super().__init__()
        self.vocab_size, self.dim = int(vocab_size), int(dim)
        init = initializers.Normal(1.0) if init == "normal_1" else initializers.get(init)
        self.init = init
        self._dtype = dtype
        self._created = False

    def build(self, device, dims, dtype):
        if "weight" not in self:
            self.weight = self.init((self.vocab_size, self.dim), self.vocab_size, self.dim, device.next_key(),
                                    self._dtype)

    def forward(self, device, data):
        ids = data.array
        if not mx.issubdtype(ids.dtype, mx.integer):
            ids = ids.astype(mx.int32)
        d = data.dims
        batch = d.H * d.D
        ids = ids.reshape(batch, d.W)
        y = self.weight[ids]
        return Data(y, MTLSize(self.dim, d.W, batch))

    def as_linear(self, x):
        """``x @ weight.T``: use the table as an output projection (tied embeddings)."""
        return x @ self.weight.T

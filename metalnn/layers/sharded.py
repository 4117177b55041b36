"""Tensor-parallel pieces over an ``mx.distributed`` group (inference): linears, embeddings, output
heads and mixture-of-experts blocks whose parameters are split across the ranks of the group.

The layers keep their own classes and parameter names (a `Linear`, `QuantizedLinear` or
`GGMLLinear` holds a slice of the checkpoint's tensor under the same name), so a rank loads its
slice by name; what changes is the slice and, where the ranks' partial results must be combined, the
class (a subclass adding the communication):

* all-to-sharded (q/k/v, gate/up): the layer keeps a contiguous run of its output rows
  (`shard_rows`); no communication (each rank computes its own heads / hidden columns);
* sharded-to-all (o_proj, down_proj): the layer keeps the matching run of input columns
  (`shard_columns`) and becomes `ShardedToAll`: ``all_sum`` of the partial products. Its bias is
  added once (the loader gives rank 0 the bias and the other ranks zeros);
* the token table and the output head split by vocabulary rows (`VocabShardedLookup`,
  `VocabShardedHead`): a rank looks up the ids in its run (zeros elsewhere) and the rows are summed
  over the group; the head's logits are placed at the rank's columns of a zero ``[..., vocab]`` and
  summed (adding zeros is exact, so every rank gets the whole logits bit for bit);
* `ShardedSparseMoE`: every expert keeps a run of its hidden columns on every rank (``gate_up_proj``
  rows, ``down_proj`` columns), as the shared expert; the router is whole on every rank, so all
  ranks route alike, and the block's output is summed over the group once.

Column runs honour the layer's unit (1 for float weights, the group size of MLX-quantized weights,
the block of a GGML type): `split` refuses widths that are not whole units.
"""

from __future__ import annotations

import mlx.core as mx

from ..data import Data, MTLSize
from ..errors import UnsupportedConfigError
from .embedding import Embedding
from .ggml import GGMLEmbedding, GGMLLinear
from .linear import Linear
from .moe import SparseMoE, SwitchGLU
from .quantized import QuantizedEmbedding, QuantizedLinear

__all__ = ["split", "column_unit", "shard_rows", "shard_columns", "ShardedToAll", "VocabShardedLookup",
           "VocabShardedHead", "ShardedSparseMoE", "make_sharded", "LINEARS", "take"]

#: the linear layers whose weights can be split
LINEARS = (Linear, QuantizedLinear, GGMLLinear)


def split(n: int, parts: int, unit: int = 1, what: str = "width") -> list:
    """``parts`` contiguous ``(start, end)`` runs covering ``range(n)``, as even as whole ``unit`` s allow
    (the first runs take the remainder).

    Raises:
        UnsupportedConfigError: ``n`` not a multiple of ``unit``, or fewer units than parts.
    """
    if n % unit or n // unit < parts:
        raise UnsupportedConfigError(f"{what} {n} cannot be split over {parts} ranks in whole units of {unit}")
    units = n // unit
    base, extra = divmod(units, parts)
    out, start = [], 0
    for r in range(parts):
        size = (base + (r < extra)) * unit
        out.append((start, start + size))
        start += size
    return out


def take(a, start: int, end: int, axis: int = 0):
    """A copy of ``a``'s entries ``[start, end)`` along ``axis`` (a gather, not a view, so the whole
    tensor it comes from can be freed), evaluated."""
    out = mx.take(a, mx.arange(start, end, dtype=mx.int32), axis=axis)
    mx.eval(out)
    return out


def column_unit(layer) -> int:
    """The smallest run of input columns ``layer``'s weight splits into: 1 (float), the group size
    (MLX-quantized) or the GGML type's block."""
    if isinstance(layer, QuantizedLinear):
        return layer.group_size
    if isinstance(layer, GGMLLinear):
        return layer.qtype.block_size
    return 1


def _column_bytes(layer, cols: int) -> int:
    """The packed width (last axis of ``weight``) of ``cols`` input columns."""
    if isinstance(layer, QuantizedLinear):
        return cols * layer.bits // 32
    if isinstance(layer, GGMLLinear):
        return layer.qtype.row_bytes(cols)
    return cols


def shard_rows(layer, start: int, end: int) -> dict:
    """Keep output rows ``[start, end)`` of a linear layer (its parameters become lazy slices of the
    right shape, replaced when the rank's weights load). Returns ``{parameter name: (axis, start,
    end)}``: the slice of each checkpoint tensor."""
    if not isinstance(layer, LINEARS):
        raise UnsupportedConfigError(f"{layer._describe()}: {type(layer).__name__} cannot be split by rows")
    cuts = {}
    for key in ("weight", "scales", "biases", "bias"):
        if key in layer:
            layer[key] = layer[key][start:end]
            cuts[key] = (0, start, end)
    layer.out_features = end - start
    return cuts


def shard_columns(layer, start: int, end: int) -> dict:
    """Keep input columns ``[start, end)`` (whole units of `column_unit`) of a linear layer; the bias
    stays whole. Returns the tensors' slices as `shard_rows`."""
    if not isinstance(layer, LINEARS):
        raise UnsupportedConfigError(f"{layer._describe()}: {type(layer).__name__} cannot be split by columns")
    unit = column_unit(layer)
    if start % unit or end % unit:
        raise UnsupportedConfigError(f"{layer._describe()}: columns [{start}, {end}) are not whole units of {unit}")
    a, b = _column_bytes(layer, start), _column_bytes(layer, end)
    cuts = {"weight": (1, a, b)}
    layer["weight"] = layer["weight"][:, a:b]
    for key in ("scales", "biases"):
        if key in layer:
            g = layer.group_size
            layer[key] = layer[key][:, start // g:end // g]
            cuts[key] = (1, start // g, end // g)
    if isinstance(layer, (Linear, GGMLLinear)):
        layer.in_features = end - start
    layer.mark_built(MTLSize(end - start))
    return cuts


def _all_sum(x, group):
    return mx.distributed.all_sum(x, group=group)


class ShardedToAll:
    """Mixin of a linear layer holding a run of its input columns: the output is the sum over the
    group of the ranks' partial products (``all_sum``). See the module docstring for the bias."""

    def forward(self, device, data):
        out = super().forward(device, data)
        return Data(_all_sum(out.array, self.group), out.dims)


class VocabShardedLookup:
    """Mixin of a token table holding rows ``[vocab_start, vocab_end)``: ids outside the run give zero
    rows, and the rows are summed over the group. `as_linear` (a tied head) gives the whole logits
    as `VocabShardedHead`."""

    def lookup(self, ids):
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = super().lookup(mx.where(inside, local, 0))
        rows = mx.where(inside[..., None], rows, mx.zeros((), rows.dtype))
        return _all_sum(rows, self.group)

    def as_linear(self, x, *, device=None):
        return _place(super().as_linear(x, device=device), self.vocab_start, self.vocab_size, self.group)


class VocabShardedHead:
    """Mixin of an output projection holding vocabulary rows ``[vocab_start, vocab_start + out)``:
    every rank gets the whole logits (its columns placed in zeros, summed over the group)."""

    def forward(self, device, data):
        out = super().forward(device, data)
        d = out.dims
        return Data(_place(out.array, self.vocab_start, self.vocab_size, self.group), MTLSize(self.vocab_size, d.H, d.D))


def _place(part, start: int, total: int, group):
    """``part`` ``[..., n]`` at columns ``[start, start + n)`` of zeros ``[..., total]``, summed over the group."""
    n = part.shape[-1]
    pieces = []
    if start:
        pieces.append(mx.zeros(part.shape[:-1] + (start,), part.dtype))
    pieces.append(part)
    if total - start - n:
        pieces.append(mx.zeros(part.shape[:-1] + (total - start - n,), part.dtype))
    full = mx.concatenate(pieces, axis=-1) if len(pieces) > 1 else part
    return _all_sum(full, group)


class ShardedSparseMoE(SparseMoE):
    """A `SparseMoE` whose experts (and shared expert) hold a run of their hidden columns: the block's
    partial output is summed over the group (see the module docstring)."""

    def forward(self, device, data):
        out = super().forward(device, data)
        return Data(_all_sum(out.array, self.group), out.dims)


def shard_switch(experts: SwitchGLU, start: int, end: int) -> dict:
    """Keep hidden columns ``[start, end)`` of every expert of a `SwitchGLU` (``gate_up_proj`` gate rows
    and up rows, ``down_proj`` columns). Returns ``{parameter: function(full tensor) -> slice}``."""
    if type(experts) is not SwitchGLU:
        raise UnsupportedConfigError(f"{experts._describe()}: tensor parallelism splits SwitchGLU experts only, "
                                     f"got {type(experts).__name__}")
    h = experts.hidden_dims
    experts["gate_up_proj"] = mx.concatenate([experts["gate_up_proj"][:, start:end],
                                              experts["gate_up_proj"][:, h + start:h + end]], axis=1)
    experts["down_proj"] = experts["down_proj"][:, :, start:end]
    experts.hidden_dims = end - start

    def gate_up(a):
        out = mx.concatenate([a[:, start:end], a[:, h + start:h + end]], axis=1)
        mx.eval(out)
        return out

    return {"gate_up_proj": gate_up, "down_proj": lambda a: take(a, start, end, axis=2)}


_CLASSES: dict = {}


def make_sharded(layer, mixin, group, **attrs):
    """Turn ``layer`` (in place) into the subclass of its class with ``mixin`` in front, holding
    ``group`` and ``attrs`` (a `ShardedToAll` `QuantizedLinear`, ...)."""
    cls = type(layer)
    key = (mixin, cls)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {"__module__": __name__})
    layer.__class__ = _CLASSES[key]
    object.__setattr__(layer, "group", group)
    for k, v in attrs.items():
        object.__setattr__(layer, k, v)
    return layer


#: the token tables `VocabShardedLookup` splits
TABLES = (Embedding, QuantizedEmbedding, GGMLEmbedding)

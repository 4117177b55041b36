"""`StateCache`: the decoding state of a recurrent token mixer (Gated DeltaNet, short convolutions,
state-space layers): a few fixed-size arrays per sequence, stacked by row (``[B, ...]``), whatever
the sequence's length.

Unlike a `KVCache` it cannot be cut back to an earlier position: a state holds exactly the tokens
it has seen (``offset`` of them). Rows of a batch stack and split along axis 0 (`merge`, `take`),
which is all the batching server (`metalnn.layers.batch_cache`) and the prefix cache
(`metalnn.llm.prefix_cache`) need. A subclass names its arrays in ``fields``::

    class GatedDeltaCache(StateCache):
        fields = ("conv_state", "recurrent_state")

and is found again by its class name when a saved prefix is read back (`StateCache.kind`).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

__all__ = ["StateCache"]


class StateCache:
    """Fixed-size per-sequence arrays named by ``fields`` (each None until the first tokens), and
    ``offset``, the number of tokens they hold."""

    fields: tuple = ()
    _kinds: dict = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        clash = [name for name in cls.fields if hasattr(StateCache, name) or name == "offset"]
        if clash:
            raise TypeError(f"{cls.__name__}.fields: {clash} would hide StateCache's own attributes")
        StateCache._kinds[cls.__name__] = cls

    def __init__(self):
        for name in self.fields:
            setattr(self, name, None)
        self.offset = 0

    @classmethod
    def kind(cls, name: str) -> type:
        """The subclass called ``name`` (KeyError naming the known ones otherwise)."""
        try:
            return StateCache._kinds[name]
        except KeyError:
            raise KeyError(f"unknown state cache kind {name!r}; known: {sorted(StateCache._kinds)}") from None

    def reset(self):
        for name in self.fields:
            setattr(self, name, None)
        self.offset = 0

    @property
    def filled(self) -> bool:
        """Whether the state holds tokens (every field set)."""
        return all(getattr(self, name) is not None for name in self.fields)

    @property
    def state(self) -> list:
        """The arrays that are set (for ``mx.eval``)."""
        return [a for a in (getattr(self, name) for name in self.fields) if a is not None]

    def arrays(self) -> dict:
        """``{field: array}`` of the set fields."""
        return {name: getattr(self, name) for name in self.fields if getattr(self, name) is not None}

    @classmethod
    def from_arrays(cls, arrays: dict, offset: int, copy: bool = False):
        """A cache of ``cls`` holding ``arrays`` (``{field: array}``) after ``offset`` tokens; with
        ``copy`` each array is a new object (MLX's in-place writes change the object they are made
        through, so caches kept apart must never share one)."""
        out = cls()
        for name in cls.fields:
            a = arrays.get(name)
            setattr(out, name, mx.array(a) if copy and a is not None else a)
        out.offset = int(offset)
        return out

    def copy(self, offset: int | None = None):
        """An independent copy (``offset`` replaced when given)."""
        return type(self).from_arrays(self.arrays(), self.offset if offset is None else offset, copy=True)

    @classmethod
    def merge(cls, caches: Sequence[StateCache]):
        """One cache holding the rows of ``caches`` in order (empty ones contribute no rows)."""
        live = [c for c in caches if c.filled]
        out = cls()
        if live:
            for name in cls.fields:
                parts = [getattr(c, name) for c in live]
                setattr(out, name, mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0])
            out.offset = max(c.offset for c in live)
        return out

    def take(self, rows: mx.array):
        """A cache holding only ``rows`` (int32 ``[R]``) of this one, in that order."""
        out = type(self)()
        if self.filled:
            for name in self.fields:
                setattr(out, name, getattr(self, name)[rows])
            out.offset = self.offset
        return out

    def __repr__(self):
        return f"{type(self).__name__}(offset={self.offset})"

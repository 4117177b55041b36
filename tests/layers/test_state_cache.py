"""`StateCache`: rows stack and split along axis 0, copies are independent, subclasses are found by
name, and a prefix cache saves and reads back any subclass's arrays."""

import mlx.core as mx
import numpy as np
import pytest

from metalnn.layers import GatedDeltaCache, StateCache
from metalnn.layers.batch_cache import keep_rows, merge_rows
from metalnn.llm.prefix_cache import PrefixCache


class TwoStates(StateCache):
    fields = ("tail", "ssm")


def filled(rows, offset, seed):
    rng = np.random.default_rng(seed)
    return TwoStates.from_arrays({"tail": mx.array(rng.normal(size=(rows, 3, 4)).astype(np.float32)),
                                  "ssm": mx.array(rng.normal(size=(rows, 2, 5)).astype(np.float32))}, offset)


def test_merge_and_take_stack_and_split_rows():
    a, b = filled(1, 7, 0), filled(2, 4, 1)
    both = TwoStates.merge([a, b, TwoStates()])  # an empty cache adds no rows
    assert both.state[0].shape == (3, 3, 4) and both.offset == 7
    np.testing.assert_array_equal(np.array(both.state[1][1:]), np.array(b.state[1]))
    picked = both.take(mx.array([2, 0], dtype=mx.int32))
    np.testing.assert_array_equal(np.array(picked.tail[0]), np.array(b.tail[1]))
    np.testing.assert_array_equal(np.array(picked.tail[1]), np.array(a.tail[0]))
    with pytest.raises(TypeError, match=r"fields: \['state'\] would hide"):
        type("Bad", (StateCache,), {"fields": ("state",)})
    assert not TwoStates().take(mx.array([0], dtype=mx.int32)).filled


def test_merge_rows_and_keep_rows_take_any_subclass():
    merged = merge_rows([[filled(1, 3, 0)], [filled(1, 5, 1)]])
    assert type(merged[0]) is TwoStates and merged[0].tail.shape[0] == 2
    kept = keep_rows(merged, [1])
    np.testing.assert_array_equal(np.array(kept[0].ssm), np.array(merged[0].ssm[1:]))
    with pytest.raises(TypeError, match="mixes cache types"):
        merge_rows([[filled(1, 3, 0)], [GatedDeltaCache()]])


def test_copy_is_independent_and_kinds_are_found_by_name():
    a = filled(1, 3, 0)
    c = a.copy(offset=2)
    c.tail[0, 0, 0] = 99.0
    assert c.offset == 2 and float(a.tail[0, 0, 0]) != 99.0
    assert StateCache.kind("TwoStates") is TwoStates and StateCache.kind("GatedDeltaCache") is GatedDeltaCache
    with pytest.raises(KeyError, match="unknown state cache kind 'Nope'"):
        StateCache.kind("Nope")


def test_prefix_cache_saves_and_reads_back_a_subclass(tmp_path):
    cache = PrefixCache(max_bytes=1 << 20, min_tokens=1)
    tokens = [1, 2, 3, 4]
    assert cache.store(tokens, [filled(1, 4, 3)])
    assert cache.save(tmp_path) == 1
    back = PrefixCache(max_bytes=1 << 20, min_tokens=1)
    assert back.load(tmp_path) == 1
    entry = next(iter(back._entries.values()))
    assert type(entry.caches[0]) is TwoStates and entry.caches[0].offset == 4
    for got, want in zip(entry.caches[0].state, filled(1, 4, 3).state):
        np.testing.assert_array_equal(np.array(got), np.array(want))

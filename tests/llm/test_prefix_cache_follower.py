"""A follower `PrefixCache` (``follower=True``) repeating a budgeted one's removals (``evicted`` /
``drop``), as the ranks of a split model's server keep rank 0's entries: after the same stores, and
the leader's removals dropped before each lookup, both hold the same keys in the same order and
every lookup finds the same match, although the follower's arrays are of another size (a rank with
other blocks)."""

import mlx.core as mx
import numpy as np

from metalnn.layers.attention import KVCache
from metalnn.llm.prefix_cache import PrefixCache


def caches(tokens, width):
    """Two layers' caches holding ``tokens`` positions, ``width`` values a position."""
    out = []
    for _ in range(2):
        c = KVCache()
        c.keys = mx.ones((1, 1, len(tokens), width))
        c.values = mx.ones((1, 1, len(tokens), width))
        c.offset = len(tokens)
        out.append(c)
    return out


def test_a_follower_keeps_the_leaders_entries():
    rng = np.random.default_rng(0)
    # 4 bytes x 8 values x 2 arrays x 2 layers = 128 bytes a position: room for ~40 positions
    leader = PrefixCache(max_bytes=128 * 40, min_tokens=4)
    leader.evicted = []
    follower = PrefixCache(max_bytes=1, min_tokens=4, follower=True)  # the budget is not the follower's to apply
    conversations = [rng.integers(0, 50, 6).tolist() for _ in range(5)]
    removed = refused = 0
    for step in range(40):
        conv = conversations[rng.integers(len(conversations))]
        if step % 2:  # a turn: the conversation grows, and its longer entry replaces the shorter
            conv += rng.integers(0, 50, int(rng.integers(1, 8))).tolist()
        tokens = list(conv) if step % 13 else rng.integers(0, 50, 60).tolist()  # now and then one too large
        a, b = leader.lookup(tokens), follower.lookup(tokens)
        assert (a is None) == (b is None) and (a is None or a[0] == b[0]), step
        kept = leader.store(tokens, caches(tokens, 8))
        follower.store(tokens, caches(tokens, 3))
        refused += not kept
        removed += len(leader.evicted) - (not kept)
        follower.drop(leader.evicted)  # before the next lookup, as the next step's message brings it
        leader.evicted = []
        assert list(follower._entries) == list(leader._entries), step
        assert leader.nbytes <= leader.max_bytes
    assert refused >= 3 and removed >= 10, (refused, removed)  # both kinds of removal happened, often


def test_a_leader_records_nothing_without_a_list():
    cache = PrefixCache(max_bytes=0, min_tokens=1)
    assert cache.evicted is None
    assert not cache.store([1, 2], caches([1, 2], 4))  # refused, and nothing to record into
    cache.drop([(None, 1, 2)])  # dropping a key that is not kept is no error
    assert len(cache) == 0

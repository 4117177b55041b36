"""Where a model's parameters go in a distributed run: the owner of a parameter name (its block, or
the module of a top-level parameter) and the balanced contiguous split of blocks over ranks."""

from __future__ import annotations

import re

_BLOCK = re.compile(r"^(.*?\blayers\.\d+)\.")


def owner(name: str) -> str:
    """The unit a parameter (or checkpoint tensor, under the model's names) belongs to: its block
    (``model.layers.3``) or, outside the blocks, its module (``model.embed_tokens``, ``lm_head``)."""
    m = _BLOCK.match(name)
    if m:
        return m.group(1)
    return name.rpartition(".")[0]


def balance(blocks: list, parts: int, *, first: int = 0, last: int = 0) -> list:
    """``parts`` contiguous runs ``(start, end)`` of the blocks, each non-empty, that minimise the
    largest part's bytes: ``blocks[i]`` bytes per block, ``first`` more on the first part, ``last``
    more on the last (exact, by dynamic programming over the split points)."""
    n = len(blocks)
    if not 0 < parts <= n:
        raise ValueError(f"balance: {parts} parts for {n} blocks")
    prefix = [0]
    for b in blocks:
        prefix.append(prefix[-1] + b)
    inf = float("inf")
    # best[p][i]: the smallest largest part of blocks[:i] in p parts; cut[p][i]: where the last part starts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for p in range(1, parts + 1):
        for i in range(p, n - (parts - p) + 1):
            for j in range(p - 1, i):
                if best[p - 1][j] == inf:
                    continue
                part = prefix[i] - prefix[j] + (first if p == 1 else 0) + (last if p == parts else 0)
                cost = max(best[p - 1][j], part)
                if cost < best[p][i]:
                    best[p][i], cut[p][i] = cost, j
    runs, i = [], n
    for p in range(parts, 0, -1):
        j = cut[p][i]
        runs.append((j, i))
        i = j
    return runs[::-1]

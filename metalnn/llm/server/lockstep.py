"""Serving a model split over ``mlx.launch`` ranks: rank 0 talks to users, every rank runs the batch.

A split model (`metalnn.llm.distributed`: pipeline or tensor parallel) runs a forward pass only when
every rank of its group calls it with the same shapes and the same caches. Rank 0 runs the HTTP server
and its `metalnn.llm.server.worker.GenerationWorker` as for one process; the other ranks run
`follow`, which keeps a `metalnn.llm.batching.BatchGenerator` in lockstep with rank 0's:

* before each step, rank 0 publishes what changed in its batch since the last one (`LeaderGenerator`
  records every ``add`` and ``cancel``), and the followers do the same to theirs; the generators
  number sequences alike, so ``cancel(uid)`` names the same sequence on every rank;
* every rank then steps; the model's logits are the same on every rank, and the tokens are those rank 0
  sampled (its samplers, grammars and stop strings stay on rank 0): `Lockstep.share_tokens` sends them,
  with each row's "its grammar is complete" flag, to the others;
* the prefix cache: every rank stores the same entries at the same points of a step (and looks up
  before it stores, in a step); rank 0's cache alone decides what goes (its byte budget, entries
  replaced by longer ones), and the followers' caches (``follower=True``) drop the same keys, in order
  with the other changes, before anything looks them up;
* when rank 0 has nothing to run it publishes an idle tick every ``idle_tick`` seconds at most (rising
  from 2 ms to 50 ms while it stays idle), and the followers sleep through most of each tick instead of
  spinning in a collective: a request reaching an idle server waits at most a tick's sleep for them;
* each step's message carries rank 0's batch (`batch_state`); a follower whose own differs raises,
  naming both, instead of waiting in a collective rank 0 will never enter;
* ``stop`` ends the followers when rank 0's worker stops. A rank that dies ends the others
  (`metalnn.llm.distributed.watch_peers`); a failed step on any rank ends that rank with an error, which
  ``mlx.launch`` turns into the end of the run.

Messages are JSON, sent as ``int32`` byte values with ``mx.distributed.all_sum`` (the followers add
zeros): a length, then the bytes. A draft model, named adapters, a prefix cache kept on disk and
embeddings are not served over a split model (the server refuses them when it starts / answers 400).
"""

from __future__ import annotations

import json
import logging
import time

import mlx.core as mx
import numpy as np

log = logging.getLogger("metalnn.llm.server")

#: the shortest and longest pause between idle ticks (seconds)
IDLE_TICK_MIN, IDLE_TICK_MAX = 0.002, 0.05
#: the part of an idle tick a follower sleeps through before it waits in the collective
IDLE_SLEEP = 0.8


class Lockstep:
    """Rank 0's messages to the other ranks of ``group`` (every rank calls the same methods in the same
    order; rank 0's arguments are what is sent, the others' are ignored)."""

    def __init__(self, group):
        self.group = group
        self.leader = group.rank() == 0

    def _sum(self, values, n: int, dtype=mx.int32):
        mine = mx.array(np.asarray(values, dtype=np.int32)) if self.leader else mx.zeros((n,), dtype)
        out = mx.distributed.all_sum(mine, group=self.group)
        mx.eval(out)
        return out

    def publish(self, message: dict | None = None) -> dict:
        """Rank 0 sends ``message`` (JSON-able); every rank returns it."""
        data = json.dumps(message, separators=(",", ":")).encode() if self.leader else b""
        n = int(self._sum([len(data)], 1).item())
        raw = self._sum(np.frombuffer(data, dtype=np.uint8), n)
        return message if self.leader else json.loads(np.array(raw).astype(np.uint8).tobytes().decode())

    def share_tokens(self, tokens, done, rows: int) -> tuple[list, list]:
        """Rank 0's sampled ``tokens`` of ``rows`` rows and their ``done`` flags, on every rank."""
        both = self._sum(list(tokens) + [int(bool(d)) for d in done] if self.leader else None, 2 * rows).tolist()
        return both[:rows], [bool(d) for d in both[rows:]]


class LeaderGenerator:
    """Rank 0's `metalnn.llm.batching.BatchGenerator`, recording the changes the followers repeat.

    ``add`` takes ``can_draft``: whether the sequence may be drafted for (rank 0's decision, which
    the followers cannot make without the sampler). Everything else is the generator's.
    """

    def __init__(self, generator, lockstep: Lockstep):
        self.generator, self.lockstep = generator, lockstep
        self._changes: list = []
        self.idle_tick = IDLE_TICK_MIN
        self._cache = generator.prefix_cache
        if self._cache is not None:
            self._cache.evicted = []

    def __getattr__(self, name):
        return getattr(self.generator, name)

    def __bool__(self):
        return bool(self.generator)

    def add(self, prompt, max_tokens: int, *, eos=(), state=None, adapter=None, can_draft: bool = False):
        seq = self.generator.add(prompt, max_tokens, eos=eos, state=state, adapter=adapter)
        self._changes.append(["add", seq.prompt, seq.max_tokens, sorted(seq.eos), bool(can_draft)])
        return seq

    def cancel(self, uid: int) -> bool:
        self._changes.append(["cancel", int(uid)])
        found = self.generator.cancel(uid)
        self._note_evictions()
        return found

    def step(self) -> list:
        self.lockstep.publish({"changes": self._changes, "step": True, "state": batch_state(self.generator)})
        self._changes, self.idle_tick = [], IDLE_TICK_MIN
        events = self.generator.step()
        self._note_evictions()
        return events

    def _note_evictions(self):
        """The prefix-cache keys rank 0 removed since the last look, as the next change."""
        if self._cache is not None and self._cache.evicted:
            self._changes.append(["evict", [list(k) for k in self._cache.evicted]])
            self._cache.evicted = []

    def idle(self):
        """Tell the followers nothing runs for about ``idle_tick`` seconds (called when rank 0 waited
        that long for a request); the next tick is longer."""
        self.lockstep.publish({"changes": self._changes, "idle": self.idle_tick})
        self._changes = []
        self.idle_tick = min(IDLE_TICK_MAX, 2 * self.idle_tick)

    def stop(self):
        """End the followers' loops."""
        self.lockstep.publish({"changes": [], "stop": True})


def batch_state(generator) -> list:
    """What every rank's generator must agree on before a step (a follower that does not stops with an
    error instead of waiting in a collective that never comes): ``[waiting, running, each running
    row's length, prefix-cache entries]``."""
    cache = generator.prefix_cache
    return [generator.waiting, generator.running, [len(s.prompt) + len(s.tokens) for s in generator.rows],
            len(cache) if cache is not None else -1]


def leader_sample(lockstep: Lockstep, sample, finished):
    """Rank 0's ``sample(sequences, logits)``: ``sample``'s tokens, sent with ``finished(seq)`` of each
    row to the followers."""
    def shared(sequences, logits):
        tokens = sample(sequences, logits)
        lockstep.share_tokens(tokens, [finished(s) for s in sequences], len(sequences))
        return tokens
    return shared


class _Row:
    """A follower's state of one sequence: what rank 0 decided for it."""

    __slots__ = ("can_draft", "done")

    def __init__(self, can_draft: bool):
        self.can_draft, self.done = bool(can_draft), False


def follower_generator(model, lockstep: Lockstep, *, max_batch: int, prefill_chunk: int, prompt_lookup: bool,
                       max_draft: int, prefix_cache_min_tokens: int | None = None):
    """The `metalnn.llm.batching.BatchGenerator` of a rank other than 0: its tokens are rank 0's, its
    prefix cache (when rank 0 has one) drops what rank 0's drops."""
    from ..batching import BatchGenerator, PromptLookup
    from ..prefix_cache import PrefixCache

    def sample(sequences, logits):
        mx.eval(logits)  # the collectives inside the model run on every rank
        tokens, done = lockstep.share_tokens(None, None, len(sequences))
        for seq, d in zip(sequences, done):
            seq.state.done = d
        return tokens

    cache = None
    if prefix_cache_min_tokens is not None:
        cache = PrefixCache(min_tokens=prefix_cache_min_tokens, follower=True)
    return BatchGenerator(model, sample=sample, prefill_chunk=prefill_chunk, max_batch=max_batch,
                          drafter=PromptLookup() if prompt_lookup else None, max_draft=max_draft,
                          can_draft=lambda seq: seq.state.can_draft, finished=lambda seq: seq.state.done,
                          prefix_cache=cache)


def follow(model, group, *, sleep=time.sleep, lockstep=None) -> int:
    """Run a follower rank until rank 0 stops: returns the number of steps run. Rank 0's first message
    gives the generator's settings (`GenerationWorker` sends them when it starts). ``lockstep``: the
    channel (default ``Lockstep(group)``)."""
    lockstep = lockstep or Lockstep(group)
    hello = lockstep.publish()
    settings = hello["settings"]
    generator = follower_generator(model, lockstep, **settings)
    steps = 0
    while True:
        message = lockstep.publish()
        for change in message["changes"]:
            if change[0] == "add":
                _, prompt, max_tokens, eos, can_draft = change
                generator.add(prompt, max_tokens, eos=eos, state=_Row(can_draft))
            elif change[0] == "cancel":
                generator.cancel(change[1])
            else:  # "evict": rank 0's prefix cache removed these entries
                generator.prefix_cache.drop(change[1])
        if message.get("stop"):
            log.info("rank %d: rank 0 stopped after %d steps", group.rank(), steps)
            return steps
        if message.get("step"):
            mine = batch_state(generator)
            if mine != message["state"]:
                raise RuntimeError(f"rank {group.rank()}'s batch is not rank 0's before step {steps + 1}: "
                                   f"{mine} against {message['state']} (waiting, running, lengths, cached entries)")
            generator.step()
            steps += 1
        elif "idle" in message:
            sleep(IDLE_SLEEP * float(message["idle"]))

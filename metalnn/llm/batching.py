"""Continuous batching: `BatchGenerator` decodes many sequences in one batched step, sequences
joining and leaving between steps.

Each `BatchGenerator.step`:

1. runs one chunk (``prefill_chunk`` tokens) of the oldest waiting prompt into that sequence's own
   caches; when its prompt is done, the sequence's first token is sampled and its caches join the
   batch (`metalnn.layers.batch_cache.merge_rows`: left-aligned rows, see there);
2. decodes one token of every sequence in the batch as one ``[B, 1]`` forward pass (one read of the
   weights for all of them: on a small machine decoding is bound by reading the weights, so B
   sequences cost little more than one).

Long prompts therefore never stall the running sequences for more than a chunk. Sequences leave
when they reach their token limit or an end-of-sequence id, or when `BatchGenerator.cancel` is
called (the worker does that for stop strings and disconnected clients); their rows are dropped
from the caches between steps (`keep_rows`).

Sampling is per sequence: ``sample(sequences, logits [B, vocab]) -> list[int]`` picks each row's
token (default: greedy arg-max); `Sequence.state` carries whatever the sampler keeps per sequence.
A prefix cache (`metalnn.llm.prefix_cache.PrefixCache`) lets a prompt start from the caches of the
longest prefix an earlier sequence already computed.

Everything here runs on one thread (MLX evaluates on the thread that builds the graph).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from ..layers.batch_cache import keep_rows, merge_rows

__all__ = ["BatchGenerator", "Sequence", "Event", "greedy"]

#: ``finish_reason`` of a sequence: an end-of-sequence id; its token limit; `BatchGenerator.cancel`
STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


@dataclass
class Sequence:
    """One sequence's prompt, limits and progress.

    Attributes:
        uid: its id in the generator.
        prompt: prompt token ids.
        max_tokens: the most new tokens.
        eos: ids that end it (the id is reported, then the sequence leaves).
        state: the sampler's per-sequence object (e.g. a `metalnn.llm.sampling.Sampler`).
        tokens: new tokens so far.
        finish_reason: None while running.
        cached_prefix: prompt tokens taken from the prefix cache (not recomputed).
    """

    uid: int
    prompt: list
    max_tokens: int
    eos: frozenset = frozenset()
    state: object = None
    tokens: list = field(default_factory=list)
    finish_reason: str | None = None
    cached_prefix: int = 0
    _caches: list | None = field(default=None, repr=False)
    _done: int = 0  # prompt tokens run so far


@dataclass
class Event:
    """A new token of sequence ``uid`` (``finish_reason`` set when it was the last one)."""

    uid: int
    token: int
    finish_reason: str | None = None


def greedy(sequences, logits) -> list:
    """Arg-max of each row of ``logits`` ``[B, vocab]``."""
    return mx.argmax(logits, axis=-1).tolist()


class BatchGenerator:
    """Decode many sequences together (see the module docstring).

    Args:
        model: a `metalnn.llm.models.CausalLM` (``model(tokens, cache=...)``, ``make_cache()``).
        sample: ``sample(sequences, logits [B, vocab]) -> list[int]`` (default `greedy`).
        prefill_chunk: prompt tokens run per step while others decode (at least 1).
        max_batch: the most sequences decoded together; more wait for a free row.
        prefix_cache: a `metalnn.llm.prefix_cache.PrefixCache` (None: every prompt runs whole).
        device: the `metalnn.Device` to run on.
    """

    def __init__(self, model, *, sample=None, prefill_chunk: int = 256, max_batch: int = 16, prefix_cache=None,
                 device=None):
        if int(prefill_chunk) < 1 or int(max_batch) < 1:
            raise ValueError(f"BatchGenerator: prefill_chunk and max_batch must be at least 1, got {prefill_chunk} "
                             f"and {max_batch}")
        self.model, self.sample, self.device = model, sample or greedy, device
        self.prefill_chunk, self.max_batch = int(prefill_chunk), int(max_batch)
        self.prefix_cache = prefix_cache
        self._ids = itertools.count()
        self._waiting: deque = deque()   # sequences whose prompt has not finished
        self._running: list = []         # sequences in the batch, in row order
        self._caches: list | None = None  # the batch's per-layer caches
        self._last: list = []            # each running row's last token (the next step's input)

    # -- membership ----------------------------------------------------------------------------
    def add(self, prompt, max_tokens: int, *, eos=(), state=None) -> Sequence:
        """Queue a prompt; returns its `Sequence` (its ``uid`` names it in `Event` s)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("BatchGenerator.add: the prompt is empty (at least one token is needed)")
        if int(max_tokens) < 1:
            raise ValueError(f"BatchGenerator.add: max_tokens must be at least 1, got {max_tokens}")
        seq = Sequence(next(self._ids), prompt, int(max_tokens), frozenset(int(e) for e in eos), state)
        self._waiting.append(seq)
        return seq

    def cancel(self, uid: int) -> bool:
        """End sequence ``uid`` now (waiting or running); True if it was there."""
        for seq in self._waiting:
            if seq.uid == uid:
                self._waiting.remove(seq)
                seq.finish_reason = CANCELLED
                seq._caches = None
                return True
        for row, seq in enumerate(self._running):
            if seq.uid == uid:
                seq.finish_reason = CANCELLED
                self._leave([row])
                return True
        return False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def __bool__(self):
        return bool(self._waiting or self._running)

    # -- stepping ------------------------------------------------------------------------------
    def step(self) -> list:
        """One prefill chunk (if a prompt waits and a row is free) and one decoding step of the
        batch; returns the new tokens as `Event` s."""
        events = []
        if self._waiting and len(self._running) < self.max_batch:
            events += self._prefill_chunk(self._waiting[0])
        if self._running:
            events += self._decode()
        return events

    def _start(self, seq: Sequence):
        """A waiting sequence's caches: from the prefix cache's longest match, else empty."""
        seq._caches, seq._done = self.model.make_cache(), 0
        if self.prefix_cache is not None:
            # keep at least one prompt token to run: its logits give the first new token
            hit = self.prefix_cache.lookup(seq.prompt, max_tokens=len(seq.prompt) - 1)
            if hit is not None:
                seq._done, seq._caches = hit
                seq.cached_prefix = seq._done

    def _prefill_chunk(self, seq: Sequence) -> list:
        if seq._caches is None:
            self._start(seq)
        end = min(len(seq.prompt), seq._done + self.prefill_chunk)
        chunk = mx.array(seq.prompt[seq._done:end], dtype=mx.int32)[None]
        if end < len(seq.prompt):
            # positions whose outputs nobody reads: only their keys and values are computed
            self.model(chunk, cache=seq._caches, device=self.device)
            mx.eval([s for c in seq._caches for s in c.state])
            seq._done = end
            return []
        logits = self.model(chunk, cache=seq._caches, device=self.device)[:, -1, :]
        token = self.sample([seq], logits)[0]
        seq._done = end
        self._waiting.popleft()
        if self.prefix_cache is not None:
            self.prefix_cache.store(seq.prompt, seq._caches)
        event = self._record(seq, token)
        if seq.finish_reason is None:
            self._join(seq)
        else:
            seq._caches = None
        return [event]

    def _join(self, seq: Sequence):
        groups = [self._caches] if self._caches is not None else []
        self._caches = merge_rows(groups + [seq._caches])
        seq._caches = None
        self._running.append(seq)
        self._last.append(seq.tokens[-1])

    def _decode(self) -> list:
        tokens = mx.array(self._last, dtype=mx.int32)[:, None]
        logits = self.model(tokens, cache=self._caches, device=self.device)[:, -1, :]
        picked = self.sample(self._running, logits)
        events, leaving = [], []
        for row, (seq, token) in enumerate(zip(self._running, picked)):
            events.append(self._record(seq, int(token)))
            self._last[row] = int(token)
            if seq.finish_reason is not None:
                leaving.append(row)
        if leaving:
            self._leave(leaving)
        return events

    def _record(self, seq: Sequence, token: int) -> Event:
        seq.tokens.append(int(token))
        if token in seq.eos:
            seq.finish_reason = STOP
        elif len(seq.tokens) >= seq.max_tokens:
            seq.finish_reason = LENGTH
        return Event(seq.uid, int(token), seq.finish_reason)

    def _leave(self, rows):
        rows = set(rows)
        if self.prefix_cache is not None:
            for row in rows:
                seq = self._running[row]
                # the caches hold the prompt and every new token but the last (never fed back)
                self.prefix_cache.store(seq.prompt + seq.tokens[:-1], keep_rows(self._caches, [row]))
        keep = [r for r in range(len(self._running)) if r not in rows]
        self._running = [self._running[r] for r in keep]
        self._last = [self._last[r] for r in keep]
        self._caches = keep_rows(self._caches, keep) if keep else None

"""Continuous batching: `BatchGenerator` decodes many sequences in one batched step, sequences
joining and leaving between steps.

Each `BatchGenerator.step`:

1. runs one chunk (``prefill_chunk`` tokens) of the oldest waiting prompt into that sequence's own
   caches; when its prompt is done, the sequence's first token is sampled and its caches join the
   batch (`metalnn.layers.batch_cache.merge_rows`: left-aligned rows, see there). When several
   prompts wait whose rests fit one chunk together (right-padded to the longest, at most
   ``prefill_chunk`` tokens in all), they run as one ``[n, T]`` pass instead, each row from its own
   prefix-cache match (`metalnn.layers.batch_cache.sequence_rows`), the padding taken back out of
   the caches: one pass costs much less than n short ones (a short prompt is bound by everything
   around its products, as a decoding step is), so requests that arrive together get their first
   tokens together. Models with recurrent layers (the padding would enter their states) run
   prompts one at a time;
2. decodes one token of every sequence in the batch as one ``[B, 1]`` forward pass (one read of the
   weights for all of them: on a small machine decoding is bound by reading the weights, so B
   sequences cost little more than one). When the batch was empty, a step whose prompt chunk gave
   first tokens returns them at once and decodes at the next step: the first token reaches its
   reader without waiting for the decoding step to be queued (which, after a join, first builds the
   batch's new cache buffer: SmolLM2's median first token 51.6 -> 45.0 ms, see the README).

Long prompts therefore never stall the running sequences for more than a chunk. Sequences leave
when they reach their token limit or an end-of-sequence id, or when `BatchGenerator.cancel` is
called (the worker does that for stop strings and disconnected clients); their rows are dropped
from the caches between steps (`keep_rows`).

With a drafter (`PromptLookup`, `DraftModel`), greedy sequences are decoded speculatively: the
drafter proposes up to ``max_draft`` next tokens for a row, one ``[B, 1 + k]`` pass checks them all,
and a row keeps its drafts up to the first one the model would not have picked, plus the model's
own next token (a step drafts only when at least half the rows have drafts: the wider pass costs
every row); the rejected positions are taken back out of the caches
(`metalnn.layers.batch_cache.BatchKVCache.rewind`). The tokens are exactly those of plain greedy
decoding; rows that sample (or whose sampler keeps per-token state, see ``can_draft``) take one
token per step as before, in the same pass. Models with recurrent layers (their states cannot be
taken back) decode without drafts.

While nothing joins, leaves or drafts, steps are pipelined (given ``sample_lazy``): the graph of
step ``n + 1`` is built from step ``n``'s lazy tokens and queued (``mx.async_eval``) before step
``n``'s tokens are read, so building a step overlaps the evaluation of the one before. A row that
finishes at step ``n`` still runs in step ``n + 1``, whose result for it is dropped.

Sampling is per sequence: ``sample(sequences, logits [B, vocab]) -> list[int]`` picks each row's
token (default: greedy arg-max); `Sequence.state` carries whatever the sampler keeps per sequence.
A prefix cache (`metalnn.llm.prefix_cache.PrefixCache`) lets a prompt start from the caches of the
longest prefix an earlier sequence already computed.

With ``adapters`` (a `metalnn.llm.tuner.multi_lora.AdapterRows`), each sequence names the LoRA adapter
it decodes with (`Sequence.adapter`, None: the base model): every forward pass selects each row's
adapter, so one batch mixes adapters; the prefix cache keeps each adapter's entries apart (their keys
and values differ).

Everything here runs on one thread (MLX evaluates on the thread that builds the graph).
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from ..layers.attention import KVCache
from ..layers.batch_cache import BatchKVCache, keep_rows, merge_rows, sequence_rows
from .text_pieces import CANCELLED, LENGTH, STOP  # a sequence's finish_reason

__all__ = ["BatchGenerator", "Sequence", "Event", "greedy", "PromptLookup", "DraftModel"]


@dataclass(eq=False)  # (compared by identity: rows are found by the object)
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
        adapter: the name of the LoRA adapter it decodes with (None: the base model).
    """

    uid: int
    prompt: list
    max_tokens: int
    eos: frozenset = frozenset()
    state: object = None
    tokens: list = field(default_factory=list)
    finish_reason: str | None = None
    cached_prefix: int = 0
    drafted: int = 0    # draft tokens proposed for it
    accepted: int = 0   # of those, the ones kept
    adapter: str | None = None
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


def greedy_lazy(sequences, logits):
    """`greedy` without evaluating: ``(tokens [B] lazy, read)``, ``read()`` giving the ints."""
    tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    return tokens, tokens.tolist


@dataclass
class _Pending:
    """A decoding step queued but not read: its rows, lazy tokens and their reader."""

    rows: list
    tokens: object
    read: object


class BatchGenerator:
    """Decode many sequences together (see the module docstring).

    Args:
        model: a `metalnn.llm.models.CausalLM` (``model(tokens, cache=...)``, ``make_cache()``).
        sample: ``sample(sequences, logits [B, vocab]) -> list[int]`` (default `greedy`).
        prefill_chunk: prompt tokens run per step while others decode (at least 1).
        max_batch: the most sequences decoded together; more wait for a free row.
        prefix_cache: a `metalnn.llm.prefix_cache.PrefixCache` (None: every prompt runs whole).
        drafter: proposes tokens for speculative decoding (`PromptLookup`, `DraftModel`; None: off).
        max_draft: the most draft tokens checked per row and step.
        can_draft: ``can_draft(sequence) -> bool``: whether a row's tokens are plain arg-maxes of the
            logits (no sampling, penalties, constraints or per-token results), so drafts can be
            checked against them. Default: True when ``sample`` is `greedy`.
        finished: ``finished(sequence) -> bool``, asked after each new token: True ends the
            sequence with ``"stop"`` (e.g. its grammar is complete). Default: never.
        sample_lazy: ``sample_lazy(sequences, logits) -> (tokens [B] lazy int32, read)`` with
            ``read() -> list[int]`` after evaluation: ``sample`` without evaluating, for pipelined
            steps (default: `greedy_lazy` with the default ``sample``; None: no pipelining).
        can_pipeline: ``can_pipeline(sequence) -> bool``: whether a row's sampling works lazily
            (default: always).
        device: the `metalnn.Device` to run on.
        adapters: the model's `metalnn.llm.tuner.multi_lora.AdapterRows` (None: no named adapters).
    """

    def __init__(self, model, *, sample=None, prefill_chunk: int = 256, max_batch: int = 16, prefix_cache=None,
                 drafter=None, max_draft: int = 4, can_draft=None, finished=None, sample_lazy=None,
                 can_pipeline=None, device=None, adapters=None):
        if int(prefill_chunk) < 1 or int(max_batch) < 1:
            raise ValueError(f"BatchGenerator: prefill_chunk and max_batch must be at least 1, got {prefill_chunk} "
                             f"and {max_batch}")
        self.model, self.sample, self.device = model, sample or greedy, device
        self.prefill_chunk, self.max_batch = int(prefill_chunk), int(max_batch)
        self.prefix_cache = prefix_cache
        self.drafter, self.max_draft = drafter, max(0, int(max_draft))
        if can_draft is None:
            can_draft = (lambda seq: True) if self.sample is greedy else (lambda seq: False)
        self.can_draft = can_draft
        self.finished = finished
        self.sample_lazy = sample_lazy if sample_lazy is not None else (greedy_lazy if self.sample is greedy else None)
        self.can_pipeline = can_pipeline or (lambda seq: True)
        self._pending: _Pending | None = None
        self._carry: list = []  # events read outside `step` (by `cancel`), returned by the next step
        self.adapters = adapters
        self.steps = 0  # batched decoding passes run
        self._ids = itertools.count()
        self._waiting: deque = deque()   # sequences whose prompt has not finished
        self._running: list = []         # sequences in the batch, in row order
        self._caches: list | None = None  # the batch's per-layer caches
        self._last: list = []            # each running row's last token (the next step's input)
        # prompts may run together (padded) only where every layer's cache is a plain KVCache
        self._prompts_together = all(type(c) is KVCache for c in model.make_cache())

    # -- membership ----------------------------------------------------------------------------
    def add(self, prompt, max_tokens: int, *, eos=(), state=None, adapter: str | None = None) -> Sequence:
        """Queue a prompt (decoded with LoRA adapter ``adapter``, None: the base model); returns its
        `Sequence` (its ``uid`` names it in `Event` s)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("BatchGenerator.add: the prompt is empty (at least one token is needed)")
        if int(max_tokens) < 1:
            raise ValueError(f"BatchGenerator.add: max_tokens must be at least 1, got {max_tokens}")
        if adapter is not None and (self.adapters is None or adapter not in self.adapters.names):
            have = list(self.adapters.names) if self.adapters is not None else []
            raise ValueError(f"BatchGenerator.add: adapter {adapter!r} is not installed (installed: {have})")
        seq = Sequence(next(self._ids), prompt, int(max_tokens), frozenset(int(e) for e in eos), state,
                       adapter=adapter)
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
                self._carry += self._flush()  # (the others' tokens; its own are dropped: it has ended)
                if seq in self._running:
                    self._leave([self._running.index(seq)])
                return True
        return False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def rows(self) -> list:
        """The running sequences, in row order (a copy)."""
        return list(self._running)

    def __bool__(self):
        return bool(self._waiting or self._running or self._carry)

    # -- stepping ------------------------------------------------------------------------------
    def step(self) -> list:
        """One prefill chunk (if a prompt waits and a row is free) and one decoding step of the
        batch (none when the batch was empty and the chunk gave first tokens: they return at once);
        returns the new tokens as `Event` s."""
        events, self._carry = self._carry, []
        if self._waiting and len(self._running) < self.max_batch:
            events += self._flush()  # the batch changes: read the queued step first
            group = self._prompt_group()
            alone = not self._running
            first = self._prefill_group(group) if len(group) > 1 else self._prefill_chunk(self._waiting[0])
            events += first
            if first and alone:  # (nobody else waits for the decoding step)
                return events
        if not self._running:
            return events + self._flush()
        if self._pipelines():
            return events + self._decode_pipelined()
        events += self._flush()
        if self._running:
            events += self._decode()
        return events

    def _pipelines(self) -> bool:
        """Whether the next step may be queued before the last one is read: nothing waits to join,
        no drafts, every row samples lazily."""
        if self.sample_lazy is None or self._waiting or not self._running:
            return False
        if self.drafter is not None and self.max_draft and any(self.can_draft(s) for s in self._running):
            return False
        return all(self.can_pipeline(s) for s in self._running)

    def _queue_step(self, inputs, after: _Pending | None = None) -> _Pending:
        """Build the next decoding step's graph and queue it; with ``after`` (the step queued
        before), the graph is built while that step runs, but queued once it has finished: the new
        step's cache writes can then take over the cache buffers in place (MLX decides when
        queuing), instead of copying every layer's cache while the running step still holds them."""
        with self._selected(self._running):
            logits = self.model(inputs, cache=self._caches, device=self.device)[:, -1, :]
        self.steps += 1
        tokens, read = self.sample_lazy(self._running, logits)
        if after is not None:
            mx.eval(after.tokens)
        mx.async_eval(tokens)
        return _Pending(list(self._running), tokens, read)

    def _decode_pipelined(self) -> list:
        prev = self._pending
        inputs = prev.tokens[:, None] if prev is not None else mx.array(self._last, dtype=mx.int32)[:, None]
        self._pending = self._queue_step(inputs, after=prev)
        return self._read(prev) if prev is not None else []

    def _flush(self) -> list:
        """Read the queued step, if any."""
        prev, self._pending = self._pending, None
        return self._read(prev) if prev is not None else []

    def _read(self, pending: _Pending) -> list:
        """The events of a queued step; rows that end leave (after the step queued behind it, which
        still holds them, is read: its results for them are dropped)."""
        events, leaving = [], []
        for row, (seq, token) in enumerate(zip(pending.rows, pending.read())):
            if seq.finish_reason is not None:  # ended at the step before (or cancelled)
                continue
            events.append(self._record(seq, int(token)))
            self._last[row] = int(token)
            if seq.finish_reason is not None:
                leaving.append(seq)
        if leaving:
            events += self._flush()  # (may drop rows of its own: rows are found again below)
            self._leave([i for i, s in enumerate(self._running) if any(s is seq for seq in leaving)])
        return events

    def _start(self, seq: Sequence):
        """A waiting sequence's caches: from the prefix cache's longest match, else empty."""
        seq._caches, seq._done = self.model.make_cache(), 0
        if self.prefix_cache is not None:
            # keep at least one prompt token to run: its logits give the first new token
            hit = self.prefix_cache.lookup(seq.prompt, max_tokens=len(seq.prompt) - 1, adapter=seq.adapter)
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
            with self._selected([seq]):
                self.model(chunk, cache=seq._caches, device=self.device)
            mx.eval([s for c in seq._caches for s in c.state])
            seq._done = end
            return []
        with self._selected([seq]):  # (the output head reads the last position only)
            logits = self.model(chunk, cache=seq._caches, device=self.device, last_only=True)[:, -1, :]
        token = self.sample([seq], logits)[0]
        seq._done = end
        self._waiting.popleft()
        if self.prefix_cache is not None:
            self.prefix_cache.store(seq.prompt, seq._caches, adapter=seq.adapter)
        event = self._record(seq, token)
        if seq.finish_reason is None:
            self._join(seq)
        else:
            seq._caches = None
        return [event]

    def _prompt_group(self) -> list:
        """The waiting sequences whose prompts run together now: from the front of the queue, as
        many as there are free rows whose rests, right-padded to the longest, take at most
        ``prefill_chunk`` tokens in all (one sequence, or none, where prompts run one at a time)."""
        if not self._prompts_together or len(self._waiting) < 2:
            return []
        free, limit = self.max_batch - len(self._running), getattr(self.model, "max_positions", None)
        group, width, deepest = [], 0, 0  # (deepest: the most cached positions of a row)
        for seq in self._waiting:
            if len(group) == free:
                break
            if seq._caches is None:
                self._start(seq)
            wider, deeper = max(width, len(seq.prompt) - seq._done), max(deepest, seq._done)
            if (len(group) + 1) * wider > self.prefill_chunk or (limit is not None and deeper + wider > limit):
                break
            group.append(seq)
            width, deepest = wider, deeper
        return group

    def _prefill_group(self, group: list) -> list:
        """The rests of ``group`` 's prompts as one right-padded ``[n, T]`` pass (see `_prompt_group`);
        each sequence's first token sampled, those that go on join the batch."""
        rests = [seq.prompt[seq._done:] for seq in group]
        width = max(len(r) for r in rests)
        caches = sequence_rows([seq._caches for seq in group])
        ids = mx.array([r + [0] * (width - len(r)) for r in rests], dtype=mx.int32)
        with self._selected(group):  # (the output head reads each row's last prompt position only)
            logits = self.model(ids, cache=caches, device=self.device, last_only=[len(r) - 1 for r in rests])
        for c in caches:  # the padding's positions taken back
            c.rewind([width - len(r) for r in rests])
        tokens = self.sample(group, logits[:, -1, :])
        events, going_on = [], []
        for row, (seq, token) in enumerate(zip(group, tokens)):
            self._waiting.popleft()  # (the group is the front of the queue, in order)
            seq._done, seq._caches = len(seq.prompt), None
            if self.prefix_cache is not None:
                self.prefix_cache.store(seq.prompt, keep_rows(caches, [row]), adapter=seq.adapter)
            events.append(self._record(seq, token))
            if seq.finish_reason is None:
                going_on.append(row)
        if going_on:
            joining = caches if len(going_on) == len(group) else keep_rows(caches, going_on)
            self._caches = merge_rows(([self._caches] if self._caches is not None else []) + [joining])
            for row in going_on:
                self._running.append(group[row])
                self._last.append(group[row].tokens[-1])
        return events

    def _join(self, seq: Sequence):
        groups = [self._caches] if self._caches is not None else []
        self._caches = merge_rows(groups + [seq._caches])
        seq._caches = None
        self._running.append(seq)
        self._last.append(seq.tokens[-1])

    def _drafts(self) -> list:
        """Each running row's draft tokens (empty where none are proposed or allowed)."""
        if self.drafter is None or not self.max_draft or not all(isinstance(c, BatchKVCache) for c in self._caches):
            return [[] for _ in self._running]
        limits = [min(self.max_draft, seq.max_tokens - len(seq.tokens) - 1) if self.can_draft(seq) else 0
                  for seq in self._running]
        proposed = self.drafter.propose(self._running, limits)
        drafts = [[int(t) for t in d[:k]] if k > 0 else [] for d, k in zip(proposed, limits)]
        # a wider pass costs every row: worth it only when at least half the rows have drafts
        if 2 * sum(1 for d in drafts if d) < len(drafts):
            return [[] for _ in drafts]
        return drafts

    def _decode(self) -> list:
        drafts = self._drafts()
        width = max((len(d) for d in drafts), default=0)
        rows = [[last] + d + [0] * (width - len(d)) for last, d in zip(self._last, drafts)]
        with self._selected(self._running):
            logits = self.model(mx.array(rows, dtype=mx.int32), cache=self._caches, device=self.device)
        self.steps += 1
        picked = self.sample(self._running, logits[:, 0, :])
        # the model's own choice after each draft token (greedy rows only have drafts)
        after = mx.argmax(logits[:, 1:, :], axis=-1).tolist() if width else [[] for _ in rows]
        events, leaving, rewind = [], [], []
        for row, (seq, token) in enumerate(zip(self._running, picked)):
            emitted, draft = [int(token)], drafts[row]
            while len(emitted) <= len(draft) and emitted[-1] == draft[len(emitted) - 1]:
                emitted.append(int(after[row][len(emitted) - 1]))
            seq.drafted += len(draft)
            seq.accepted += len(emitted) - 1
            if self.drafter is not None:
                self.drafter.accepted(seq, len(draft), len(emitted) - 1)
            rewind.append(width - (len(emitted) - 1))
            for t in emitted:
                events.append(self._record(seq, t))
                if seq.finish_reason is not None:
                    break
            self._last[row] = seq.tokens[-1]
            if seq.finish_reason is not None:
                leaving.append(row)
        if width:
            for c in self._caches:
                c.rewind(rewind)
        if leaving:
            self._leave(leaving)
        return events

    def _selected(self, sequences):
        """The rows' adapters selected for one forward pass (nothing to select without adapters)."""
        if self.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.selected([seq.adapter for seq in sequences])

    def _record(self, seq: Sequence, token: int) -> Event:
        seq.tokens.append(int(token))
        if token in seq.eos or (self.finished is not None and self.finished(seq)):
            seq.finish_reason = STOP
        elif len(seq.tokens) >= seq.max_tokens:
            seq.finish_reason = LENGTH
        return Event(seq.uid, int(token), seq.finish_reason)

    def _leave(self, rows):
        """Drop the running ``rows`` (indices into the running list)."""
        rows = set(rows)
        if self.prefix_cache is not None:
            lengths = next((c.lengths for c in self._caches if isinstance(c, BatchKVCache)), None)
            for row in rows:
                seq = self._running[row]
                # the caches hold the prompt and the new tokens fed back: all but the last, or all of
                # them when a pipelined step ran after the last one
                n = lengths[row] if lengths is not None else len(seq.prompt) + len(seq.tokens) - 1
                self.prefix_cache.store((seq.prompt + seq.tokens)[:n], keep_rows(self._caches, [row]),
                                        adapter=seq.adapter)
        keep = [r for r in range(len(self._running)) if r not in rows]
        self._running = [self._running[r] for r in keep]
        self._last = [self._last[r] for r in keep]
        self._caches = keep_rows(self._caches, keep) if keep else None


class PromptLookup:
    """Draft tokens copied from the sequence itself (prompt-lookup decoding): where the last ``n``
    tokens (``n`` from ``max_ngram`` down to ``min_ngram``) occurred before in the prompt or the
    answer, propose the tokens that followed them. Free to compute; pays off when answers repeat
    their input (quoting, editing, extracting, code), costs a wider step when drafts miss: a
    sequence drafts 2 tokens at first, twice as many after each step that kept them all; one
    whose recent drafts were mostly rejected drafts nothing for ``cooldown`` steps, twice
    as long after each further poor run (up to 64 times), back to ``cooldown`` once drafts are kept.

    Args:
        max_ngram, min_ngram: lengths of the matched ending.
        min_rate: the fraction of drafted tokens kept (running average) below which a sequence cools down.
        cooldown: steps without drafts after a poor run.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, min_rate: float = 0.3, cooldown: int = 8):
        if not 1 <= int(min_ngram) <= int(max_ngram):
            raise ValueError(f"PromptLookup: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)
        self.min_rate, self.cooldown = float(min_rate), int(cooldown)
        self._rate: dict = {}   # uid -> running acceptance rate
        self._pause: dict = {}  # uid -> steps left without drafts
        self._next: dict = {}   # uid -> the next cooldown's length
        self._length: dict = {}  # uid -> draft length: 2 at first, doubled while all are kept

    def propose(self, sequences, limits) -> list:
        import numpy as np

        out = []
        for seq, k in zip(sequences, limits):
            if k <= 0 or self._pause.get(seq.uid, 0) > 0:
                self._pause[seq.uid] = self._pause.get(seq.uid, 0) - 1
                out.append([])
                continue
            ctx = np.asarray(seq.prompt + seq.tokens, dtype=np.int64)
            out.append(self._lookup(ctx, min(k, self._length.get(seq.uid, 2))))
        return out

    def _lookup(self, ctx, k) -> list:
        import numpy as np

        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            tail = ctx[-n:]
            # windows ending before the last token: starts 0 .. len - n - 1
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence
                follow = ctx[start:start + k].tolist()
                if follow:
                    return follow
        return []

    def accepted(self, seq, drafted: int, kept: int):
        if not drafted:
            return
        length = self._length.get(seq.uid, 2)
        self._length[seq.uid] = min(2 * length, 64) if kept == drafted else max(2, kept + 1)
        rate = 0.5 * self._rate.get(seq.uid, 1.0) + 0.5 * kept / drafted
        self._rate[seq.uid] = rate
        if rate < self.min_rate:
            length = self._next.get(seq.uid, self.cooldown)
            self._pause[seq.uid], self._rate[seq.uid] = length, 1.0
            self._next[seq.uid] = min(2 * length, 64 * self.cooldown)
        elif kept * 2 >= drafted:
            self._next[seq.uid] = self.cooldown


class DraftModel:
    """Draft tokens from a smaller model with the same vocabulary: for each row, its greedy next
    ``k`` tokens after the sequence so far (its own caches per sequence, caught up with the tokens
    the target kept, taken back past the rejected drafts).

    Args:
        model: the draft `metalnn.llm.models.CausalLM` (attention layers only).
        device: its `metalnn.Device`.
    """

    def __init__(self, model, device=None):
        self.model, self.device = model, device
        self._state: dict = {}  # uid -> (caches, tokens fed)

    def propose(self, sequences, limits) -> list:
        live = {seq.uid for seq in sequences}
        for uid in [u for u in self._state if u not in live]:
            del self._state[uid]
        out = []
        for seq, k in zip(sequences, limits):
            if k <= 0:
                out.append([])
                continue
            ctx = seq.prompt + seq.tokens
            caches, fed = self._state.get(seq.uid, (None, 0))
            if caches is None:
                caches = self.model.make_cache()
            # take back what the target rejected, feed what it kept (all but the last token)
            for c in caches:
                c.trim(c.offset - fed)
            if len(ctx) - 1 > fed:
                self.model(mx.array(ctx[fed:-1], dtype=mx.int32)[None], cache=caches, device=self.device)
            fed = len(ctx) - 1
            draft, last = [], ctx[-1]
            for _ in range(k):
                logits = self.model(mx.array([[last]], dtype=mx.int32), cache=caches, device=self.device)
                last = int(mx.argmax(logits[0, -1]).item())
                draft.append(last)
            self._state[seq.uid] = (caches, fed)
            out.append(draft)
        return out

    def accepted(self, seq, drafted: int, kept: int):
        pass

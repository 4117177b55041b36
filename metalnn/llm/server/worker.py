"""`GenerationWorker`: one thread decodes every request together, with continuous batching.

MLX evaluates on the thread that builds the graph, so one worker thread runs the model. It holds
a `metalnn.llm.batching.BatchGenerator`: each step runs one chunk of a waiting prompt and one
decoding step of every running request as a single ``[B, 1]`` forward pass (on a small machine
decoding is bound by reading the weights, so B requests cost little more than one). Requests join
between steps and leave when they end; a `metalnn.llm.prefix_cache.PrefixCache` lets a prompt
start from the keys and values an earlier request computed for the same beginning (a chat's next
turn, a repeated system prompt).

A `Job` carries one request's prompt and options to the worker, and the worker's events back to
the request's event loop: ``("text", piece)`` for each piece of text, then ``("end", completion)``
(a `Completion`, None when the job was cancelled before it started) or ``("error", message)``.

`GenerationWorker.submit` raises `QueueFull` when ``max_queue`` jobs already wait for a row of the
batch (``max_batch`` run at once). A job can be cancelled at any time (the client left, the server
is stopping): a waiting job is dropped, a running one leaves the batch before the next step.

A `Call` is other MLX work (embeddings): the worker runs it on its thread between two steps of the
batch, so it never runs beside one, and sends back its result. With a
`metalnn.llm.server.metrics.ServerMetrics`, the worker reports the queue's depth, the sequences in the
batch, tokens read and generated, prefix-cache hits and each request's time to its first token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import mlx.core as mx

from ..batching import STOP, BatchGenerator
from ..sampling import Sampler, TokenChoice, propose_batch, sample_batch
from ..text_pieces import CANCELLED, Speeds, TextPieces

log = logging.getLogger("metalnn.llm.server")


class QueueFull(Exception):
    """``max_queue`` jobs already wait."""


class ShuttingDown(Exception):
    """The worker is stopping and takes no new jobs."""


@dataclass
class Completion(Speeds):
    """What a finished request produced (the fields `metalnn.llm.text_generation.TextStream` has).

    ``prompt_seconds``: from joining the worker's generator to the first new token;
    ``generation_seconds``: from the first to the last new token; ``cached_tokens``: prompt tokens
    taken from the prefix cache; ``choices``: each token's `TokenChoice`; ``text_choices``: those of
    the text's tokens (all but an end-of-sequence token).
    """

    prompt_tokens: int
    sampling: object = None
    text: str = ""
    tokens: list = field(default_factory=list)
    choices: list = field(default_factory=list)
    _ended_by_eos: bool = False
    finish_reason: str | None = None
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    cached_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def text_choices(self) -> list:
        eos = bool(self.choices) and self.finish_reason == "stop" and self._ended_by_eos
        return self.choices[:-1] if eos else list(self.choices)



class Job:
    """One request's generation.

    Args:
        prompt: the prompt's token ids.
        options: ``max_tokens``, ``sampling``, ``stop``, ``processors``, ``adapter`` (the LoRA adapter's
            name, absent or None: the base model).
        loop: the event loop of the request (events are delivered to it thread-safely).
    """

    def __init__(self, prompt, options: dict, loop: asyncio.AbstractEventLoop):
        self.prompt, self.options, self.loop = list(prompt), dict(options), loop
        self.submitted = time.perf_counter()
        self.events: asyncio.Queue = asyncio.Queue()
        self.result: Completion | None = None
        self.cancel_reason: str | None = None
        self._cancelled = threading.Event()
        # worker-side state
        self._pieces: TextPieces | None = None
        self._seq = None
        self._sampler: Sampler | None = None
        self._choices: deque = deque()  # sampled rows' `TokenChoice` s not yet matched to their events
        self._unsent: list = []         # `TokenChoice` s of text not yet sent (with logprobs)
        self._started = self._first = 0.0

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self, reason: str = "client"):
        """Drop the job if it waits, stop it before its next token if it runs (any thread)."""
        if not self._cancelled.is_set():
            self.cancel_reason = reason
            self._cancelled.set()

    def send(self, kind: str, value=None):
        """Deliver an event to the request's loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def plain_greedy(sequence) -> bool:
    """Whether a row's tokens are plain arg-maxes with nothing to report per token (its drafts can
    then be checked in one pass)."""
    return greedy_sampler(sequence.state._sampler)


def greedy_sampler(sampler) -> bool:
    """`plain_greedy` of a row with this `metalnn.llm.sampling.Sampler`."""
    return sampler.params.greedy and sampler.plain and not sampler.params.logprobs


def grammar_done(sequence) -> bool:
    """Whether a row's constraint is complete (its answer ends there)."""
    return any(getattr(p, "done", False) for p in sequence.state._sampler.processors)


def sample_rows(sequences, logits) -> list:
    """Each row's token by its job's `metalnn.llm.sampling.Sampler` (one evaluation for the batch;
    a seeded request draws with its own key, so it gets the same tokens whatever else is in the
    batch). The `TokenChoice` s wait on the job for its ``logprobs``."""
    choices = sample_batch([s.state._sampler for s in sequences], logits)
    for seq, choice in zip(sequences, choices):
        seq.state._choices.append(choice)
    return [c.token for c in choices]


class Call(Job):
    """Work for the worker thread other than a generation: ``fn()`` (MLX work such as embeddings, which
    must not run beside the batch's steps), whose result comes back as ``("end", result)``, or
    ``("error", message)`` when it raises. ``prompt_tokens``: the tokens it reads (for the metrics)."""

    def __init__(self, fn, loop: asyncio.AbstractEventLoop, prompt_tokens: int = 0):
        super().__init__([], {}, loop)
        self.fn, self.prompt_tokens = fn, int(prompt_tokens)


def sample_rows_lazy(sequences, logits):
    """`sample_rows` without evaluating (for pipelined steps): ``(tokens [B] lazy, read)``; each
    sampler takes its token lazily, ``read()`` evaluates and gives the ints."""
    samplers = [s.state._sampler for s in sequences]
    batch = propose_batch(samplers, logits)
    for i, sampler in enumerate(samplers):
        sampler.accept(batch.tokens[i])

    def read():
        mx.eval(batch.arrays())
        choices = batch.choices()
        for seq, choice in zip(sequences, choices):
            seq.state._choices.append(choice)
        return [c.token for c in choices]
    return batch.tokens, read


def lazy_ok(sequence) -> bool:
    """Whether a row samples without needing its last token first (no grammar)."""
    return not sequence.state._sampler.processors


def _end_process(message: str):
    """End this rank of a split model with an error (``mlx.launch`` then ends the others)."""
    import os
    import sys

    print(f"metalnn serve: {message}; stopping", file=sys.stderr, flush=True)
    os._exit(1)


class GenerationWorker:
    """Runs every `Job` on its own thread, batched.

    Args:
        model, tokenizer: the model and its `metalnn.llm.tokenizer.Tokenizer`.
        max_queue: how many jobs may wait for a row of the batch.
        max_batch: how many jobs decode together.
        prefix_cache: a `metalnn.llm.prefix_cache.PrefixCache` or None.
        prefill_chunk: prompt tokens run per step while other requests decode.
        drafter, max_draft: speculative decoding of greedy requests (see `metalnn.llm.batching`).
        prompt_cache_dir: a folder the prefix cache is read from when the worker starts and written
            to when it stops (on the worker's thread: MLX arrays belong to the thread's stream).
        metrics: a `metalnn.llm.server.metrics.ServerMetrics` to report to (None: none).
        adapters: the model's `metalnn.llm.tuner.multi_lora.AdapterRows` (named LoRA adapters a job
            may ask for; None: none).
        group: the ``mx.distributed`` group ``model`` is split over (this is rank 0; the other ranks
            run `metalnn.llm.server.lockstep.follow`); None: one process. A split model is served
            without a draft model, named adapters or a prefix cache on disk, and a failed step ends
            the process (the other ranks cannot go on with it).
    """

    def __init__(self, model, tokenizer, max_queue: int = 16, *, max_batch: int = 8, prefix_cache=None,
                 prefill_chunk: int = 256, drafter=None, max_draft: int = 4, prompt_cache_dir=None,
                 metrics=None, adapters=None, group=None, fatal=None):
        self.model, self.tokenizer, self.max_queue = model, tokenizer, int(max_queue)
        self.metrics = metrics
        self.max_batch, self.prefix_cache, self.prefill_chunk = int(max_batch), prefix_cache, int(prefill_chunk)
        self.drafter, self.max_draft = drafter, int(max_draft)
        self.prompt_cache_dir = prompt_cache_dir
        self.adapters = adapters
        self.lockstep = None
        if group is not None:
            from ..batching import PromptLookup
            from .lockstep import Lockstep

            if prompt_cache_dir or adapters is not None or (drafter is not None and
                                                            not isinstance(drafter, PromptLookup)):
                raise ValueError("GenerationWorker: a model split over ranks is served without a draft model, "
                                 "named adapters or a prefix cache on disk")
            self.lockstep = Lockstep(group)
        self._fatal = fatal or _end_process
        self.eos = frozenset(getattr(model, "eos_token_ids", ()) or ()) | frozenset(tokenizer.eos_token_ids)
        self._inbox: queue.Queue = queue.Queue()
        # re-entrant: cancel_all also runs from the SIGTERM handler, which may interrupt submit()
        self._lock = threading.RLock()
        self._open: set = set()  # jobs submitted and not finished
        self._waiting = 0        # of those, the ones without a row yet
        self._running = 0
        self._closing = False
        self._thread: threading.Thread | None = None
        self.counts = Counter({"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0})
        self.generated_tokens = 0
        self._generator = self._new_generator()
        self._jobs: dict = {}  # sequence uid -> job
        self._thread_ok = True  # False once a split model's step failed (the other ranks cannot be told)

    def _new_generator(self):
        if self.lockstep is not None:  # no pipelined steps: the followers take every token as it is sampled
            from .lockstep import LeaderGenerator, leader_sample

            return LeaderGenerator(BatchGenerator(
                self.model, sample=leader_sample(self.lockstep, sample_rows, grammar_done),
                prefill_chunk=self.prefill_chunk, max_batch=self.max_batch, drafter=self.drafter,
                max_draft=self.max_draft, can_draft=plain_greedy, finished=grammar_done,
                prefix_cache=self.prefix_cache), self.lockstep)
        return BatchGenerator(self.model, sample=sample_rows, prefill_chunk=self.prefill_chunk,
                              max_batch=self.max_batch, prefix_cache=self.prefix_cache, drafter=self.drafter,
                              max_draft=self.max_draft, can_draft=plain_greedy, finished=grammar_done,
                              sample_lazy=sample_rows_lazy, can_pipeline=lazy_ok, adapters=self.adapters)

    def start(self):
        self._thread = threading.Thread(target=self._serve, name="metalnn-generation", daemon=True)
        self._thread.start()

    def submit(self, job: Job):
        """Queue ``job``. Raises `QueueFull` or `ShuttingDown`."""
        with self._lock:
            if self._closing:
                raise ShuttingDown()
            if self._waiting >= self.max_queue:
                self.counts["rejected"] += 1
                raise QueueFull()
            self._open.add(job)
            self._waiting += 1
            self._inbox.put(job)
            if self.metrics is not None:
                self.metrics.queue_depth(self._waiting)

    def cancel_all(self, reason: str = "shutdown"):
        """Take no new jobs and cancel every waiting and running one."""
        with self._lock:
            self._closing = True
            jobs = list(self._open)
        for job in jobs:
            job.cancel(reason)

    def stop(self, timeout: float = 30.0):
        """Cancel everything and wait for the thread to end."""
        self.cancel_all()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the worker thread runs (started and not stopped or crashed)."""
        return self._thread is not None and self._thread.is_alive()

    def status(self) -> dict:
        """The worker's state, the queue, request counts (jobs: one per choice) and the prefix cache's
        size (``prefix_cache_bytes``, ``prefix_cache_entries``; 0 without one)."""
        cache = self.prefix_cache
        cached = {"prefix_cache_bytes": cache.nbytes if cache is not None else 0,
                  "prefix_cache_entries": len(cache) if cache is not None else 0}
        with self._lock:
            return {"worker": "running" if self.alive else "stopped", "running": self._running,
                    "waiting": self._waiting, "max_queue": self.max_queue, "max_batch": self.max_batch, **self.counts,
                    "generated_tokens": self.generated_tokens, **cached}

    # -- the worker thread ---------------------------------------------------------------------
    def _serve(self):
        if self.prefix_cache is not None and self.prompt_cache_dir:
            try:
                n = self.prefix_cache.load(self.prompt_cache_dir)
                log.info("prompt cache: %d entries read from %s", n, self.prompt_cache_dir)
            except OSError as e:
                log.warning("prompt cache: could not read %s: %s", self.prompt_cache_dir, e)
        if self.lockstep is not None:  # the followers build their generator as this one
            cache = self.prefix_cache
            self.lockstep.publish({"settings": {"max_batch": self.max_batch, "prefill_chunk": self.prefill_chunk,
                                                "prompt_lookup": self.drafter is not None,
                                                "max_draft": self.max_draft,
                                                "prefix_cache_min_tokens": cache.min_tokens if cache is not None else None}})
        try:
            self._loop()
        finally:
            if self.lockstep is not None and self._thread_ok:
                self._generator.stop()
            if self.prefix_cache is not None and self.prompt_cache_dir:
                try:
                    self.prefix_cache.save(self.prompt_cache_dir)
                except OSError as e:
                    log.warning("prompt cache: could not write %s: %s", self.prompt_cache_dir, e)

    def _loop(self):
        stopping = False
        while True:
            idle = not self._jobs and not stopping
            stopping = self._take_new(block=idle) or stopping
            self._drop_cancelled()
            if stopping and not self._jobs:
                return
            if not self._jobs:
                if idle and self.lockstep is not None:
                    self._generator.idle()
                continue
            try:
                events = self._generator.step()
            except Exception as e:  # every job of the batch fails; the worker goes on with new ones
                log.exception("generation failed")
                if self.lockstep is not None:  # the other ranks are somewhere inside the step
                    self._thread_ok = False
                    for job in list(self._jobs.values()):
                        job.send("error", f"generation failed: {type(e).__name__}: {e}")
                    self._fatal(f"generation failed on rank 0 of a split model: {type(e).__name__}: {e}")
                    return
                for job in list(self._jobs.values()):
                    job.send("error", f"generation failed: {type(e).__name__}: {e}")
                    self._finish(job, "failed", waiting=not job.result.tokens)
                self._jobs.clear()
                self._generator = self._new_generator()
                continue
            now = time.perf_counter()
            for event in events:
                self._deliver(event, now)
            self._count()

    def _take_new(self, block: bool) -> bool:
        """Move submitted jobs into the generator; True once the stop sentinel arrived. (Over a split
        model, a blocking wait lasts at most the lockstep's idle tick.)"""
        stopping = False
        timeout = self._generator.idle_tick if self.lockstep is not None else None
        while True:
            try:
                job = self._inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return stopping
            block = False
            if job is None:
                stopping = True
                continue
            if job.cancelled:
                job.send("end", None)
                self._finish(job, "cancelled", waiting=True)
                continue
            if isinstance(job, Call):  # between two steps of the batch: nothing else runs
                self._finish(job, self._call(job), waiting=True)
                continue
            o = job.options
            job._pieces = TextPieces(self.tokenizer, o.get("stop") or (), self.eos)
            job._sampler = Sampler(o["sampling"], job.prompt, o.get("processors") or ())
            job._started = time.perf_counter()
            job.result = Completion(prompt_tokens=len(job.prompt), sampling=o["sampling"])
            drafts = {"can_draft": greedy_sampler(job._sampler)} if self.lockstep is not None else {}
            seq = self._generator.add(job.prompt, o["max_tokens"], eos=self.eos, state=job, adapter=o.get("adapter"),
                                      **drafts)
            self._jobs[seq.uid] = job
            job._seq = seq

    def _drop_cancelled(self):
        for uid, job in list(self._jobs.items()):
            if job.cancelled:
                self._generator.cancel(uid)
                del self._jobs[uid]
                job.result.finish_reason = CANCELLED
                job.send("end", job.result)
                self._finish(job, "cancelled", waiting=not job.result.tokens)
        self._count()

    def _deliver(self, event, now: float):
        job = self._jobs.get(event.uid)
        if job is None:
            return
        r = job.result
        if not r.tokens:
            job._first = now
            r.prompt_seconds = now - job._started
            r.cached_tokens = job._seq.cached_prefix
            if self.metrics is not None:
                self.metrics.first_token(now - job.submitted)
                self.metrics.tokens(prompt=r.prompt_tokens)
                self.metrics.prefix_cache_hit(r.cached_tokens)
            with self._lock:
                self._waiting -= 1
        r.tokens.append(event.token)
        # the sampler's choice of this token (a draft kept by speculative decoding has none: such
        # rows report no logprobs)
        choice = job._choices.popleft() if job._choices and job._choices[0].token == event.token else None
        r.choices.append(choice or TokenChoice(event.token))
        if self.metrics is not None:
            self.metrics.tokens(generated=1)
        r.generation_seconds = now - job._first
        if event.token in self.eos:
            r._ended_by_eos = True
        else:
            job._unsent.append(r.choices[-1])
        piece = job._pieces.feed(event.token)
        if piece:
            self._send_tokens(job)
            job.send("text", piece)
        reason = event.finish_reason
        if job._pieces.stopped and reason is None:  # a stop string
            self._generator.cancel(event.uid)
            reason = STOP
        if reason is None:
            return
        if not job._pieces.stopped:  # the limit or a completed grammar: the held-back text is final
            rest = job._pieces.flush()
            if rest:
                self._send_tokens(job)
                job.send("text", rest)
        self._send_tokens(job)
        r.text, r.finish_reason = job._pieces.text, reason
        del self._jobs[event.uid]
        job.send("end", r)
        self._finish(job, "completed")

    @staticmethod
    def _send_tokens(job: Job):
        """``("tokens", [TokenChoice, ...])``: the text's tokens since the last, when the request asks for
        their log-probabilities."""
        if job._unsent and job._sampler.params.logprobs:
            job.send("tokens", job._unsent)
        job._unsent = []

    def _finish(self, job: Job, outcome: str, waiting: bool = False):
        with self._lock:
            self._open.discard(job)
            self.counts[outcome] += 1
            if waiting:
                self._waiting -= 1
            if job.result is not None:
                self.generated_tokens += len(job.result.tokens)

    def _count(self):
        with self._lock:
            self._running = len(self._jobs) - self._waiting_in_generator()
            waiting = self._waiting
        if self.metrics is not None:
            self.metrics.queue_depth(waiting)
            self.metrics.running(len(self._jobs))

    def _call(self, job: Call) -> str:
        try:
            result = job.fn()
        except Exception as e:  # reported to the client; the worker goes on
            log.exception("%s failed", getattr(job.fn, "__name__", "a call"))
            job.send("error", f"{type(e).__name__}: {e}")
            return "failed"
        if self.metrics is not None:
            self.metrics.tokens(prompt=job.prompt_tokens)
        job.send("end", result)
        return "completed"

    def _waiting_in_generator(self) -> int:
        return sum(1 for job in self._jobs.values() if not job.result.tokens)

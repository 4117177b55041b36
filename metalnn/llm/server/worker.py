"""`GenerationWorker`: one thread runs every generation, one request at a time, from a bounded queue.

MLX evaluates a model on one thread at a time, and on a small machine one generation already uses
the cores, so requests are served in arrival order by a single worker thread instead of being
interleaved. A `Job` carries one request's prompt and options to the worker, and the worker's
events back to the request's event loop: ``("text", piece)`` for each piece of text (when the job's
sampling asks for ``logprobs``, preceded by ``("tokens", [TokenChoice, ...])`` with the tokens
generated since the last piece; the last ones may come just before the end), then
``("end", stream)`` (the finished `metalnn.llm.text_generation.TextStream`, None when the job was
cancelled before it started) or ``("error", message)``.

`GenerationWorker.submit` raises `QueueFull` when ``max_queue`` jobs are already waiting. A job can
be cancelled at any time (the client left, the server is stopping): a waiting job is dropped, a
running one stops before its next token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import Counter

from ..text_generation import CANCELLED, TextStream

log = logging.getLogger("metalnn.llm.server")


class QueueFull(Exception):
    """The queue already holds ``max_queue`` waiting jobs."""


class ShuttingDown(Exception):
    """The worker is stopping and takes no new jobs."""


class Job:
    """One request's generation.

    Args:
        prompt: the prompt's token ids.
        options: `TextStream` keywords (``max_tokens``, ``sampling``, ``stop``).
        loop: the event loop of the request (events are delivered to it thread-safely).
    """

    def __init__(self, prompt, options: dict, loop: asyncio.AbstractEventLoop):
        self.prompt, self.options, self.loop = list(prompt), dict(options), loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.stream: TextStream | None = None
        self.cancel_reason: str | None = None
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self, reason: str = "client"):
        """Drop the job if it waits, stop it before its next token if it runs (any thread)."""
        if not self._cancelled.is_set():
            self.cancel_reason = reason
            self._cancelled.set()
        stream = self.stream
        if stream is not None:
            stream.cancel()

    def send(self, kind: str, value=None):
        """Deliver an event to the request's loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class GenerationWorker:
    """Runs `Job` s one at a time on its own thread.

    Args:
        model, tokenizer: the model and its `metalnn.llm.tokenizer.Tokenizer`.
        max_queue: how many jobs may wait while one runs.
    """

    def __init__(self, model, tokenizer, max_queue: int = 16):
        self.model, self.tokenizer, self.max_queue = model, tokenizer, int(max_queue)
        self._queue: queue.Queue = queue.Queue()
        # re-entrant: cancel_all also runs from the SIGTERM handler, which may interrupt submit()
        self._lock = threading.RLock()
        self._open: set = set()  # jobs submitted and not finished
        self._running: Job | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self.counts = Counter({"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0})
        self.generated_tokens = 0

    def start(self):
        self._thread = threading.Thread(target=self._serve, name="metalnn-generation", daemon=True)
        self._thread.start()

    def submit(self, job: Job):
        """Queue ``job``. Raises `QueueFull` or `ShuttingDown`."""
        with self._lock:
            if self._closing:
                raise ShuttingDown()
            if self._queue.qsize() >= self.max_queue:
                self.counts["rejected"] += 1
                raise QueueFull()
            self._open.add(job)
            self._queue.put(job)

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
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def status(self) -> dict:
        with self._lock:
            return {"running": int(self._running is not None), "waiting": self._queue.qsize(),
                    "max_queue": self.max_queue, **self.counts, "generated_tokens": self.generated_tokens}

    def _serve(self):
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._running = job
            try:
                outcome = self._run(job)
            finally:
                with self._lock:
                    self._running = None
                    self._open.discard(job)
                    self.counts[outcome] += 1
                    if job.stream is not None:
                        self.generated_tokens += job.stream.completion_tokens

    def _run(self, job: Job) -> str:
        if job.cancelled:
            job.send("end", None)
            return "cancelled"
        options = dict(job.options)
        try:
            stream = TextStream(self.model, self.tokenizer, job.prompt, options.pop("max_tokens"), **options)
            job.stream = stream
            if job.cancelled:  # cancelled while the stream was being made
                stream.cancel()
            sent = 0  # token choices sent (with logprobs)
            for piece in stream:
                if stream.sampling.logprobs:
                    sent = _send_tokens(job, stream, sent)
                job.send("text", piece)
            if stream.sampling.logprobs:
                _send_tokens(job, stream, sent)
        except Exception as e:  # reported to the client; the worker goes on with the next job
            log.exception("generation failed")
            job.send("error", f"generation failed: {type(e).__name__}: {e}")
            return "failed"
        job.send("end", stream)
        return "cancelled" if stream.finish_reason == CANCELLED else "completed"


def _send_tokens(job: Job, stream: TextStream, sent: int) -> int:
    """Send the text's token choices after the first ``sent``; returns how many are sent now."""
    new = stream.text_choices[sent:]
    if new:
        job.send("tokens", new)
    return sent + len(new)

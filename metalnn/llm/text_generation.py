"""Streamed text from a language model: `TextStream`.

`metalnn.stream_generate` yields token ids; applications want text. A `TextStream` turns the
prompt's ids into text pieces as they are generated:

* a piece comes out as soon as its tokens decode to whole characters (the ``tokenizers``
  library's incremental ``DecodeStream``: a character split over several byte tokens comes out
  once, whole);
* with ``stop`` strings, text that could be the beginning of one is held back until it is known
  not to be, and the text ends before the first stop string;
* the stream ends at an end-of-sequence token (not part of the text), after ``max_tokens``
  tokens, when a logits processor is ``done`` (a grammar is complete, ``finish_reason`` "stop"),
  or when `TextStream.cancel` (thread-safe) or `TextStream.close` is called;
* afterwards it tells how many tokens were read and generated, why it ended (``finish_reason``)
  and how fast the prompt and the generation ran;
* ``choices`` holds each generated token's `metalnn.llm.sampling.TokenChoice` as it comes (with
  its log-probabilities when the `SamplingParams` ask for them).

>>> stream = TextStream(model, tokenizer, tokenizer.encode("Once upon a time"), max_tokens=50)
>>> for piece in stream:
...     print(piece, end="", flush=True)
>>> stream.finish_reason, stream.completion_tokens, stream.generation_tps
"""

from __future__ import annotations

import threading
import time

from .generation import sampling_params, stream_choices
from .sampling import SamplingParams, TokenChoice
from .text_pieces import CANCELLED, LENGTH, STOP, Speeds, TextPieces


class TextStream(Speeds):
    """Generate text after ``prompt`` piece by piece (an iterator of ``str``).

    Args:
        model: a `metalnn.llm.models.CausalLM`.
        tokenizer: a `metalnn.llm.tokenizer.Tokenizer` (its ``tokenizers`` object decodes).
        prompt: the prompt's token ids (``list[int]``, at least one).
        max_tokens: the most tokens to generate (at least 1).
        sampling: a `metalnn.llm.sampling.SamplingParams` (default: greedy decoding).
        temperature, top_k, top_p, seed: instead of ``sampling``, as `metalnn.generate`.
        processors: `metalnn.llm.sampling.LogitsProcessor` s of this sequence (e.g. a grammar).
        stop: a string or strings that end the text (the stop string itself is not part of it).
        eos_token_ids: ids that end generation (not part of the text). Default: the model's and
            the tokenizer's EOS sets.
        on_finish: called once with the stream when it ends, whatever the reason.

    After (or during) iteration: ``text`` (everything yielded), ``tokens`` (generated ids,
    including an end-of-sequence token), ``choices`` (their `TokenChoice` s, in step with
    ``tokens``), ``text_choices`` (those of the tokens that are part of the text: all but an
    end-of-sequence token), ``prompt_tokens``, ``completion_tokens``,
    ``finish_reason`` (`STOP`, `LENGTH`, `CANCELLED`; None while running), ``prompt_seconds``
    (time to the first new token), ``generation_seconds`` (from the first to the last new token),
    ``prompt_tps`` and ``generation_tps`` (tokens per second).
    """

    def __init__(self, model, tokenizer, prompt, max_tokens: int, *, sampling: SamplingParams | None = None,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, stop=None, eos_token_ids=None, on_finish=None, processors=()):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("TextStream: the prompt is empty (at least one token is needed)")
        if int(max_tokens) < 1:
            raise ValueError(f"TextStream: max_tokens must be at least 1, got {max_tokens}")
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        self.stop = tuple(s for s in stop if s)
        if eos_token_ids is None:
            eos_token_ids = set(getattr(model, "eos_token_ids", ()) or ()) | set(tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.model, self.tokenizer, self.prompt = model, tokenizer, prompt
        self.max_tokens = int(max_tokens)
        self.sampling = sampling_params(sampling, temperature, top_k, top_p, seed)
        self.processors = tuple(processors or ())
        self.on_finish = on_finish
        self.text = ""
        self.tokens: list[int] = []
        self.choices: list[TokenChoice] = []
        self.finish_reason: str | None = None
        self.prompt_seconds = 0.0
        self.generation_seconds = 0.0
        self._cancel = threading.Event()
        self._pieces = self._run()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def text_choices(self) -> list[TokenChoice]:
        """The `TokenChoice` s of the tokens that make the text (an end-of-sequence token left out)."""
        if self.finish_reason == STOP and self.tokens and self.tokens[-1] in self.eos_token_ids:
            return self.choices[:-1]
        return self.choices

    def cancel(self):
        """Ask the stream to end before its next token (safe to call from any thread)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def close(self):
        """End the stream now (from the thread that iterates it)."""
        self._pieces.close()

    def __iter__(self):
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def _run(self):
        pieces = TextPieces(self.tokenizer, self.stop)  # (the EOS ids end the loop below)
        start = time.perf_counter()
        first = None
        tokens = stream_choices(self.model, self.prompt, self.max_tokens, self.sampling,
                                eos_token_id=tuple(self.eos_token_ids), processors=self.processors)
        try:
            for choice in tokens:
                now = time.perf_counter()
                if first is None:
                    first = now
                    self.prompt_seconds = now - start
                self.generation_seconds = now - first
                token = choice.token
                self.tokens.append(token)
                self.choices.append(choice)
                if token in self.eos_token_ids:
                    self.finish_reason = STOP
                    break
                ready = pieces.feed(token)
                if ready:
                    self.text += ready
                    yield ready
                if pieces.stopped or any(getattr(p, "done", False) for p in self.processors):
                    self.finish_reason = STOP  # a stop string, or a complete grammar
                    break
                if self._cancel.is_set():
                    self.finish_reason = CANCELLED
                    return
            else:
                self.finish_reason = LENGTH
            rest = pieces.flush()  # no more text can complete a stop string
            if rest:
                self.text += rest
                yield rest
        finally:
            tokens.close()
            if self.finish_reason is None:  # closed, cancelled or interrupted while running
                self.finish_reason = CANCELLED
            if self.on_finish is not None:
                callback, self.on_finish = self.on_finish, None
                callback(self)

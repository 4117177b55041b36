"""`TextPieces`: one sequence's new tokens turned into text pieces as they come.

* a piece comes out as soon as its tokens decode to whole characters (the ``tokenizers``
  library's incremental ``DecodeStream``: a character split over several byte tokens comes out
  once, whole);
* with ``stop`` strings, text that could be the beginning of one is held back until it is known
  not to be, and the text ends before the first stop string;
* an end-of-sequence token ends the text (it is counted, not shown).

Used per request by `metalnn.llm.text_generation.TextStream` and by the server's batching worker.
"""

from __future__ import annotations

__all__ = ["TextPieces", "Speeds", "STOP", "LENGTH", "CANCELLED"]

#: ``finish_reason`` values: an end-of-sequence token, a stop string or a complete grammar; the
#: token limit; cancelled (or an exception) before the end
STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"


class Speeds:
    """``prompt_tps`` and ``generation_tps`` of a finished or running generation that has
    ``prompt_tokens``, ``tokens``, ``prompt_seconds`` (to the first new token) and
    ``generation_seconds`` (from the first to the last new token)."""

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens per second (prompt tokens / time to the first new token)."""
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        """New tokens per second after the first one (0 with fewer than two new tokens)."""
        n = len(self.tokens) - 1
        return n / self.generation_seconds if n > 0 and self.generation_seconds > 0 else 0.0


def _stop_at(text: str, stops) -> int | None:
    """Index where the earliest stop string in ``text`` begins (None if none occurs)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _held_back(text: str, stops) -> int:
    """Length of the longest end of ``text`` that is the beginning of a stop string (such text
    must wait for the next piece before it can be shown)."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class TextPieces:
    """Text of one sequence's new tokens (see the module docstring).

    Args:
        tokenizer: a `metalnn.llm.tokenizer.Tokenizer`.
        stop: strings that end the text (not part of it).
        eos_token_ids: ids that end the text (not part of it).

    ``feed(token)`` returns the text that can be shown now (maybe ""); once ``stopped`` is True (a
    stop string or an end-of-sequence id) the text is complete. ``flush()`` returns the held-back
    rest when the sequence ends otherwise. ``text`` is everything returned so far.
    """

    def __init__(self, tokenizer, stop=(), eos_token_ids=()):
        from tokenizers.decoders import DecodeStream

        if isinstance(stop, str):
            stop = (stop,)
        self.stop = tuple(s for s in (stop or ()) if s)
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.tokenizer = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._pending = ""  # decoded text not shown yet: it may be the beginning of a stop string
        self.text = ""
        self.stopped = False

    def feed(self, token: int) -> str:
        """The text that ``token`` completes (after the earlier tokens)."""
        if self.stopped:
            return ""
        token = int(token)
        if token in self.eos_token_ids:
            self.stopped = True
            return self.flush()
        self._pending += self._decoder.step(self.tokenizer.tokenizer, token) or ""
        cut = _stop_at(self._pending, self.stop) if self.stop else None
        if cut is not None:
            self._pending = self._pending[:cut]
            self.stopped = True
            return self.flush()
        keep = _held_back(self._pending, self.stop) if self.stop else 0
        ready, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        self.text += ready
        return ready

    def flush(self) -> str:
        """The held-back text (no more tokens will come)."""
        rest, self._pending = self._pending, ""
        self.text += rest
        return rest

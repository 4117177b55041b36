"""Constrained decoding: `GrammarConstraint`, a per-sequence logits processor built on llguidance.

A grammar (a JSON schema, a regular expression or a Lark grammar in llguidance's syntax) decides,
before each token, which tokens may come next; the others get ``-inf`` logits, so whatever the
sampler picks keeps the text inside the grammar. llguidance computes that set as a bit mask over
the vocabulary from its own copy of the tokenizer (`ll_tokenizer`: built once per `Tokenizer`,
about half a second for a 50k vocabulary, then cached), in tens of microseconds a token.

>>> c = GrammarConstraint.json_schema(tokenizer, {"type": "object", "properties": {"n": {"type": "integer"}}})
>>> stream = TextStream(model, tokenizer, prompt, 100, processors=[c])   # stops when the JSON ends
>>> json.loads("".join(stream))

The constraint has the shape of every logits processor of `metalnn.stream_generate`:
``c(logits)`` ``[V] -> [V]`` before sampling, ``c.accept(token)`` after it, and ``c.done`` once
the grammar is complete (nothing but an end-of-sequence token may follow): generation stops.
One constraint follows one sequence; a batch gives each row its own.

JSON output is compact by default (``", "`` and ``": "`` between items, no other whitespace): a
small model left free to add whitespace can produce blank lines until it runs out of tokens. A
schema's own ``"x-guidance"`` options (llguidance's JSON options) take precedence.
"""

from __future__ import annotations

import threading
import weakref

import mlx.core as mx
import numpy as np

#: llguidance's JSON options used unless the schema's own "x-guidance" says otherwise
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_compiling = threading.Lock()


class GrammarError(ValueError):
    """A grammar (or JSON schema, or regular expression) llguidance refuses, or a token the grammar
    does not allow."""


def _llguidance():
    try:
        import llguidance
    except ImportError:  # pragma: no cover - listed as a dependency
        raise ImportError("constrained decoding needs the 'llguidance' package: pip install llguidance") from None
    return llguidance


class _TokenTable:
    """The vocabulary as byte strings, for tokenizers whose decoder llguidance cannot read itself
    (e.g. `metalnn.llm.tokenizer.char_tokenizer`'s ``Fuse`` decoder): each token is what it
    decodes to alone. Special tokens are marked so (llguidance never produces them from text)."""

    def __init__(self, tokenizer, eos: int):
        tok = tokenizer.tokenizer
        added = tok.get_added_tokens_decoder()
        self.eos_token_id, self.bos_token_id = eos, tokenizer.bos_token_id
        self.special_token_ids = sorted(i for i, t in added.items() if t.special)
        self.tokens = [(added[i].content if i in added else tok.decode([i], skip_special_tokens=False)).encode()
                       for i in range(tokenizer.vocab_size)]
        self._tok = tok

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_special_tokens=False).ids


def _build_tokenizer(tokenizer):
    llg = _llguidance()
    eos = sorted(tokenizer.eos_token_ids)
    try:
        return llg.LLTokenizer(tokenizer.tokenizer.to_str(), eos_token=eos or None)
    except ValueError:  # a decoder llguidance does not know: give it the decoded vocabulary
        if not eos:
            raise GrammarError("constrained decoding: the tokenizer has no end-of-sequence token") from None
        return llg.LLTokenizer(llg.TokenizerWrapper(_TokenTable(tokenizer, eos[0])), eos_token=eos)


def ll_tokenizer(tokenizer):
    """llguidance's ``LLTokenizer`` for a `metalnn.llm.tokenizer.Tokenizer` (built once per
    tokenizer object and kept while it lives; its end-of-sequence set is ``eos_token_ids``)."""
    with _compiling:
        found = _compiled.get(tokenizer)
        if found is None:
            found = _compiled[tokenizer] = _build_tokenizer(tokenizer)
        return found


def json_schema_grammar(schema: dict, strict: bool = True) -> str:
    """llguidance's grammar for a JSON schema (compact JSON, `COMPACT_JSON`). ``strict=False``:
    keywords llguidance does not implement are ignored instead of refused."""
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    options = dict(COMPACT_JSON, lenient=not strict)
    try:
        return _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"JSON schema: {e}") from None


class GrammarConstraint:
    """Keep one sequence's tokens inside a grammar (a logits processor; see the module docs).

    Args:
        tokenizer: the model's `metalnn.llm.tokenizer.Tokenizer`.
        grammar: an llguidance grammar (``llguidance.grammar_from(...)``, or use the class methods
            `json_object`, `json_schema`, `regex`, `lark`).
    Raises:
        GrammarError: llguidance refuses the grammar (its message says where).
    """

    def __init__(self, tokenizer, grammar: str):
        llg = _llguidance()
        self.tokenizer = ll_tokenizer(tokenizer)
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise GrammarError(messages[0].strip())
        self._matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error().strip())
        self.vocab_size = self.tokenizer.vocab_size
        self._words = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)  # the mask, 32 tokens a word

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def json_object(cls, tokenizer) -> "GrammarConstraint":
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls(tokenizer, json_schema_grammar({"type": "object"}))

    @classmethod
    def json_schema(cls, tokenizer, schema: dict, strict: bool = True) -> "GrammarConstraint":
        """JSON valid under ``schema``. ``strict=False`` ignores the keywords llguidance does not
        implement; ``strict=True`` refuses such a schema (`GrammarError`)."""
        return cls(tokenizer, json_schema_grammar(schema, strict))

    @classmethod
    def regex(cls, tokenizer, pattern: str) -> "GrammarConstraint":
        """Text that fully matches ``pattern`` (Rust ``regex`` syntax)."""
        return cls(tokenizer, _llguidance().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def lark(cls, tokenizer, text: str) -> "GrammarConstraint":
        """Text of a Lark grammar in llguidance's syntax (``start: ...``; ``%json {...}`` embeds a
        JSON schema, ``/.../`` a regular expression)."""
        return cls(tokenizer, _llguidance().LLMatcher.grammar_from_lark(text))

    # -- the processor -------------------------------------------------------------------------
    def allowed(self) -> np.ndarray:
        """Which tokens may come next: ``[vocab_size]`` bool (llguidance's vocabulary)."""
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed: {self._matcher.get_error().strip()}")
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        return np.unpackbits(self._words.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)

    def __call__(self, logits: mx.array) -> mx.array:
        """``logits`` ``[V]`` with the tokens the grammar does not allow next set to ``-inf``. A model
        vocabulary larger than the tokenizer's (padding rows) has the extra tokens disallowed."""
        allowed = self.allowed()
        size = logits.shape[-1]
        if size > allowed.size:
            allowed = np.concatenate([allowed, np.zeros(size - allowed.size, dtype=bool)])
        # An additive bias, 0 (allowed) or -inf, made from the bits: (allowed - 1) is 0 or all ones,
        # and all ones & 0xFF800000 is -inf's float32 bit pattern. (On the CPU backend this and an
        # add cost a third of what mx.where does.)
        bias = np.subtract(allowed[:size].view(np.uint8), 1, dtype=np.int32)
        bias &= np.int32(-0x800000)  # 0xFF800000 as int32
        bias = mx.array(bias.view(np.float32))
        return logits + (bias if logits.dtype == mx.float32 else bias.astype(logits.dtype))

    def accept(self, token: int) -> None:
        """Advance past ``token`` (the one sampled). Tokens after the end (a finished row of a
        batch) are ignored; a token the grammar does not allow is a `GrammarError`."""
        if self._matcher.is_stopped() and not self._matcher.is_error():
            return
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {int(token)} ({self.tokenizer.dbg_tokens([int(token)])}) is not allowed here: "
                               f"{self._matcher.get_error().strip()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but an end-of-sequence token may follow."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete match (it may still go on)."""
        return self._matcher.is_accepting()

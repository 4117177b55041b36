"""Log-probabilities in OpenAI's response shapes: `TokenText` (each token's own text and bytes),
`chat_logprobs` (``choices[i].logprobs`` of chat completions) and `CompletionLogprobs` (the legacy
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` of text completions).

The values are `metalnn.llm.sampling.TokenChoice` s: the log-softmax of the processed logits (after
bias and penalties, before temperature and truncation). JSON has no infinity: a token that cannot
be chosen at all is reported with `IMPOSSIBLE` (-9999.0, the value OpenAI uses for it).
"""

from __future__ import annotations

import codecs
import json
import math
import re

#: the log-probability reported for a token of probability 0
IMPOSSIBLE = -9999.0

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict:
    """GPT-2's byte-level alphabet reversed: the printable character each byte is written as -> the byte
    (the table of the ``tokenizers`` ByteLevel pre-tokenizer and decoder)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_kinds(spec) -> set:
    """The ``type`` s of a ``tokenizers`` decoder spec, a ``Sequence``'s included, plus ``"Metaspace"``
    for a ``Replace`` of SentencePiece's word marker."""
    if not isinstance(spec, dict):
        return set()
    kinds = {spec.get("type")}
    if spec.get("type") == "Replace" and (spec.get("pattern") or {}).get("String") == "\u2581":
        kinds.add("Metaspace")
    for inner in spec.get("decoders") or ():
        kinds |= _decoder_kinds(inner)
    return kinds


class TokenText:
    """Each token's own bytes and text, as OpenAI's logprobs report them (cached per token).

    A byte-level tokenizer (GPT-2, Llama 3, Qwen, SmolLM) writes a token's bytes as printable
    characters: they are mapped back exactly, so a token holding half of a character has just those
    bytes (its ``text`` then shows U+FFFD). SentencePiece's ``<0xNN>`` byte tokens and ``\u2581`` word
    marker are read likewise; any other tokenizer's token is its own decoding. Special tokens are
    their text as written.

    Args:
        tokenizer: a `metalnn.llm.tokenizer.Tokenizer`.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer.tokenizer
        kinds = _decoder_kinds(json.loads(self.tokenizer.to_str()).get("decoder"))
        self._bytes_of = _byte_decoder() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds
        self._metaspace = "Metaspace" in kinds
        self._special = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        self._cache: dict[int, tuple[bytes, str]] = {}

    def _compute(self, token: int) -> bytes:
        piece = self.tokenizer.id_to_token(token)
        if piece is None:
            return b""
        if token in self._special:
            return piece.encode()
        if self._bytes_of is not None and all(c in self._bytes_of for c in piece):
            return bytes(self._bytes_of[c] for c in piece)
        if self._byte_fallback:
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
        if self._metaspace:
            return piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token], skip_special_tokens=False).encode()

    def special(self, token: int) -> bool:
        """Whether the token is a special token (reported, but not part of the answer's text)."""
        return int(token) in self._special

    def get(self, token: int) -> tuple[bytes, str]:
        """``(bytes, text)`` of one token."""
        found = self._cache.get(token)
        if found is None:
            raw = self._compute(int(token))
            found = self._cache[token] = (raw, raw.decode("utf-8", errors="replace"))
        return found


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else IMPOSSIBLE


def chat_logprobs(choices, text: TokenText) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`` for
    `TokenChoice` s (OpenAI's ``choices[i].logprobs`` of chat, whole or per stream chunk)."""

    def entry(token, logprob):
        raw, shown = text.get(token)
        return {"token": shown, "logprob": _finite(logprob), "bytes": list(raw)}

    return {"content": [{**entry(c.token, c.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in c.top_logprobs or ()]} for c in choices]}


class CompletionLogprobs:
    """The legacy ``logprobs`` object of one text completion choice, built chunk by chunk.

    ``text_offset`` counts characters from the start of the prompt, as OpenAI's does (with or
    without ``echo``): the first generated token's offset is the prompt's length. A special token
    (not part of the text) takes no room.

    Args:
        text: the server's `TokenText`.
        prompt_chars: the prompt's length in characters.
    """

    def __init__(self, text: TokenText, prompt_chars: int):
        self.text, self.offset = text, int(prompt_chars)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def chunk(self, choices) -> dict:
        """``{tokens, token_logprobs, top_logprobs, text_offset}`` of the next `TokenChoice` s."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in choices:
            raw, shown = self.text.get(c.token)
            out["tokens"].append(shown)
            out["token_logprobs"].append(_finite(c.logprob))
            out["top_logprobs"].append({self.text.get(t)[1]: _finite(lp) for t, lp in c.top_logprobs or ()})
            out["text_offset"].append(self.offset)
            if not self.text.special(c.token):
                self.offset += len(self._utf8.decode(raw))  # a character split over tokens counts once, whole
        return out

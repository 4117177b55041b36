"""A ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.ggml.*`` metadata.

Two vocabulary kinds (``tokenizer.ggml.model``):

* ``"gpt2"``: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM, ...): the tokens spelled in GPT-2's
  byte alphabet, the merges list, and a pre-tokenizer split chosen by ``tokenizer.ggml.pre``.
* ``"llama"``: SentencePiece BPE (Llama 1/2, Mistral, ...): ``▁`` for spaces, byte fallback to
  the ``<0xXX>`` tokens; merges from the file, or derived from the token scores when absent.

Tokens of type CONTROL become special tokens (kept whole, skipped when decoding with
``skip_special_tokens``), USER_DEFINED ones plain added tokens. A BOS token is prepended when
``tokenizer.ggml.add_bos_token`` says so (default: yes for ``"llama"``, no for ``"gpt2"``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from itertools import repeat

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
#: ``tokenizer.ggml.pre`` -> the regex splitting text before byte-level BPE (others: GPT-2's split)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
#: ``tokenizer.ggml.pre`` values whose text is split into single digits before GPT-2's split (llama.cpp's
#: SmolLM pre-tokenizer: ``\p{N}`` first, then GPT-2's expression; SmolLM's own tokenizer.json does the
#: same with ``Digits(individual_digits=True)`` before ``ByteLevel``)
SINGLE_DIGIT_PRE = {"smollm"}


def _tokenizers():
    import tokenizers

    return tokenizers


@lru_cache(maxsize=1)
def byte_alphabet() -> dict:
    """GPT-2's byte -> printable character table (bytes 33-126, 161-172, 174-255 map to
    themselves; the others to U+0100 onwards, in order)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def merges_from_scores(tokens, scores) -> list:
    """SentencePiece BPE merges implied by a vocabulary: every split of a token into two tokens of
    the vocabulary, best-scored token first (ties: shorter left, then shorter right piece)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        pairs.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found.extend((left, right, score) for left, right in pairs)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


class MergePairs(Sequence):
    """``tokenizer.ggml.merges`` (``"left right"`` strings) as ``(left, right)`` pairs, split when read,
    so that ``tokenizers`` copies them without a list of ~100,000 strings being made first (whose
    freed memory the process would keep). Raises ValueError for an entry that is not two tokens
    separated by one space."""

    def __init__(self, merges):
        if len(merges) and set(map(str.count, merges, repeat(" "))) != {1}:
            bad = next(m for m in merges if m.count(" ") != 1)
            raise ValueError(f"tokenizer.ggml.merges: entry {bad!r} is not two tokens separated by one space")
        self.merges = merges

    def __len__(self) -> int:
        return len(self.merges)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [tuple(m.split(" ")) for m in self.merges[i]]
        return tuple(self.merges[i].split(" "))

    def __iter__(self):
        return map(tuple, map(str.split, self.merges, repeat(" ")))


@lru_cache(maxsize=1)
def _outside_byte_alphabet():
    """A regex finding a character outside GPT-2's byte alphabet."""
    return re.compile("[^" + "".join(map(re.escape, sorted(byte_alphabet().values()))) + "]")


def byte_level_vocab(tokens) -> dict:
    """``{token: id}`` for byte-level BPE, each token in GPT-2's byte alphabet: a token written in other
    characters (plain UTF-8 text) is spelled byte by byte. A token listed twice keeps its last id."""
    vocab = dict(zip(tokens, range(len(tokens))))
    odd = list(filter(_outside_byte_alphabet().search, vocab))
    if odd:
        alphabet = byte_alphabet()
        for tok in odd:
            vocab["".join(alphabet[b] for b in tok.encode("utf-8"))] = vocab.pop(tok)
    return vocab


def _byte_level(meta):
    t = _tokenizers()
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = byte_level_vocab(tokens)
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        merges = merges_from_scores(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    else:
        merges = MergePairs(merges)
    tok = t.Tokenizer(t.models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre")
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if pre in SINGLE_DIGIT_PRE:
        tok.pre_tokenizer = t.pre_tokenizers.Sequence([
            t.pre_tokenizers.Digits(individual_digits=True),
            t.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif split is None:
        tok.pre_tokenizer = t.pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = t.pre_tokenizers.Sequence([
            t.pre_tokenizers.Split(t.Regex(split), behavior="isolated"),
            t.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = t.decoders.ByteLevel()
    return tok, True


def _sentencepiece(meta):
    t = _tokenizers()
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = dict(zip(tokens, range(len(tokens))))
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        merges = merges_from_scores(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    else:
        merges = MergePairs(merges)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    tok = t.Tokenizer(t.models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.pre_tokenizer = t.pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = t.decoders.Sequence([t.decoders.Replace("\u2581", " "), t.decoders.ByteFallback(), t.decoders.Fuse(),
                                       t.decoders.Strip(content=" ", left=1, right=0)])
    return tok, False


BUILDERS = {"gpt2": _byte_level, "llama": _sentencepiece}


def special_token(meta, key):
    """The token string of ``tokenizer.ggml.<key>`` (e.g. ``eos_token_id``), or None."""
    i = meta.get(f"tokenizer.ggml.{key}")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def add_bos(meta) -> bool:
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def build(meta: dict, source: str = "GGUF"):
    """``tokenizers.Tokenizer`` for GGUF metadata. Raises ValueError naming ``source`` for a
    vocabulary kind other than ``gpt2`` / ``llama`` or missing tokens."""
    t = _tokenizers()
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{source}: no tokenizer in this GGUF file (tokenizer.ggml.tokens missing)")
    if kind not in BUILDERS:
        raise ValueError(f"{source}: tokenizer.ggml.model {kind!r} is not supported (supported: {sorted(BUILDERS)})")
    tok, byte_level = BUILDERS[kind](meta)
    tokens = meta["tokenizer.ggml.tokens"]
    types = (meta.get("tokenizer.ggml.token_type") or [])[:len(tokens)]

    def of_type(kind):  # (only the few tokens of that type are read)
        return [tokens[i] for i, k in enumerate(types) if k == kind]

    control = [t.AddedToken(s, normalized=False, special=True) for s in of_type(CONTROL)
               if not byte_level or _outside_byte_alphabet().search(s) is None]
    if control:
        tok.add_special_tokens(control)
    user = [t.AddedToken(s, normalized=False, special=False) for s in of_type(USER_DEFINED)
            if tok.token_to_id(s) is not None]
    if user:
        tok.add_tokens(user)
    bos = special_token(meta, "bos_token_id")
    eos = special_token(meta, "eos_token_id")
    use_bos = add_bos(meta) and bos is not None
    use_eos = bool(meta.get("tokenizer.ggml.add_eos_token")) and eos is not None

    def sequence(name, type_id):
        return " ".join(([f"{bos}:{type_id}"] if use_bos else []) + [f"${name}:{type_id}"]
                        + ([f"{eos}:{type_id}"] if use_eos else []))

    specials = ([(bos, meta["tokenizer.ggml.bos_token_id"])] if use_bos else []) + (
        [(eos, meta["tokenizer.ggml.eos_token_id"])] if use_eos and eos != bos else [])
    single, pair = sequence("A", 0), sequence("A", 0) + " " + sequence("B", 1)
    tok.post_processor = t.processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return tok

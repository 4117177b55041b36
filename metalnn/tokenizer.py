"""Tokenizers: Hugging Face ``tokenizer.json`` files through the ``tokenizers`` library.

`load_tokenizer(folder)` reads ``tokenizer.json`` (and the special tokens named in
``tokenizer_config.json`` / ``config.json``); `char_tokenizer(text)` builds a character-level
tokenizer that is saved as an ordinary ``tokenizer.json``.
"""

from __future__ import annotations

import json
from pathlib import Path


def _tokenizers():
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - listed as a dependency
        raise ImportError("metalnn tokenizers need the 'tokenizers' package: pip install tokenizers") from None
    return tokenizers


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` with ``encode``/``decode`` on plain lists.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        eos_token_id, bos_token_id: special token ids (None when unknown).
    """

    def __init__(self, tokenizer, eos_token_id=None, bos_token_id=None):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str):
        return self.tokenizer.token_to_id(token)

    def save(self, folder) -> Path:
        """Write ``tokenizer.json`` (and a minimal ``tokenizer_config.json``) into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(folder / "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        for name, tid in (("eos_token", self.eos_token_id), ("bos_token", self.bos_token_id)):
            if tid is not None:
                cfg[name] = self.tokenizer.id_to_token(tid)
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return folder / "tokenizer.json"

    def __repr__(self):
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_token_id={self.eos_token_id})"


def _special_id(tok, value):
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, int):
        return value
    return tok.token_to_id(value) if isinstance(value, str) else None


def load_tokenizer(path) -> Tokenizer:
    """Load ``tokenizer.json`` from a model folder (or the file itself).

    Raises ``FileNotFoundError`` when there is none.
    """
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"{path}: no tokenizer.json")
    tok = _tokenizers().Tokenizer.from_file(str(file))
    folder = file.parent
    eos = bos = None
    tc = folder / "tokenizer_config.json"
    if tc.exists():
        cfg = json.loads(tc.read_text())
        eos, bos = _special_id(tok, cfg.get("eos_token")), _special_id(tok, cfg.get("bos_token"))
    mc = folder / "config.json"
    if mc.exists():
        cfg = json.loads(mc.read_text())
        if eos is None and isinstance(cfg.get("eos_token_id"), int):
            eos = cfg["eos_token_id"]
        if bos is None and isinstance(cfg.get("bos_token_id"), int):
            bos = cfg["bos_token_id"]
    return Tokenizer(tok, eos_token_id=eos, bos_token_id=bos)


def char_tokenizer(text_or_chars, unk_token: str | None = None) -> Tokenizer:
    """A character-level tokenizer: one id per distinct character of ``text_or_chars`` (sorted).

    Built with the ``tokenizers`` library (a word-level model over single characters), so it saves
    and loads as a normal ``tokenizer.json``. Ids are the sorted characters' ranks; an
    ``unk_token`` (if given) takes the next id.
    """
    t = _tokenizers()
    chars = sorted(set(text_or_chars))
    vocab = {c: i for i, c in enumerate(chars)}
    if unk_token is None:
        unk_token = "<unk>"
    vocab.setdefault(unk_token, len(vocab))
    tok = t.Tokenizer(t.models.WordLevel(vocab, unk_token=unk_token))
    tok.pre_tokenizer = t.pre_tokenizers.Split(t.Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = t.decoders.Fuse()
    return Tokenizer(tok)

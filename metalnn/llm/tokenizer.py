"""Tokenizers: Hugging Face ``tokenizer.json`` files and GGUF metadata through ``tokenizers``.

`load_tokenizer(path)` reads a model folder's ``tokenizer.json`` (with the special tokens and chat
template of ``tokenizer_config.json``, and the EOS ids of ``config.json`` /
``generation_config.json``), or builds the tokenizer a ``.gguf`` file describes
(`metalnn.llm.gguf.tokenizer`), or fetches the tokenizer files of a Hub name (``"org/name"``).
`char_tokenizer(text)` builds a character-level tokenizer that is saved as an ordinary
``tokenizer.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

#: tokens that end a turn in common chat formats; generation stops at those the chat template uses
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _tokenizers():
    try:
        import tokenizers
    except ImportError:  # pragma: no cover - listed as a dependency
        raise ImportError("metalnn tokenizers need the 'tokenizers' package: pip install tokenizers") from None
    return tokenizers


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer`` with ``encode``/``decode`` on plain lists, the
    chat template and the end-of-sequence set.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        eos_token_id, bos_token_id: special token ids (None when unknown).
        chat_template: Jinja source of the chat template (None: the model has none).
        special_tokens: ``{"bos_token": "<s>", "eos_token": "</s>", ...}`` as the template sees them.
        eos_token_ids: every id that ends generation (default: ``{eos_token_id}``).
    """

    def __init__(self, tokenizer, eos_token_id=None, bos_token_id=None, *, chat_template: str | None = None,
                 special_tokens: dict | None = None, eos_token_ids=None):
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._more_eos = frozenset(int(i) for i in (eos_token_ids or ()))

    @property
    def eos_token_ids(self) -> frozenset:
        """Every token id that ends generation: ``eos_token_id`` plus the checkpoint's other
        end ids (config lists, end-of-turn tokens of the chat template)."""
        return self._more_eos | ({int(self.eos_token_id)} if self.eos_token_id is not None else set())

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str):
        return self.tokenizer.token_to_id(token)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, *, tools=None, tokenize: bool = True,
                            **variables):
        """The prompt for a conversation: token ids (or the text with ``tokenize=False``).

        Args:
            messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
            add_generation_prompt: end with the opening of an assistant turn (for generating the
                reply).
            tools: tool descriptions (JSON schemas) for templates that support them.
            variables: more template variables (e.g. ``enable_thinking=False``).
        Returns:
            ``list[int]`` (the rendered text encoded without adding special tokens: the template
            writes them), or ``str``.
        Raises:
            ValueError: the tokenizer has no chat template; `ChatTemplateError` for template errors.
        """
        from .chat_template import render

        if not self.chat_template:
            raise ValueError("apply_chat_template: this tokenizer has no chat template (tokenizer_config.json "
                             "'chat_template', chat_template.jinja or the GGUF 'tokenizer.chat_template')")
        text = render(self.chat_template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                      **{**self.special_tokens, **variables})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save(self, folder) -> Path:
        """Write ``tokenizer.json`` (and a ``tokenizer_config.json`` with the special tokens and
        chat template) into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(folder / "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        cfg.update(self.special_tokens)
        for name, tid in (("eos_token", self.eos_token_id), ("bos_token", self.bos_token_id)):
            if tid is not None:
                cfg[name] = self.tokenizer.id_to_token(tid)
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return folder / "tokenizer.json"

    def __repr__(self):
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={sorted(self.eos_token_ids)}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")


def _special_id(tok, value):
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, int):
        return value
    return tok.token_to_id(value) if isinstance(value, str) else None


def _special_text(value):
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> list:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def end_of_turn_ids(template: str | None, token_to_id) -> set:
    """Ids of the `END_OF_TURN_TOKENS` that ``template`` writes (and the vocabulary has)."""
    if not template:
        return set()
    ids = (token_to_id(t) for t in END_OF_TURN_TOKENS if t in template)
    return {i for i in ids if i is not None}


def _read_json(file: Path):
    if not file.exists():
        return {}
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None


def _folder_chat_template(folder: Path, cfg: dict):
    for name in ("chat_template.jinja",):
        if (folder / name).exists():
            return (folder / name).read_text()
    template = cfg.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def tokenizer_from_gguf(header) -> Tokenizer:
    """The `Tokenizer` of a GGUF file (a `metalnn.llm.gguf.reader.GGUFHeader`): vocabulary, special
    tokens, chat template and EOS set (EOS, end-of-turn and end-of-message ids)."""
    from .gguf import tokenizer as gt

    meta = header.metadata
    tok = gt.build(meta, source=str(header.path))
    template = meta.get("tokenizer.chat_template")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    special = {name: gt.special_token(meta, key) for name, key in
               (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                ("pad_token", "padding_token_id"))}
    return Tokenizer(tok, eos_token_id=eos, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                     chat_template=template, special_tokens=special, eos_token_ids=gguf_eos_ids(meta))


def gguf_eos_ids(meta: dict) -> frozenset:
    """The EOS set of GGUF metadata without building the tokenizer: the EOS, end-of-turn and
    end-of-message ids, and the `END_OF_TURN_TOKENS` the chat template writes."""
    if "tokenizer.ggml.tokens" not in meta:
        return frozenset()
    tokens = meta["tokenizer.ggml.tokens"]

    def token_to_id(token):
        try:
            return tokens.index(token)
        except ValueError:
            return None

    ids = set()
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        ids |= set(_ids(meta.get(f"tokenizer.ggml.{key}")))
    return frozenset(ids | end_of_turn_ids(meta.get("tokenizer.chat_template"), token_to_id))


def load_tokenizer(path) -> Tokenizer:
    """The tokenizer of a model: a folder's ``tokenizer.json`` (or the file itself), a ``.gguf``
    file (or a folder holding one and no ``tokenizer.json``), or a Hub name ``"org/name"``
    (its tokenizer files, through ``huggingface_hub``).

    Raises ``FileNotFoundError`` when there is no tokenizer.
    """
    from .gguf.reader import find_gguf, read_header
    from .hub import TOKENIZER_FILES, local_path

    path = local_path(path, TOKENIZER_FILES)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.exists() or file.suffix == ".gguf":
        gguf = find_gguf(path)
        if gguf is not None:
            return tokenizer_from_gguf(read_header(gguf))
        raise FileNotFoundError(f"{path}: no tokenizer.json (or .gguf file)")
    tok = _tokenizers().Tokenizer.from_file(str(file))
    folder = file.parent
    cfg = _read_json(folder / "tokenizer_config.json")
    special = {name: _special_text(cfg.get(name)) for name in _SPECIAL_NAMES}
    eos, bos = _special_id(tok, cfg.get("eos_token")), _special_id(tok, cfg.get("bos_token"))
    ids = set(_ids(eos))
    for extra in (_read_json(folder / "config.json"), _read_json(folder / "generation_config.json")):
        ids |= set(_ids(extra.get("eos_token_id")))
        if eos is None and _ids(extra.get("eos_token_id")):
            eos = _ids(extra.get("eos_token_id"))[0]
        if bos is None and _ids(extra.get("bos_token_id")):
            bos = _ids(extra.get("bos_token_id"))[0]
    template = _folder_chat_template(folder, cfg)
    ids |= end_of_turn_ids(template, tok.token_to_id)
    return Tokenizer(tok, eos_token_id=eos, bos_token_id=bos, chat_template=template, special_tokens=special,
                     eos_token_ids=ids)


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

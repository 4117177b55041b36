"""Preference data for DPO, ORPO and KTO: TRL's formats, tokenised, truncated and batched as TRL 1.13 does.

Each line of a ``.jsonl`` file is one example, standard (strings) or conversational (lists of
``{"role", "content"}`` messages):

* paired (DPO, ORPO): ``{"prompt", "chosen", "rejected"}``, or ``{"chosen", "rejected"}`` with the
  prompt implicit (the longest common start of the two is the prompt, as TRL's ``extract_prompt``);
* unpaired (KTO): ``{"prompt", "completion", "label"}`` (``label`` true: desirable); paired lines
  are unpaired as TRL's ``unpair_preference_dataset`` does (per 1,000 lines: their chosen completions
  labelled true, then their rejected ones labelled false).

Tokenisation follows TRL 1.13 (`trl/trainer/dpo_trainer.py`, `kto_trainer.py`, and the older
`trl/experimental/orpo/orpo_trainer.py` for ORPO):

* DPO and KTO: a standard prompt is encoded with the tokenizer's special tokens (a BOS where the
  tokenizer adds one), and the completion is what ``encode(prompt + completion)`` adds after the
  prompt's tokens, the EOS text appended to the completion first (unless it ends with it); a
  conversational prompt goes through the chat template with the generation prompt and the
  completion is what the template adds for ``prompt + completion`` messages (no EOS added: the
  template closes the turn). ``max_length`` cuts each prompt + completion sequence
  (``truncation_mode`` ``keep_start``: its first tokens; ``keep_end``: its last, DPO only), and
  examples whose prompt alone fills ``max_length`` are left out (with ``keep_start``).
* ORPO: conversational examples are rendered to text with the chat template first; prompt and
  completions are encoded without special tokens (the prompt's last token may merge into the
  completion's first: then it counts as completion), a BOS is put in front where the tokenizer has
  one and the prompt does not start with it, the EOS id appended to each completion unless it ends
  with it; when prompt + the longer completion exceed ``max_length`` the completions are cut to
  ``max_length - len(longer completion)`` tokens (TRL's rule, kept as it is).

`PreferenceDataset.batches` gives a data source for `metalnn.Trainer` in file order (no shuffling,
as TRL with a sequential sampler; the last batch of an epoch may be smaller). A batch is a dict of
arrays, rows right-padded with ``pad_id``:

* paired: ``input_ids`` ``[2B, T]`` (the B chosen rows, then the B rejected rows),
  ``completion_mask`` and ``attention_mask`` ``[2B, T]``, and with precomputed reference
  log-probabilities ``ref_chosen_logps`` / ``ref_rejected_logps`` ``[B]``;
* unpaired: ``input_ids``, ``completion_mask``, ``attention_mask`` ``[B, T]``, ``label`` ``[B]``
  (1.0 desirable), ``KL_input_ids`` / ``KL_completion_mask`` ``[B, T']``: the mismatched pairs of
  KTO's KL estimate (each prompt with the completion of the example before it in its batch, the
  first with the last's, as TRL builds them), and with precomputed reference log-probabilities
  ``ref_logps`` / ``ref_KL_logps`` ``[B]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path

import mlx.core as mx
import numpy as np

from .datasets import DatasetError

METHODS = ("dpo", "orpo", "kto")
TRUNCATION_MODES = ("keep_start", "keep_end")
_UNPAIR_CHUNK = 1000  # rows per `datasets.map` batch in TRL's unpair_preference_dataset


@dataclass(frozen=True)
class PairedExample:
    """A tokenised preference pair. ``rejected_prompt_ids`` differs from ``prompt_ids`` only with
    ORPO's tokenisation (a prompt token merged into one completion but not the other); None: the same.
    ``ref_chosen_logps`` / ``ref_rejected_logps``: precomputed reference log-probabilities."""

    prompt_ids: tuple
    chosen_ids: tuple
    rejected_ids: tuple
    rejected_prompt_ids: tuple | None = None
    ref_chosen_logps: float | None = None
    ref_rejected_logps: float | None = None


@dataclass(frozen=True)
class UnpairedExample:
    """A tokenised KTO example: prompt, completion and whether the completion is desirable."""

    prompt_ids: tuple
    completion_ids: tuple
    label: bool


# -- TRL's format helpers ----------------------------------------------------------------------
def is_conversational(record: dict) -> bool:
    """TRL's test: a prompt/chosen/rejected/completion field holding a list of role messages."""
    for key in ("prompt", "chosen", "rejected", "completion"):
        value = record.get(key)
        if isinstance(value, list) and value:
            return isinstance(value[0], dict) and "role" in value[0]
    return False


def extract_prompt(chosen, rejected):
    """TRL's ``extract_prompt``: the longest common start of ``chosen`` and ``rejected`` (strings or
    message lists) is the prompt (a space before the first difference stays with the completions).
    Returns ``(prompt, chosen, rejected)``."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def eos_text(tokenizer) -> str:
    """The EOS token's text (what TRL appends to standard completions)."""
    text = getattr(tokenizer, "special_tokens", {}).get("eos_token")
    if text is None and getattr(tokenizer, "eos_token_id", None) is not None:
        text = tokenizer.tokenizer.id_to_token(int(tokenizer.eos_token_id))
    if text is None:
        raise DatasetError("the tokenizer has no EOS token, which standard-format completions end with")
    return text


def pad_id(tokenizer) -> int:
    """Padding id: the tokenizer's pad token, else its EOS (TRL's choice); padded positions are
    never trained or measured."""
    pid = getattr(tokenizer, "pad_token_id", None)
    if pid is None:
        pid = getattr(tokenizer, "eos_token_id", None)
    return int(pid) if pid is not None else 0


def _template(tokenizer, messages, add_generation_prompt, where, record, tokenize=True):
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError(f"{where}: conversational examples need a tokenizer with a chat template")
    kwargs = dict(record.get("chat_template_kwargs") or {})
    tools = record.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tools=tools or None, tokenize=tokenize, **kwargs)
    except Exception as e:  # a template's own error (raise_exception, undefined fields)
        raise DatasetError(f"{where}: the chat template failed on this example: {e}") from e


def _check_messages(value, field, where):
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: '{field}' must be a non-empty list of {{role, content}} messages "
                           "(a conversational example)")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: {field}[{i}] must be an object with string 'role' and 'content', "
                               f"got {m!r}"[:300])


def _check_fields(record, fields, conversational, where):
    for field in fields:
        if field not in record:
            raise DatasetError(f"{where}: missing field '{field}' (expected {', '.join(fields)})")
        value = record[field]
        if conversational:
            _check_messages(value, field, where)
        elif not isinstance(value, str):
            raise DatasetError(f"{where}: '{field}' must be a string (a standard example) like the others, got "
                               f"{type(value).__name__}")


def _with_prompt(record, where):
    """The record with an explicit prompt (extracted from chosen/rejected when implicit)."""
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "prompt" in record:
        return record
    if "chosen" not in record or "rejected" not in record:
        raise DatasetError(f"{where}: expected 'prompt', 'chosen' and 'rejected' fields (or 'chosen' and "
                           f"'rejected' with the prompt implicit), got {sorted(record)}")
    conv = is_conversational(record)
    _check_fields(record, ("chosen", "rejected"), conv, where)
    prompt, chosen, rejected = extract_prompt(record["chosen"], record["rejected"])
    if not prompt:
        raise DatasetError(f"{where}: 'chosen' and 'rejected' share no start, so the implicit prompt is empty")
    return {**record, "prompt": prompt, "chosen": chosen, "rejected": rejected}


def _split(tokenizer, record, completion_field, conversational, where):
    """(prompt_ids, completion_ids) as TRL's DPO and KTO tokenise them."""
    prompt, completion = record["prompt"], record[completion_field]
    if conversational:
        prompt_ids = _template(tokenizer, prompt, True, where, record)
        full = _template(tokenizer, prompt + completion, False, where, record)
    else:
        eos = eos_text(tokenizer)
        if not completion.endswith(eos):
            completion = completion + eos
        prompt_ids = tokenizer.encode(prompt)
        full = tokenizer.encode(prompt + completion)
    return tuple(prompt_ids), tuple(full[len(prompt_ids):])


# -- DPO / KTO ---------------------------------------------------------------------------------
def tokenize_pair(tokenizer, record: dict, where: str = "example") -> PairedExample:
    """A DPO example, as TRL's DPOTrainer tokenises it."""
    record = _with_prompt(record, where)
    conv = is_conversational(record)
    _check_fields(record, ("prompt", "chosen", "rejected"), conv, where)
    prompt_ids, chosen = _split(tokenizer, record, "chosen", conv, where)
    _, rejected = _split(tokenizer, record, "rejected", conv, where)
    return PairedExample(prompt_ids, chosen, rejected)


def tokenize_unpaired(tokenizer, record: dict, where: str = "example") -> UnpairedExample:
    """A KTO example ``{"prompt", "completion", "label"}``, as TRL's KTOTrainer tokenises it."""
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    conv = is_conversational(record)
    _check_fields(record, ("prompt", "completion"), conv, where)
    label = record.get("label")
    if not isinstance(label, bool):
        raise DatasetError(f"{where}: 'label' must be true (desirable) or false (undesirable), got {label!r}")
    prompt_ids, completion = _split(tokenizer, record, "completion", conv, where)
    return UnpairedExample(prompt_ids, completion, label)


# -- ORPO (TRL's older tokenisation) -----------------------------------------------------------
def _orpo_text(tokenizer, record, where):
    """Conversational ORPO examples as text, as TRL's ``maybe_apply_chat_template``."""
    prompt = record["prompt"]
    if prompt[-1]["role"] not in ("user", "tool"):
        raise DatasetError(f"{where}: a conversational ORPO prompt must end with a user (or tool) message, got "
                           f"{prompt[-1]['role']!r}")
    text = _template(tokenizer, prompt, True, where, record, tokenize=False)
    chosen = _template(tokenizer, prompt + record["chosen"], False, where, record, tokenize=False)
    rejected = _template(tokenizer, prompt + record["rejected"], False, where, record, tokenize=False)
    for full in (chosen, rejected):
        text = "".join(a for a, _ in takewhile(lambda ab: ab[0] == ab[1], zip(text, full)))
    return text, chosen[len(text):], rejected[len(text):]


def _orpo_answer(tokenizer, prompt, answer):
    """TRL's ``build_tokenized_answer``: (prompt ids, answer ids) of ``prompt + answer``."""
    full = tokenizer.encode(prompt + answer, add_special_tokens=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    start = len(prompt_ids)
    if prompt_ids != full[:start]:
        start -= 1
    return list(full[:start]), list(full[start:])


def tokenize_orpo_pair(tokenizer, record: dict, max_length: int | None = 1024,
                       where: str = "example") -> PairedExample:
    """An ORPO example, as TRL's ORPOTrainer tokenises it (truncation included, see the module
    docstring)."""
    record = _with_prompt(record, where)
    conv = is_conversational(record)
    _check_fields(record, ("prompt", "chosen", "rejected"), conv, where)
    if conv:
        prompt, chosen, rejected = _orpo_text(tokenizer, record, where)
    else:
        prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
    c_prompt, c_ids = _orpo_answer(tokenizer, prompt, chosen)
    r_prompt, r_ids = _orpo_answer(tokenizer, prompt, rejected)
    if sum(a != b for a, b in zip(c_prompt, r_prompt)) > 1 or abs(len(c_prompt) - len(r_prompt)) > 1:
        raise DatasetError(f"{where}: the prompt tokenises differently before the chosen and the rejected "
                           "completion (more than its last token merges)")
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        c_prompt = c_prompt if c_prompt and c_prompt[0] == bos else [bos] + c_prompt
        r_prompt = r_prompt if r_prompt and r_prompt[0] == bos else [bos] + r_prompt
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DatasetError(f"{where}: the tokenizer has no EOS token, which ORPO completions end with")
    for ids in (c_ids, r_ids):
        if not ids or ids[-1] != eos:
            ids.append(int(eos))
    longer = max(len(c_ids), len(r_ids))
    if max_length is not None:
        if len(c_prompt) + longer > max_length:
            c_ids = c_ids[:max_length - longer]
        if len(r_prompt) + longer > max_length:
            r_ids = r_ids[:max_length - longer]
    return PairedExample(tuple(c_prompt), tuple(c_ids), tuple(r_ids),
                         rejected_prompt_ids=None if r_prompt == c_prompt else tuple(r_prompt))


# -- files -------------------------------------------------------------------------------------
def _records(path):
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such dataset file")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None


def _unpair(items):
    """TRL's ``unpair_preference_dataset`` on (where, record) items: per chunk of 1,000 paired
    records, their chosen completions (label true) then their rejected ones (label false)."""
    out = []
    for start in range(0, len(items), _UNPAIR_CHUNK):
        chunk = items[start:start + _UNPAIR_CHUNK]
        for field, label in (("chosen", True), ("rejected", False)):
            for where, r in chunk:
                rest = {k: v for k, v in r.items() if k not in ("chosen", "rejected")}
                out.append((where, {**rest, "completion": r[field], "label": label}))
    return out


def load_preference_data(path, tokenizer, method: str, max_length: int | None = 1024,
                         truncation_mode: str = "keep_start", limit: int | None = None) -> "PreferenceDataset":
    """Read and tokenise a ``.jsonl`` preference file for ``method`` (``dpo``, ``orpo``, ``kto``).

    Raises `DatasetError` naming the file, line and field of the first malformed line, or when no
    example is left (every prompt fills ``max_length``).
    """
    if method not in METHODS:
        raise ValueError(f"load_preference_data: method must be one of {', '.join(METHODS)}, got {method!r}")
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"load_preference_data: truncation_mode must be one of {', '.join(TRUNCATION_MODES)}, "
                         f"got {truncation_mode!r}")
    if method != "dpo" and truncation_mode != "keep_start":
        raise ValueError(f"load_preference_data: {method} keeps the start of long sequences (truncation_mode "
                         "'keep_start'), as TRL")
    items = []
    for where, record in _records(path):
        items.append((where, record))
        if limit is not None and len(items) >= limit:
            break
    if not items:
        raise DatasetError(f"{path}: no examples (the file is empty)")
    if method == "kto":
        items = [(w, _with_prompt(r, w)) if isinstance(r, dict) and "completion" not in r else (w, r)
                 for w, r in items]
        paired = [it for it in items if isinstance(it[1], dict) and "chosen" in it[1] and "rejected" in it[1]]
        if paired and len(paired) != len(items):
            raise DatasetError(f"{path}: mixes paired (chosen/rejected) and unpaired (completion/label) lines")
        if paired:
            items = _unpair(items)
        examples = [tokenize_unpaired(tokenizer, r, w) for w, r in items]
    elif method == "orpo":
        examples = [tokenize_orpo_pair(tokenizer, r, max_length, w) for w, r in items]
    else:
        examples = [tokenize_pair(tokenizer, r, w) for w, r in items]
    if max_length is not None and method != "orpo" and truncation_mode == "keep_start":
        examples = [e for e in examples if len(e.prompt_ids) < max_length]
        if not examples:
            raise DatasetError(f"{path}: every prompt fills max_length={max_length} tokens, leaving no example")
    return PreferenceDataset(examples, method, max_length, truncation_mode, pad_id(tokenizer))


class PreferenceDataset:
    """Tokenised preference examples of one method, ready to batch (see the module docstring)."""

    def __init__(self, examples, method: str, max_length: int | None = 1024, truncation_mode: str = "keep_start",
                 pad_id: int = 0):
        self.examples = list(examples)
        if not self.examples:
            raise DatasetError("the dataset holds no examples")
        self.method, self.max_length, self.truncation_mode, self.pad_id = method, max_length, truncation_mode, pad_id
        self.ref_logps = None  # precomputed reference log-probabilities: {"ref_...": np.ndarray per example}

    def __len__(self):
        return len(self.examples)

    @property
    def paired(self) -> bool:
        return self.method != "kto"

    def _cut(self, ids, mask):
        if self.max_length is None or self.method == "orpo":
            return ids, mask
        sl = slice(None, self.max_length) if self.truncation_mode == "keep_start" else slice(-self.max_length, None)
        return ids[sl], mask[sl]

    def _rows(self, pieces):
        """(prompt, completion) pieces -> input_ids, completion_mask, attention_mask arrays."""
        rows = [self._cut(list(p) + list(c), [0] * len(p) + [1] * len(c)) for p, c in pieces]
        width = max(2, max(len(ids) for ids, _ in rows))
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int32)
        comp = np.zeros((len(rows), width), dtype=np.float32)
        att = np.zeros((len(rows), width), dtype=np.float32)
        for r, (i, m) in enumerate(rows):
            ids[r, :len(i)], comp[r, :len(m)], att[r, :len(i)] = i, m, 1.0
        return ids, comp, att

    def collate(self, indices) -> dict:
        """The batch (dict of arrays, see the module docstring) of the examples at ``indices``; for
        KTO, ``indices`` is one whole batch (the KL pairs rotate within it)."""
        ex = [self.examples[i] for i in indices]
        out = {}
        if self.paired:
            pieces = [(e.prompt_ids, e.chosen_ids) for e in ex]
            pieces += [(e.rejected_prompt_ids or e.prompt_ids, e.rejected_ids) for e in ex]
            out["input_ids"], out["completion_mask"], out["attention_mask"] = self._rows(pieces)
        else:
            out["input_ids"], out["completion_mask"], out["attention_mask"] = self._rows(
                [(e.prompt_ids, e.completion_ids) for e in ex])
            completions = [e.completion_ids for e in ex]
            kl = [(e.prompt_ids, c) for e, c in zip(ex, completions[-1:] + completions[:-1])]
            out["KL_input_ids"], out["KL_completion_mask"], _ = self._rows(kl)
            out["label"] = np.asarray([1.0 if e.label else 0.0 for e in ex], dtype=np.float32)
        if self.ref_logps is not None:
            for k, v in self.ref_logps.items():
                out[k] = v[np.asarray(indices)]
        return {k: mx.array(v) for k, v in out.items()}

    def batch_indices(self, batch_size: int):
        """The examples of each batch of an epoch, in file order (the last may be smaller)."""
        if batch_size < 1:
            raise ValueError(f"batches: batch_size must be positive, got {batch_size}")
        n = len(self.examples)
        return [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]

    def batches(self, batch_size: int):
        """A data source ``f(step) -> batch`` for `metalnn.Trainer.fit`: the batches of
        `batch_indices` in order, epoch after epoch."""
        groups = self.batch_indices(batch_size)

        def source(step):
            return self.collate(groups[int(step) % len(groups)])

        source.groups = groups
        return source

    def with_ref_logps(self, values: dict) -> "PreferenceDataset":
        """A copy carrying precomputed reference log-probabilities (``{"ref_chosen_logps": [N], ...}``)."""
        other = PreferenceDataset(self.examples, self.method, self.max_length, self.truncation_mode, self.pad_id)
        other.ref_logps = {k: np.asarray(v, dtype=np.float32) for k, v in values.items()}
        for k, v in other.ref_logps.items():
            if v.shape != (len(self),):
                raise ValueError(f"with_ref_logps: '{k}' must hold one value per example ({len(self)}), got shape "
                                 f"{v.shape}")
        return other


def num_tokens(batch) -> int:
    """Tokens a batch feeds the model (TRL's ``num_tokens``: the attention mask's sum)."""
    return int(batch["attention_mask"].sum().item())


__all__ = ["PairedExample", "UnpairedExample", "PreferenceDataset", "load_preference_data", "tokenize_pair",
           "tokenize_unpaired", "tokenize_orpo_pair", "extract_prompt", "is_conversational", "num_tokens",
           "DatasetError"]

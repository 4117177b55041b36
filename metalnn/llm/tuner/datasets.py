"""Fine-tuning data: JSONL chat, completion and text datasets, tokenised, masked and batched.

Each line of a ``.jsonl`` file is one example, in one of the formats mlx-lm and the Hugging Face
trainers accept:

* ``{"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}``: a
  conversation, rendered with the tokenizer's chat template; the loss covers the assistant turns
  (with ``mask_prompt=True``, the default) or every token;
* ``{"prompt": ..., "completion": ...}``: one exchange; through the chat template as a user and an
  assistant message when the tokenizer has one, else the two texts concatenated; the loss covers
  the completion (``mask_prompt=True``) or both;
* ``{"text": ...}``: plain text; the loss covers every token.

`TextDataset.batches` gives a data source for `metalnn.Trainer`: a function of the step (so a
resumed run sees exactly the batches an uninterrupted run would) returning ``(inputs, targets)``
``[B, T]`` int32 arrays, ``targets`` holding `IGNORE` where no loss is taken. Batches are padded
(examples of similar length together) or packed (examples laid end to end in rows of a fixed
length). Use `loss` (``cross_entropy`` with ``ignore_index=IGNORE``) as the Trainer's loss.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...losses import cross_entropy

#: target value of positions that carry no loss (prompt tokens, padding)
IGNORE = -100


class DatasetError(ValueError):
    """A dataset file or line is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Example:
    """One tokenised example: token ids and, per token, whether the loss covers it."""

    ids: tuple
    trained: tuple

    def __len__(self):
        return len(self.ids)


def _has_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None and hasattr(tokenizer, "apply_chat_template")


def _chat_example(tokenizer, messages, mask_prompt, where):
    """Token ids of a conversation and which of them are assistant tokens.

    Each assistant turn's tokens are what the template adds between the conversation before it
    (with the generation prompt) and the conversation including it; the template must render
    prefixes of a conversation as prefixes (chat templates do; one that does not is reported).
    """
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DatasetError(f"{where}: messages[{i}] must be an object with string 'role' and 'content', "
                               f"got {m!r}"[:300])
    if not _has_template(tokenizer):
        raise DatasetError(f"{where}: a 'messages' example needs a tokenizer with a chat template")
    def render(msgs, generation_prompt):
        return list(_render(tokenizer, msgs, generation_prompt, where))

    ids = render(messages, False)
    if not mask_prompt:
        return Example(tuple(ids), (True,) * len(ids))
    trained = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[:i + 1], False)
        if through != ids[:len(through)] or before != through[:len(before)]:
            raise DatasetError(f"{where}: the tokens of the conversation up to assistant message {i} are not a "
                               "prefix of the conversation's tokens (the chat template renders a shorter "
                               "conversation differently, or the tokens merge across the turn boundary), so "
                               "the assistant tokens cannot be found; use mask_prompt=False")
        for k in range(len(before), len(through)):
            trained[k] = True
    if not any(trained):
        raise DatasetError(f"{where}: no assistant message, so nothing to train on (or use mask_prompt=False)")
    return Example(tuple(ids), tuple(trained))


def _render(tokenizer, messages, add_generation_prompt, where):
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # a template's own error (raise_exception, undefined fields)
        raise DatasetError(f"{where}: the chat template failed on this conversation: {e}") from e


def _completion_example(tokenizer, prompt, completion, mask_prompt, where):
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise DatasetError(f"{where}: 'prompt' and 'completion' must be strings")
    if _has_template(tokenizer):
        return _chat_example(tokenizer, [{"role": "user", "content": prompt},
                                         {"role": "assistant", "content": completion}], mask_prompt, where)
    p = list(tokenizer.encode(prompt))
    c = list(tokenizer.encode(completion, add_special_tokens=False)) + _eos(tokenizer)
    return Example(tuple(p + c), (not mask_prompt,) * len(p) + (True,) * len(c))


def _text_example(tokenizer, text, where):
    if not isinstance(text, str) or not text:
        raise DatasetError(f"{where}: 'text' must be a non-empty string")
    ids = list(tokenizer.encode(text)) + _eos(tokenizer)
    return Example(tuple(ids), (True,) * len(ids))


def _eos(tokenizer) -> list:
    """What is appended to texts and completions: ``[eos_token_id]`` of the tokenizer, else the
    smallest of its ``eos_token_ids``, else nothing."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        return [int(eos)]
    ids = getattr(tokenizer, "eos_token_ids", None)
    return [min(int(i) for i in ids)] if ids else []


def tokenize(tokenizer, record: dict, mask_prompt: bool = True, where: str = "example") -> Example:
    """One JSON record (any of the formats in the module docstring) as an `Example`."""
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        return _chat_example(tokenizer, record["messages"], mask_prompt, where)
    if "prompt" in record or "completion" in record:
        return _completion_example(tokenizer, record.get("prompt"), record.get("completion"), mask_prompt, where)
    if "text" in record:
        return _text_example(tokenizer, record["text"], where)
    raise DatasetError(f"{where}: expected a 'messages', 'prompt'/'completion' or 'text' field, got "
                       f"{sorted(record)}")


class TextDataset:
    """Tokenised examples, ready to batch.

    Args:
        examples: `Example` objects (see `load_jsonl` to read a file).
    """

    def __init__(self, examples):
        self.examples = list(examples)
        if not self.examples:
            raise DatasetError("the dataset holds no examples")

    def __len__(self):
        return len(self.examples)

    @property
    def num_trained_tokens(self) -> int:
        return sum(sum(e.trained) for e in self.examples)

    def batches(self, batch_size: int, max_length: int = 2048, packed: bool = False, seed: int = 0,
                pad_id: int = 0):
        """A data source ``f(step) -> (inputs, targets)`` for `metalnn.Trainer.fit`.

        Padded (default): examples are sorted by length and cut into batches of ``batch_size``, so a
        batch pads little (with ``pad_id``, after the tokens); when ``batch_size`` does not divide
        the number of examples, the last batch holds the ``batch_size`` longest ones (overlapping
        the batch before it). Every epoch visits all batches in an order drawn from ``(seed,
        epoch)``; ``T`` is the longest example of the batch less one. Examples longer than
        ``max_length + 1`` tokens are cut.

        Packed: the examples (in an order drawn from ``(seed, epoch)``) are laid end to end and cut
        into rows of ``max_length + 1`` tokens (``T = max_length``, no padding; tokens that do not
        fill a last row are left out of that epoch). Attention is not cut at the joins: a token
        may attend to the end of the example before it, as in Hugging Face's packed language
        modelling.

        ``inputs`` are ``[B, T]``, ``targets`` the next tokens with `IGNORE` where no loss is taken.
        The batch of step ``s`` depends only on ``s`` (and the arguments), so a resumed run sees
        the batches an uninterrupted one would.
        """
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"batches: batch_size and max_length must be positive, got {batch_size}, {max_length}")
        if packed:
            return _PackedSource(self.examples, batch_size, max_length, seed)
        return _PaddedSource(self.examples, batch_size, max_length, seed, pad_id)


def _rows(chunks, width, pad_id):
    """Token/trained chunks -> (inputs, targets) int32 arrays ``[len(chunks), width]``."""
    x = np.full((len(chunks), width), pad_id, dtype=np.int32)
    y = np.full((len(chunks), width), IGNORE, dtype=np.int32)
    for r, (ids, trained) in enumerate(chunks):
        n = len(ids) - 1
        x[r, :n] = ids[:-1]
        tgt = np.asarray(ids[1:], dtype=np.int32)
        y[r, :n] = np.where(np.asarray(trained[1:], dtype=bool), tgt, IGNORE)
    return mx.array(x), mx.array(y)


class _PaddedSource:
    def __init__(self, examples, batch_size, max_length, seed, pad_id):
        order = sorted(range(len(examples)), key=lambda i: len(examples[i]))
        self.examples, self.max_length, self.seed, self.pad_id = examples, max_length, seed, pad_id
        if len(order) < batch_size:
            raise ValueError(f"batches: {len(examples)} examples are fewer than one batch of {batch_size}")
        # consecutive runs of the length order; the last batch is the longest batch_size examples
        # (overlapping the one before it when the count does not divide), so every example is
        # visited each epoch and every batch has batch_size rows
        starts = list(range(0, len(order) - batch_size + 1, batch_size))
        if starts[-1] + batch_size < len(order):
            starts.append(len(order) - batch_size)
        self.groups = [order[i:i + batch_size] for i in starts]

    def __call__(self, step):
        epoch, i = divmod(int(step), len(self.groups))
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.groups))
        chunks = []
        for j in self.groups[perm[i]]:
            e = self.examples[j]
            chunks.append((e.ids[:self.max_length + 1], e.trained[:self.max_length + 1]))
        width = max(len(c[0]) for c in chunks) - 1
        return _rows(chunks, max(width, 1), self.pad_id)

    def __len__(self):
        return len(self.groups)


class _PackedSource:
    def __init__(self, examples, batch_size, max_length, seed):
        self.examples, self.batch_size, self.width, self.seed = examples, batch_size, max_length + 1, seed
        total = sum(len(e) for e in examples)
        self.rows_per_epoch = total // self.width
        if self.rows_per_epoch < batch_size:
            raise ValueError(f"batches: {total} tokens fill fewer than one packed batch of {batch_size} rows of "
                             f"{self.width}")
        self._cache = {}

    def _epoch(self, epoch):
        if epoch not in self._cache:
            self._cache.clear()
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))
            ids = np.concatenate([np.asarray(self.examples[i].ids, dtype=np.int64) for i in perm])
            trained = np.concatenate([np.asarray(self.examples[i].trained, dtype=bool) for i in perm])
            n = self.rows_per_epoch * self.width
            self._cache[epoch] = (ids[:n].reshape(-1, self.width), trained[:n].reshape(-1, self.width))
        return self._cache[epoch]

    def __call__(self, step):
        per_epoch = self.rows_per_epoch // self.batch_size
        epoch, i = divmod(int(step), per_epoch)
        ids, trained = self._epoch(epoch)
        rows = slice(i * self.batch_size, (i + 1) * self.batch_size)  # packed rows are full: no padding
        targets = np.where(trained[rows, 1:], ids[rows, 1:], IGNORE)
        return mx.array(ids[rows, :-1].astype(np.int32)), mx.array(targets.astype(np.int32))

    def __len__(self):
        return self.rows_per_epoch // self.batch_size


def load_jsonl(path, tokenizer, mask_prompt: bool = True, limit: int | None = None) -> TextDataset:
    """Read and tokenise a ``.jsonl`` file (formats in the module docstring).

    Raises `DatasetError` naming the file and line of the first malformed line (invalid JSON, an
    unknown format, wrong field types) or when the file holds no example.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such dataset file")
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            examples.append(tokenize(tokenizer, record, mask_prompt, where))
            if limit is not None and len(examples) >= limit:
                break
    if not examples:
        raise DatasetError(f"{path}: no examples (the file is empty)")
    return TextDataset(examples)


def loss(model, batch, device):
    """The Trainer loss for these batches: mean next-token cross-entropy over the trained targets."""
    inputs, targets = batch
    return cross_entropy(model(inputs, device=device), targets, ignore_index=IGNORE)


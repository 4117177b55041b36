"""Sentence embeddings from a language model's final hidden states: `embed`.

An input's embedding is its final hidden states (`metalnn.llm.models.CausalLM.hidden_states`: the
backbone's output after the final norm, before the output head) mean-pooled over its tokens and
L2-normalised: ``e = m / ||m||`` with ``m = mean_t h[t]``: llama.cpp's ``--pooling mean`` with its
default ``--embd-normalize 2`` (Euclidean), the usual way to get one vector per text out of a
decoder-only model that has no pooling of its own.

>>> vectors = embed(model, [tokenizer.encode("a cat"), tokenizer.encode("a dog")])   # [2, hidden]
>>> float((vectors[0] * vectors[1]).sum())                                           # cosine similarity

Inputs of different lengths run together, right-padded: attention is causal, so a padding position
(after the real tokens) never changes the states of the positions before it, and the mean leaves it
out. No attention mask is needed for that; the padded batches are bounded by ``max_batch_tokens``.
"""

from __future__ import annotations

import mlx.core as mx

#: padded positions (rows x longest input) one forward pass may hold
MAX_BATCH_TOKENS = 8192


def _check(model, token_lists) -> list[list[int]]:
    lists = [[int(t) for t in ids] for ids in token_lists]
    vocab, context = model.vocab_size, model.context_length
    for i, ids in enumerate(lists):
        if not ids:
            raise ValueError(f"embed: input {i} has no tokens (at least one is needed)")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"embed: input {i} holds the token id {bad}; the model's ids are 0 to {vocab - 1}")
        if context is not None and len(ids) > context:
            raise ValueError(f"embed: input {i} has {len(ids)} tokens; the model's context length is {context}")
    return lists


def _batches(lengths: list[int], max_batch_tokens: int):
    """Runs of consecutive input indices whose padded size (rows x longest) stays within the budget
    (a single input longer than the budget runs alone)."""
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        wider = max(longest, n)
        if i > start and wider * (i - start + 1) > max_batch_tokens:
            yield range(start, i)
            start, wider = i, n
        longest = wider
    if start < len(lengths):
        yield range(start, len(lengths))


def embed(model, token_lists, *, device=None, max_batch_tokens: int = MAX_BATCH_TOKENS) -> mx.array:
    """Embeddings of token sequences: ``N`` lists of ids -> ``[N, hidden]`` float32, each row of L2 norm 1.

    Args:
        model: a `metalnn.llm.models.CausalLM`.
        token_lists: ``N`` sequences of token ids (each at least one id, within the vocabulary and
            the model's context length).
        device: the `metalnn.Device` to run on (default: the current one).
        max_batch_tokens: the most padded positions of one forward pass.
    Returns:
        ``[N, hidden]`` float32: the mean over each input's tokens of the final hidden states,
        divided by its L2 norm (a zero mean stays zero).
    Raises:
        ValueError: an empty input, a token id outside the vocabulary, an input longer than the
            context length (the message names the input's index).
    """
    lists = _check(model, token_lists)
    if not lists:
        raise ValueError("embed: no inputs")
    out = []
    for rows in _batches([len(ids) for ids in lists], int(max_batch_tokens)):
        width = max(len(lists[i]) for i in rows)
        ids = mx.array([lists[i] + [0] * (width - len(lists[i])) for i in rows], dtype=mx.int32)  # [B, T]
        lengths = mx.array([len(lists[i]) for i in rows], dtype=mx.float32)  # [B]
        mask = (mx.arange(width)[None, :] < lengths[:, None]).astype(mx.float32)  # [B, T]
        h = model.hidden_states(ids, device=device).astype(mx.float32)  # [B, T, hidden]
        mean = (h * mask[..., None]).sum(axis=1) / lengths[:, None]  # [B, hidden]
        norm = mx.sqrt((mean * mean).sum(axis=-1, keepdims=True))  # [B, 1]
        pooled = mean / mx.maximum(norm, mx.array(1e-12, dtype=mx.float32))
        mx.eval(pooled)
        out.append(pooled)
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)

"""Autoregressive generation with a KV cache: `generate`, `stream_generate`, `sample_logits`.

The prompt is run once (prefill) and fills each attention layer's `KVCache` (only the last
prompt position goes through the output projection); every later step feeds only the newest token, so a step costs one token's projections plus one pass over the cache.
The graph of step ``n + 1`` is built while step ``n`` runs, and step ``n + 1`` is queued
(``mx.async_eval``) before the caller handles token ``n``.

Logits processors (``processors=``, e.g. `metalnn.llm.constrained.GrammarConstraint`) are
per-sequence objects with ``__call__(logits [V]) -> [V]`` (applied before sampling) and
``accept(token)`` (told each token the sequence produced). A processed step needs the previous
token first, so it is not queued ahead; the model's forward pass still runs while the processors
compute their masks.
"""

from __future__ import annotations

import mlx.core as mx


def sample_logits(logits, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                  key=None):
    """Pick the next token from ``logits`` ``[B, vocab]`` -> ``[B]`` int32.

    ``temperature == 0`` is greedy (arg-max). Otherwise the logits are divided by ``temperature``,
    restricted to the ``top_k`` largest and to the smallest set whose probability reaches ``top_p``
    (nucleus), then sampled with ``key`` (or MLX's global random state).
    """
    if temperature is None or temperature <= 0:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    x = logits.astype(mx.float32) / float(temperature)
    vocab = x.shape[-1]
    if top_k is not None and 0 < top_k < vocab:
        kth = mx.sort(x, axis=-1)[..., vocab - top_k][..., None]
        x = mx.where(x < kth, -mx.inf, x)
    if top_p is not None and 0.0 < top_p < 1.0:
        order = mx.argsort(-x, axis=-1)
        sorted_x = mx.take_along_axis(x, order, axis=-1)
        probs = mx.softmax(sorted_x, axis=-1)
        before = mx.cumsum(probs, axis=-1) - probs
        drop_sorted = before >= top_p  # the most likely token always stays (before = 0)
        drop = mx.put_along_axis(mx.zeros(x.shape, dtype=mx.bool_), order, drop_sorted, axis=-1)
        x = mx.where(drop, -mx.inf, x)
    return mx.random.categorical(x, axis=-1, key=key).astype(mx.int32)


def _prompt(tokens):
    if isinstance(tokens, mx.array):
        arr = tokens
    else:
        arr = mx.array(tokens)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    batched = arr.ndim == 2
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise ValueError(f"generate: the prompt must be [T] or [B, T] with T >= 1, got shape {tuple(arr.shape)}")
    if not mx.issubdtype(arr.dtype, mx.integer):
        raise TypeError(f"generate: prompt tokens must be integers, got {arr.dtype}")
    return arr.astype(mx.int32), batched


def _eos_set(eos_token_id, model=None):
    if eos_token_id is None:
        return set(getattr(model, "eos_token_ids", None) or ())
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _processor_rows(processors, rows: int):
    """``processors`` as one list per batch row (None: none at all)."""
    if not processors:
        return None
    if rows == 1 and not isinstance(processors[0], (list, tuple)) and processors[0] is not None:
        processors = [processors]
    if len(processors) != rows:
        raise ValueError(f"generate: processors must give one list per batch row ({rows}), got {len(processors)}")
    return [list(p or ()) for p in processors]


def _process(rows, logits):
    """Apply each row's processors to its logits ``[B, V]`` -> ``[B, V]``."""
    out = []
    for i, procs in enumerate(rows):
        x = logits[i]
        for p in procs:
            x = p(x)
        out.append(x)
    return mx.stack(out)


def _accept(rows, y):
    """Tell each row's processors the token it produced (``y`` ``[B]``; evaluates it)."""
    for procs, token in zip(rows, y.tolist()):
        for p in procs:
            p.accept(token)


def _steps(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, device, max_context=None,
           processors=None):
    """Yield the next-token arrays ``[B]`` (lazy; the following step is queued before each yield;
    with ``processors``, see `_processor_rows`, each token is evaluated and accepted first)."""
    cache = model.make_cache()
    key = mx.random.key(seed) if seed is not None else None
    history = prompt if max_context else None

    def step(inp):
        nonlocal key, cache, history
        if max_context:
            if history is not inp:
                history = mx.concatenate([history, inp], axis=1)[:, -max_context:]
            if cache[0].offset + inp.shape[1] > max_context:
                # Out of positions: start a fresh cache from the most recent half window.
                cache = model.make_cache()
                inp = history[:, -max(1, max_context // 2):]
        if inp.shape[1] > 1:
            # Prefill: the earlier positions only fill the cache. Their outputs are never
            # evaluated, so MLX computes only what the cache needs (no output projection for them).
            model(inp[:, :-1], cache=cache, device=device)
            inp = inp[:, -1:]
        logits = model(inp, cache=cache, device=device)[:, -1, :]
        if processors:
            mx.async_eval(logits)  # the forward pass runs while the processors compute their masks
            logits = _process(processors, logits)
        sub = None
        if key is not None and temperature and temperature > 0:
            key, sub = mx.random.split(key)
        return sample_logits(logits, temperature, top_k, top_p, sub)

    if max_new_tokens <= 0:
        return
    if max_context and prompt.shape[1] > max_context:
        prompt = prompt[:, -max_context:]
        history = prompt
    y = step(prompt)
    mx.async_eval(y)
    for n in range(max_new_tokens):
        nxt = None
        if processors:
            _accept(processors, y)
        if n + 1 < max_new_tokens:
            nxt = step(y[:, None])  # the graph is built while step n runs
            # Step n finishes before step n + 1 is queued: the caches' in-place writes of step n + 1
            # can then take over the cache buffers (MLX decides when queuing), instead of copying
            # every layer's whole cache each token while step n still holds them.
            mx.eval(y)
            mx.async_eval(nxt)
        yield y
        y = nxt


def stream_generate(model, tokens, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                    top_p: float | None = None, seed: int | None = None, eos_token_id=None, device=None,
                    max_context: int | None = None, processors=None):
    """Yield new tokens one at a time (an ``int`` per step for a 1-D prompt, a list per step for a
    ``[B, T]`` prompt). Stops after ``max_new_tokens`` or when every sequence has produced an
    ``eos_token_id`` (an int or a collection; the EOS token is yielded). Arguments as `generate`,
    and ``processors``: logits processors (``__call__(logits [V]) -> [V]`` before sampling,
    ``accept(token)`` after), a list applied in order for a 1-D prompt, one list per row (or None)
    for a ``[B, T]`` prompt."""
    prompt, batched = _prompt(tokens)
    eos = _eos_set(eos_token_id, model)
    done = [False] * prompt.shape[0]
    rows = _processor_rows(processors, prompt.shape[0])
    for y in _steps(model, prompt, int(max_new_tokens), temperature, top_k, top_p, seed, device, max_context,
                    rows):
        ids = y.tolist()
        if eos:
            ids = [next(iter(eos)) if d else t for t, d in zip(ids, done)]
            done = [d or t in eos for t, d in zip(ids, done)]
        yield ids if batched else ids[0]
        if eos and all(done):
            return


def generate(model, tokens, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, eos_token_id=None, device=None,
             max_context: int | None = None, processors=None):
    """Generate up to ``max_new_tokens`` tokens after ``tokens``.

    Args:
        model: a `metalnn.llm.models.CausalLM` (anything with ``model(tokens, cache=...)`` and
            ``make_cache()``).
        tokens: the prompt, ``[T]`` (list or array) or ``[B, T]`` (equal-length prompts).
        max_new_tokens: number of tokens to generate.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_k: sample only among the ``k`` most likely tokens.
        top_p: nucleus sampling: only among the most likely tokens whose probabilities add up to ``p``.
        seed: seed of the sampling key (reproducible samples); default: MLX's global random state.
        eos_token_id: stop once this token (or any of these tokens) has been generated (it is
            included). Finished rows of a batch repeat it while others continue. Default None:
            the model's ``eos_token_ids`` (set by `load_pretrained` from the checkpoint's
            tokenizer; none for a model built from a config); ``()`` never stops early.
        device: the `Device` to run on.
        max_context: the most positions the model may see (e.g. the length it was trained on).
            Default None: no limit (the cache grows with the sequence). When set, the prompt is cut
            to its last ``max_context`` tokens, and whenever the cache is full it is rebuilt from
            the last ``max_context // 2`` tokens (one re-prefill per ``max_context // 2`` steps).
        processors: logits processors, see `stream_generate`.
    Returns:
        the new tokens: a ``list[int]`` for a 1-D prompt, an ``mx.array`` ``[B, N]`` for a batch.
    """
    prompt, batched = _prompt(tokens)
    out = list(stream_generate(model, prompt if batched else prompt[0], max_new_tokens, temperature, top_k, top_p,
                               seed, eos_token_id, device, max_context, processors))
    if batched:
        if not out:
            return mx.zeros((prompt.shape[0], 0), dtype=mx.int32)
        return mx.array(out, dtype=mx.int32).T
    return out

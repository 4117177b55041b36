"""Autoregressive generation with a KV cache: `generate`, `stream_generate`, `stream_choices`.

The prompt is run once (prefill) and fills each attention layer's `KVCache` (only the last
prompt position goes through the output projection); every later step feeds only the newest token, so a step costs one token's projections plus one pass over the cache.
The graph of step ``n + 1`` is built while step ``n`` runs, and step ``n + 1`` is queued
(``mx.async_eval``) before the caller handles token ``n``. Tokens are chosen by
`metalnn.llm.sampling` (one `Sampler` per row of the batch).
"""

from __future__ import annotations

import mlx.core as mx

from .sampling import Sampler, SamplingParams, propose_batch


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


def sampling_params(sampling: SamplingParams | None, temperature=None, top_k=None, top_p=None,
                    seed=None) -> SamplingParams:
    """``sampling``, or the `SamplingParams` of the older keywords (``temperature`` None or 0: greedy;
    ``top_k`` 0 or ``top_p`` >= 1: no limit). Giving both is an error."""
    if sampling is not None:
        given = [n for n, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed))
                 if v is not None]
        if given:
            raise ValueError(f"give either sampling=SamplingParams(...) or {', '.join(given)}, not both")
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        return sampling
    return SamplingParams(temperature=float(temperature or 0.0), top_k=top_k if top_k else None,
                          top_p=top_p if top_p is not None and top_p < 1 else None, seed=seed)


def _per_row(processors, rows: int) -> list:
    """``processors`` as one tuple per row: a flat sequence is a 1-D prompt's; for ``[B, T]``
    prompts one sequence (or None) per row."""
    processors = tuple(processors or ())
    nested = bool(processors) and all(p is None or isinstance(p, (list, tuple)) for p in processors)
    if not nested:
        if processors and rows != 1:
            raise ValueError(f"generate: processors are per sequence; give one list per row of the {rows} rows")
        return [processors] + [()] * (rows - 1)
    if len(processors) != rows:
        raise ValueError(f"generate: processors must give one list per batch row ({rows}), got {len(processors)}")
    return [tuple(p or ()) for p in processors]


def _samplers(prompt, params: SamplingParams, processors) -> list[Sampler]:
    """One `Sampler` per row of ``prompt`` ``[B, T]``; with a seed, row ``i`` draws with ``seed + i``
    (row 0 as a 1-D prompt with that seed would). ``processors``: see `_per_row`."""
    import dataclasses

    rows = prompt.shape[0]
    per_row = _per_row(processors, rows)
    seeds = [params.seed] if rows == 1 else [None if params.seed is None else (params.seed + i) % 2**64
                                             for i in range(rows)]
    return [Sampler(dataclasses.replace(params, seed=s) if s != params.seed else params,
                    prompt[i].tolist() if params.repetition_penalty != 1 else (), per_row[i])
            for i, s in enumerate(seeds)]


def _steps(model, prompt, max_new_tokens, samplers, device, max_context=None):
    """Yield each step's `metalnn.llm.sampling.BatchProposal` (evaluated; the following step is
    queued before each yield). The samplers have accepted the step's tokens when it is yielded."""
    cache = model.make_cache()
    history = prompt if max_context else None

    def step(inp):
        nonlocal cache, history
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
            spans = getattr(model, "prefill_spans", lambda n: [(0, n)])(inp.shape[1] - 1)
            for start, end in spans:
                model(inp[:, start:end], cache=cache, device=device)
            inp = inp[:, -1:]
        logits = model(inp, cache=cache, device=device)[:, -1, :]
        return propose_batch(samplers, logits)

    if max_new_tokens <= 0:
        return
    if max_context and prompt.shape[1] > max_context:
        prompt = prompt[:, -max_context:]
        history = prompt
    y = step(prompt)
    mx.async_eval(y.arrays())
    for n in range(max_new_tokens):
        # lazily: the penalties' counts of step n + 1 include token n without waiting for it
        # (a sampler with processors evaluates it here: they need the int)
        for i, sampler in enumerate(samplers):
            if not sampler.plain:  # a plain sampler keeps no record of its tokens
                sampler.accept(y.tokens[i])
        nxt = None
        if n + 1 < max_new_tokens:
            nxt = step(y.tokens[:, None])  # the graph is built while step n runs
            # Step n finishes before step n + 1 is queued: the caches' in-place writes of step n + 1
            # can then take over the cache buffers (MLX decides when queuing), instead of copying
            # every layer's whole cache each token while step n still holds them.
            mx.eval(y.arrays())
            mx.async_eval(nxt.arrays())
        yield y
        y = nxt


def stream_choices(model, tokens, max_new_tokens: int, sampling: SamplingParams | None = None, eos_token_id=None,
                   device=None, max_context: int | None = None, processors=()):
    """As `stream_generate`, yielding each new token's `metalnn.llm.sampling.TokenChoice` (with its
    log-probabilities when ``sampling.logprobs``) instead of the id: one per step for a 1-D prompt,
    a list per step for a ``[B, T]`` prompt (finished rows repeat an EOS choice).

    ``processors``: `metalnn.llm.sampling.LogitsProcessor` s of a 1-D prompt's sequence, or one list
    (or None) per row of a ``[B, T]`` prompt (each step then waits for the token before the next is
    queued, as they need it).
    """
    prompt, batched = _prompt(tokens)
    samplers = _samplers(prompt, sampling_params(sampling), processors)
    eos = _eos_set(eos_token_id, model)
    done: list = [None] * prompt.shape[0]  # each row's EOS choice once it has finished
    for y in _steps(model, prompt, int(max_new_tokens), samplers, device, max_context):
        row = y.choices()
        if eos:
            row = [d if d is not None else c for c, d in zip(row, done)]
            done = [d if d is not None else (c if c.token in eos else None) for c, d in zip(row, done)]
        yield row if batched else row[0]
        if eos and all(d is not None for d in done):
            return


def stream_generate(model, tokens, max_new_tokens: int, temperature: float | None = None, top_k: int | None = None,
                    top_p: float | None = None, seed: int | None = None, eos_token_id=None, device=None,
                    max_context: int | None = None, *, sampling: SamplingParams | None = None, processors=()):
    """Yield new tokens one at a time (an ``int`` per step for a 1-D prompt, a list per step for a
    ``[B, T]`` prompt). Stops after ``max_new_tokens`` or when every sequence has produced an
    ``eos_token_id`` (an int or a collection; the EOS token is yielded). Arguments as `generate`."""
    params = sampling_params(sampling, temperature, top_k, top_p, seed)
    for step in stream_choices(model, tokens, max_new_tokens, params, eos_token_id, device, max_context, processors):
        yield [c.token for c in step] if isinstance(step, list) else step.token


def generate(model, tokens, max_new_tokens: int, temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, eos_token_id=None, device=None,
             max_context: int | None = None, *, sampling: SamplingParams | None = None, processors=()):
    """Generate up to ``max_new_tokens`` tokens after ``tokens``.

    Args:
        model: a `metalnn.llm.models.CausalLM` (anything with ``model(tokens, cache=...)`` and
            ``make_cache()``).
        tokens: the prompt, ``[T]`` (list or array) or ``[B, T]`` (equal-length prompts).
        max_new_tokens: number of tokens to generate.
        temperature: 0 (or None, the default) for greedy decoding, else the sampling temperature.
        top_k: sample only among the ``k`` most likely tokens.
        top_p: nucleus sampling: only among the most likely tokens whose probabilities add up to ``p``.
        seed: seed of the sampling key (reproducible samples; row ``i`` of a batch uses
            ``seed + i``); default: MLX's global random state.
        eos_token_id: stop once this token (or any of these tokens) has been generated (it is
            included). Finished rows of a batch repeat it while others continue. Default None:
            the model's ``eos_token_ids`` (set by `load_pretrained` from the checkpoint's
            tokenizer; none for a model built from a config); ``()`` never stops early.
        device: the `Device` to run on.
        max_context: the most positions the model may see (e.g. the length it was trained on).
            Default None: no limit (the cache grows with the sequence). When set, the prompt is cut
            to its last ``max_context`` tokens, and whenever the cache is full it is rebuilt from
            the last ``max_context // 2`` tokens (one re-prefill per ``max_context // 2`` steps).
        sampling: a `metalnn.llm.sampling.SamplingParams` (penalties, bias, min-p, ...) instead of
            ``temperature``, ``top_k``, ``top_p`` and ``seed``.
        processors: `metalnn.llm.sampling.LogitsProcessor` s of a 1-D prompt's sequence (e.g. a
            `metalnn.llm.constrained.GrammarConstraint`), applied before sampling each step.
    Returns:
        the new tokens: a ``list[int]`` for a 1-D prompt, an ``mx.array`` ``[B, N]`` for a batch.
    """
    prompt, batched = _prompt(tokens)
    params = sampling_params(sampling, temperature, top_k, top_p, seed)
    out = list(stream_generate(model, prompt if batched else prompt[0], max_new_tokens, eos_token_id=eos_token_id,
                               device=device, max_context=max_context, sampling=params,
                               processors=processors or ()))
    if batched:
        if not out:
            return mx.zeros((prompt.shape[0], 0), dtype=mx.int32)
        return mx.array(out, dtype=mx.int32).T
    return out

"""``metalnn bench MODEL``: prompt (prefill) and generation (decode) speed of a model."""

from __future__ import annotations

import statistics
import time

from .common import CommandError, add_product_inputs, add_model, load, positive_int


def add_parser(commands):
    p = commands.add_parser("bench", help="measure prompt and generation tokens/s", description=(
        "Measure a model's speed: prompt tokens/s (a prompt of random tokens, up to the first new token) and "
        "generation tokens/s (the following tokens, greedy, no early stop). One warm-up run, then the median "
        "of --runs runs. --prompt-tokens plus --gen-tokens must fit the model's context length."))
    add_model(p)
    add_product_inputs(p)
    p.add_argument("--prompt-tokens", type=positive_int, default=128, metavar="N", help="prompt length (default 128)")
    p.add_argument("--gen-tokens", type=positive_int, default=64, metavar="N", help="tokens to generate (default 64)")
    p.add_argument("--runs", type=positive_int, default=3, metavar="N", help="measured runs (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (default 0)")
    p.set_defaults(run=run)


def measure(model, prompt, new_tokens: int):
    """``(seconds to the first new token, seconds for the rest)`` of one greedy generation."""
    from ..llm.generation import stream_generate

    start = time.perf_counter()
    stream = stream_generate(model, prompt, new_tokens, eos_token_id=())
    next(stream)
    first = time.perf_counter()
    for _ in stream:
        pass
    return first - start, time.perf_counter() - first


def run(args):
    import mlx.core as mx
    import numpy as np

    model, _ = load(args.model, tokenizer=False)
    context = model.context_length
    if context is not None and args.prompt_tokens + args.gen_tokens > context:
        raise CommandError(f"--prompt-tokens {args.prompt_tokens} and --gen-tokens {args.gen_tokens} make "
                           f"{args.prompt_tokens + args.gen_tokens} positions; the model's context length is "
                           f"{context} tokens")
    prompt = np.random.default_rng(args.seed).integers(0, model.vocab_size, args.prompt_tokens).tolist()
    measure(model, prompt, min(args.gen_tokens, 4))  # warm-up: first-call compilation
    mx.reset_peak_memory()
    times = [measure(model, prompt, args.gen_tokens) for _ in range(args.runs)]
    prefill = statistics.median(t[0] for t in times)
    decode = statistics.median(t[1] for t in times)
    print(f"{args.model}: {args.prompt_tokens} prompt tokens, {args.gen_tokens} new tokens, median of {args.runs} "
          f"runs")
    print(f"prompt:      {args.prompt_tokens / prefill:10.1f} tokens/s ({prefill * 1e3:.0f} ms to the first token)")
    if args.gen_tokens > 1:
        print(f"generation:  {(args.gen_tokens - 1) / decode:10.1f} tokens/s")
    print(f"peak memory: {mx.get_peak_memory() / 2**20:10.1f} MiB")

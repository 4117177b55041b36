"""Speed side by side with llama.cpp on the same GGUF files: ``llama-bench`` against metalnn.

Files: the bundled SmolLM2-135M-Instruct Q4_1, and Q8_0 and Q4_K_M made from it by ``llama-quantize``
(through an F16 file, cached in ``--work``, as ``gguf_perplexity.py`` makes them).

* llama.cpp: ``llama-bench -m FILE -t THREADS -p 512 -n 64 -o json`` (``pp512``: one batch of 512
  prompt tokens; ``tg64``: 64 tokens generated one at a time from an empty context; the mean of its
  repetitions);
* metalnn: as ``metalnn bench`` times it (`metalnn.cli.bench.measure`: `stream_generate`, greedy,
  the KV cache, the next step queued while the previous one runs). Prompt: the time to the first new
  token of a 512-token random prompt (one forward over the 512 tokens) -> 512 / s. Decode: like
  ``tg64``, 64 tokens after a 1-token prompt (65 new tokens; the 64 after the first timed). One
  warm-up, then the median of ``--runs`` runs. Decoding is timed twice: with metalnn's default
  product inputs (the common types as two int8 levels, `metalnn.cpu.ggml.split_inputs`),
  and with int8 inputs as llama.cpp computes its products (`metalnn.functional.ggml_int8_inputs`, the
  commands' ``--int8-products``).

``--depth D`` also times decoding at a context of D tokens: ``llama-bench -p 0 -n 64 -d D`` (the 64
tokens generated after D tokens already in the cache) against metalnn's 64 tokens after a prompt of
D + 1 tokens (the prompt not timed).

``--files`` adds other GGUF files (e.g. the 1B-parameter Llama of ``scripts/make_llama1b_gguf.py``).

The machine's load average is printed before and after: other processes on the cores change both
sides (the two run one after the other, not at once). ``--rounds N`` measures each file N times,
the two engines taking turns (a machine whose speed drifts from one minute to the next then weighs
on both sides alike): the table gives each side's median over the rounds and the ratio of the
medians, and each decode ratio's range over the rounds' own pairs.

    python scripts/bench_llamacpp.py [--types Q4_1,Q8_0,Q4_K_M] [--files A.gguf B.gguf] [--threads 2] [--runs 3]
                                     [--depth 1024] [--rounds 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_common as common  # noqa: E402


def run_llama_bench(path: Path, threads: int, options: list, bin_folder, timeout: int = 900) -> list:
    """The JSON rows of ``llama-bench -m FILE -t THREADS OPTIONS -o json``."""
    cmd = [common.tool("llama-bench", bin_folder), "-m", str(path), "-t", str(threads), *map(str, options), "-o", "json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        sys.exit(f"llama-bench {' '.join(map(str, options))} failed on {path.name} ({res.returncode}):\n"
                 f"{res.stderr[-3000:]}")
    return json.loads(res.stdout)


def bench_llamacpp(path: Path, threads: int, prompt: int, gen: int, depth: int, bin_folder):
    """``(prompt tokens/s, decode tokens/s, decode tokens/s at depth or None)`` of ``llama-bench``."""
    out = run_llama_bench(path, threads, ["-p", prompt, "-n", gen], bin_folder)
    pp = next(r["avg_ts"] for r in out if r["n_prompt"] == prompt and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in out if r["n_gen"] == gen and r["n_prompt"] == 0)
    tg_depth = None
    if depth:
        out = run_llama_bench(path, threads, ["-p", 0, "-n", gen, "-d", depth], bin_folder)
        tg_depth = next(r["avg_ts"] for r in out if r["n_gen"] == gen and r.get("n_depth") == depth)
    return pp, tg, tg_depth


def bench_metalnn(path: Path, prompt: int, gen: int, runs: int, depth: int = 0):
    """``(prompt tokens/s, decode tokens/s, decode tokens/s with int8 product inputs, decode tokens/s
    after a prompt of depth + 1 tokens or None)`` of metalnn, timed as ``metalnn bench`` times it."""
    import metalnn as mn
    from metalnn.cli.bench import measure
    from metalnn.functional import ggml_int8_inputs

    model = mn.models.load_pretrained(path)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, max(prompt, depth + 1)).tolist()
    measure(model, tokens[:prompt], 4)  # warm-up
    measure(model, tokens[:1], 4)
    pp = statistics.median(measure(model, tokens[:prompt], 1)[0] for _ in range(runs))
    tg = statistics.median(measure(model, tokens[:1], gen + 1)[1] for _ in range(runs))
    tg_depth = None
    if depth:
        measure(model, tokens[:depth + 1], 4)
        tg_depth = gen / statistics.median(measure(model, tokens[:depth + 1], gen + 1)[1] for _ in range(runs))
    with ggml_int8_inputs():
        measure(model, tokens[:1], 4)
        tg8 = statistics.median(measure(model, tokens[:1], gen + 1)[1] for _ in range(runs))
    del model
    gc.collect()
    return prompt / pp, gen / tg, gen / tg8, tg_depth


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=common.DEFAULT_WORK, help="where the made files are cached")
    p.add_argument("--types", default="Q4_1,Q8_0,Q4_K_M", help="comma-separated types (default Q4_1,Q8_0,Q4_K_M)")
    p.add_argument("--files", type=Path, nargs="*", default=[], help="more GGUF files to compare")
    p.add_argument("--threads", type=int, default=2, help="llama-bench threads (default 2)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--gen", type=int, default=64, help="generated tokens (default 64)")
    p.add_argument("--runs", type=int, default=3, help="metalnn runs, median (default 3)")
    p.add_argument("--depth", type=int, default=0, help="also time decoding with this many tokens in the context")
    p.add_argument("--llamacpp", default=None, help="folder of llama.cpp's tools")
    p.add_argument("--rounds", type=int, default=1, help="measure each file this many times, the engines taking turns")
    args = p.parse_args(argv)
    if args.rounds < 1:
        sys.exit("--rounds: at least 1")

    import mlx.core as mx

    import metalnn

    types = [t.strip() for t in args.types.split(",") if t.strip()]
    files = common.make_files(args.work, types, args.llamacpp) if types else {}
    labels = {t: f"SmolLM2-135M {t}" for t in types}
    for f in args.files:
        if not f.is_file():
            sys.exit(f"--files: no such file {f}")
        files[f.name] = f
        labels[f.name] = f.name
        types.append(f.name)
    before = common.load_line()
    print(f"{platform.machine()} {platform.processor() or ''}, {common.load_line()}", flush=True)
    rows = []
    for t in types:
        measured = []  # one (llama.cpp pp, tg, depth, metalnn pp, tg, tg int8, depth) a round
        for r in range(args.rounds):
            ll_pp, ll_tg, ll_d = bench_llamacpp(files[t], args.threads, args.prompt, args.gen, args.depth,
                                                args.llamacpp)
            mn_pp, mn_tg, mn_tg8, mn_d = bench_metalnn(files[t], args.prompt, args.gen, args.runs, args.depth)
            measured.append((ll_pp, ll_tg, ll_d, mn_pp, mn_tg, mn_tg8, mn_d))
            depth = f"; at depth {args.depth}: llama.cpp {ll_d:.1f}, metalnn {mn_d:.1f}" if args.depth else ""
            turn = f" (round {r + 1})" if args.rounds > 1 else ""
            print(f"  {t}{turn}: llama.cpp pp{args.prompt} {ll_pp:.1f} tg{args.gen} {ll_tg:.1f}; metalnn prompt "
                  f"{mn_pp:.1f} decode {mn_tg:.1f} (int8 inputs {mn_tg8:.1f}) tokens/s{depth}; {common.load_line()}",
                  flush=True)
        med = [statistics.median(m[i] for m in measured) if measured[0][i] is not None else None for i in range(7)]
        spread = [(min(r), max(r)) for r in ([m[i] / m[1] for m in measured] for i in (4, 5))]  # decode ratios
        rows.append((t, files[t].stat().st_size, med[1], med[4], med[5], med[0], med[3], med[2], med[6], spread))

    print(f"\nllama.cpp {common.llamacpp_version(args.llamacpp)} ({args.threads} threads); metalnn "
          f"{getattr(metalnn, '__version__', '?')}, MLX {mx.__version__}")
    print(f"load before: {before}; after: {common.load_line()}")
    depth_head = (f" llama.cpp decode at depth {args.depth} | metalnn | ratio |" if args.depth else "")
    print(f"| file | llama.cpp decode (tg{args.gen}) | metalnn decode | ratio | metalnn decode, int8 inputs | ratio "
          f"| llama.cpp prompt (pp{args.prompt}) | metalnn prompt | ratio |{depth_head}")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: | ---: |" if args.depth else ""))
    for t, size, ll_tg, mn_tg, mn_tg8, ll_pp, mn_pp, ll_d, mn_d, spread in rows:
        depth_cells = f" {ll_d:.1f} | {mn_d:.1f} | {mn_d / ll_d:.2f}x |" if args.depth else ""
        rng = [f" ({lo:.2f}-{hi:.2f})" if args.rounds > 1 else "" for lo, hi in spread]
        print(f"| {labels[t]} ({size / 1e6:.0f} MB) | {ll_tg:.1f} tokens/s | {mn_tg:.1f} | {mn_tg / ll_tg:.2f}x{rng[0]} "
              f"| {mn_tg8:.1f} | {mn_tg8 / ll_tg:.2f}x{rng[1]} | {ll_pp:.1f} tokens/s | {mn_pp:.1f} | "
              f"{mn_pp / ll_pp:.2f}x |{depth_cells}")
    if args.rounds > 1:
        print(f"(medians of {args.rounds} rounds, the engines taking turns; in brackets: the rounds' own decode ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

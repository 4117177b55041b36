#!/usr/bin/env python
"""NumPy and MLX matrix products in one process: each alone, and alternating.

Training scripts prepare data in NumPy and run the model in MLX, so their products alternate.
With two OpenBLAS libraries in the process (NumPy's and another one for MLX), each has its own
thread pool, whose threads keep spinning for a while after a product: the next product of the
other library then shares the cores with them. metalnn forwards MLX to NumPy's own OpenBLAS, so
one pool serves both (`metalnn.cpu.blas`).

For a float32 n x n product (default 1024) this prints the median milliseconds per product of:
NumPy alone, MLX alone, and NumPy and MLX alternating (each side's product timed on its own),
and the ratios alone / alternating (1.0: alternating costs nothing). The three are measured in
rounds that interleave them, so that a change in the machine's load falls on all three.
``--two-pools`` repeats the measurement in a child process with ``METALNN_BLAS=scipy-openblas32``
(MLX on scipy-openblas32's library, NumPy on its own: two pools), for comparison. The load
average is printed before and after.

    python scripts/bench_numpy_mlx.py [--n 1024] [--rounds 5] [--reps 10] [--two-pools]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min) on {os.cpu_count()} cores"


def measure(n: int, rounds: int, reps: int, warmup: int) -> dict:
    """Median ms per product of NumPy alone, MLX alone and each in the alternating pattern."""
    import numpy as np

    import metalnn  # noqa: F401  (sets up MLX's BLAS)
    import mlx.core as mx
    from metalnn.cpu import blas

    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((n, n), dtype=np.float32)
    b_np = rng.standard_normal((n, n), dtype=np.float32)
    a, b = mx.array(a_np), mx.array(b_np)
    mx.eval(a, b)

    def np_product():
        t0 = time.perf_counter()
        a_np @ b_np
        return time.perf_counter() - t0

    def mx_product():
        t0 = time.perf_counter()
        mx.eval(a @ b)
        return time.perf_counter() - t0

    for _ in range(warmup):
        np_product()
        mx_product()
    times = {"numpy_alone": [], "mlx_alone": [], "numpy_alternating": [], "mlx_alternating": []}
    for _ in range(rounds):
        times["numpy_alone"] += [np_product() for _ in range(reps)]
        times["mlx_alone"] += [mx_product() for _ in range(reps)]
        for _ in range(reps):
            times["numpy_alternating"].append(np_product())
            times["mlx_alternating"].append(mx_product())
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    info = blas.blas_info()
    return {
        "ms": ms,
        "numpy_ratio": ms["numpy_alone"] / ms["numpy_alternating"],
        "mlx_ratio": ms["mlx_alone"] / ms["mlx_alternating"],
        "library": info["library"],
        "shared_with_numpy": info["shared_with_numpy"],
        "threads": info["threads"],
        "num_threads": info["num_threads"],
    }


def report(title: str, r: dict) -> None:
    ms = r["ms"]
    print(f"\n{title}")
    print(f"  MLX's library: {r['library']} (shared with NumPy: {r['shared_with_numpy']}); "
          f"OpenBLAS threads at the end: {r['num_threads']}; governor: {r['threads']}")
    print("  | | alone (ms) | alternating (ms) | alone / alternating |")
    print("  | --- | ---: | ---: | ---: |")
    print(f"  | NumPy | {ms['numpy_alone']:.2f} | {ms['numpy_alternating']:.2f} | {r['numpy_ratio']:.2f} |")
    print(f"  | MLX | {ms['mlx_alone']:.2f} | {ms['mlx_alternating']:.2f} | {r['mlx_ratio']:.2f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1024, help="matrix size (default 1024)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--reps", type=int, default=10, help="products of each kind per round (default 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--two-pools", action="store_true",
                   help="also measure with METALNN_BLAS=scipy-openblas32 (two OpenBLAS pools), in a child process")
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the child's output
    args = p.parse_args(argv)

    if args.json:
        print(json.dumps(measure(args.n, args.rounds, args.reps, args.warmup)))
        return 0
    before = load_line()
    print(f"float32 {args.n}x{args.n} products; {args.rounds} rounds of {args.reps} each; {before}", flush=True)
    results = [("this process (METALNN_BLAS=" + os.environ.get("METALNN_BLAS", "auto") + ")",
                measure(args.n, args.rounds, args.reps, args.warmup))]
    if args.two_pools:
        cmd = [sys.executable, os.path.abspath(__file__), "--json", "--n", str(args.n), "--rounds", str(args.rounds),
               "--reps", str(args.reps), "--warmup", str(args.warmup)]
        env = {**os.environ, "METALNN_BLAS": "scipy-openblas32"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        results.append(("child with METALNN_BLAS=scipy-openblas32 (two pools)",
                        json.loads(proc.stdout.strip().splitlines()[-1])))
    for title, r in results:
        report(title, r)
    print(f"\nload before: {before}\nload after:  {load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

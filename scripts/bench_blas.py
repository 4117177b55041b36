#!/usr/bin/env python
"""Benchmark MLX matmul/conv (with metalnn's BLAS setup) against NumPy, in one process.

    python scripts/bench_blas.py                 # matmul 512/1024/2048 + conv2d
    python scripts/bench_blas.py --compare-off   # also rerun MLX with METALNN_BLAS=off
    python scripts/bench_blas.py --sizes 1024 --reps 10
    python scripts/bench_blas.py --mlx-first     # import mlx.core before metalnn, as most code does

By default metalnn is imported before mlx; with --mlx-first mlx.core comes first and MLX
gets OpenBLAS through metalnn's startup hook (see metalnn/cpu/blas_hook.py). Either way the
script reports which path loaded it. Prints GFLOP/s for each and the MLX/NumPy ratio
(target >= 0.8 on Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MLX_FIRST = "--mlx-first" in sys.argv[1:]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if MLX_FIRST:
    import mlx.core as mx  # noqa: E402

import metalnn  # noqa: E402,F401
import mlx.core as mx  # noqa: E402,F811
import numpy as np  # noqa: E402
from metalnn.cpu import blas as _blas  # noqa: E402


def best_time(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_matmul(n: int, warmup: int, reps: int, numpy_too: bool = True) -> dict:
    rng = np.random.default_rng(0)
    a_np = rng.standard_normal((n, n), dtype=np.float32)
    b_np = rng.standard_normal((n, n), dtype=np.float32)
    a, b = mx.array(a_np), mx.array(b_np)
    mx.eval(a, b)
    flops = 2.0 * n**3
    t_mx = best_time(lambda: mx.eval(a @ b), warmup, reps)
    out = {"n": n, "mlx_gflops": flops / t_mx / 1e9}
    if numpy_too:
        t_np = best_time(lambda: a_np @ b_np, warmup, reps)
        out["numpy_gflops"] = flops / t_np / 1e9
        out["ratio"] = out["mlx_gflops"] / out["numpy_gflops"]
    return out


def bench_conv(warmup: int, reps: int) -> dict:
    # NHWC input 16x32x32x32, 64 filters 3x3, padding 1 -> 16x32x32x64.
    n, h, w, cin, cout, k = 16, 32, 32, 32, 64, 3
    x = mx.random.normal((n, h, w, cin))
    wt = mx.random.normal((cout, k, k, cin))
    mx.eval(x, wt)
    flops = 2.0 * n * h * w * cout * cin * k * k
    t = best_time(lambda: mx.eval(mx.conv2d(x, wt, padding=1)), warmup, reps)
    return {"shape": "16x32x32x32 * 64x3x3", "mlx_gflops": flops / t / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--compare-off", action="store_true", help="also time MLX with METALNN_BLAS=off (subprocess)")
    ap.add_argument("--mlx-first", action="store_true", help="import mlx.core before metalnn (read before argparse)")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # used by --compare-off
    ap.add_argument("--no-numpy", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    results = {
        "matmul": [bench_matmul(n, args.warmup, args.reps, numpy_too=not args.no_numpy) for n in args.sizes],
        "conv2d": bench_conv(args.warmup, args.reps),
        "blas_info": _blas.blas_info(),
    }
    if args.json:
        print(json.dumps(results))
        return

    print(f"python {sys.version.split()[0]}  mlx {mx.__version__}  numpy {np.__version__}")
    print(f"import order: {'mlx.core, then metalnn' if MLX_FIRST else 'metalnn, then mlx.core'}")
    env = {k: v for k, v in os.environ.items() if k.startswith(("OPENBLAS", "OMP_", "METALNN", "MKL_"))}
    print(f"env: {env or '{}'}  cpus: {os.cpu_count()}")
    print("blas_info():")
    for k, v in results["blas_info"].items():
        print(f"  {k}: {v}")
    print()
    print(f"float32 matmul (best of {args.reps}, {args.warmup} warmups)")
    print(f"{'n':>6} {'MLX GFLOP/s':>12} {'NumPy GFLOP/s':>14} {'MLX/NumPy':>10}")
    for r in results["matmul"]:
        flag = "" if r["ratio"] >= 0.8 else "  (below 0.8 target)"
        print(f"{r['n']:>6} {r['mlx_gflops']:>12.1f} {r['numpy_gflops']:>14.1f} {r['ratio']:>10.2f}{flag}")
    c = results["conv2d"]
    print(f"\nmx.conv2d {c['shape']}: {c['mlx_gflops']:.1f} GFLOP/s")

    if args.compare_off:
        sizes = [n for n in args.sizes if n <= 1024] or args.sizes[:1]
        cmd = [sys.executable, os.path.abspath(__file__), "--json", "--no-numpy", *(["--mlx-first"] if MLX_FIRST else []),
               "--warmup", "1", "--reps", "2", "--sizes", *map(str, sizes)]
        proc = subprocess.run(cmd, env={**os.environ, "METALNN_BLAS": "off"},
                              capture_output=True, text=True, check=True)
        off = json.loads(proc.stdout.strip().splitlines()[-1])
        on = {r["n"]: r["mlx_gflops"] for r in results["matmul"]}
        print("\nMLX with METALNN_BLAS=off (bundled reference BLAS), best of 2:")
        for r in off["matmul"]:
            print(f"  matmul n={r['n']}: {r['mlx_gflops']:.1f} GFLOP/s  (with OpenBLAS: {on[r['n']]:.1f}, "
                  f"{on[r['n']] / r['mlx_gflops']:.0f}x)")
        co = off["conv2d"]["mlx_gflops"]
        print(f"  mx.conv2d: {co:.1f} GFLOP/s  (with OpenBLAS: {c['mlx_gflops']:.1f}, {c['mlx_gflops'] / co:.0f}x)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Benchmark metalnn.cpu.im2col's native primitives against the same ops built from MLX ops, in one process.

    python scripts/bench_im2col.py                # default shapes
    python scripts/bench_im2col.py --reps 30 --threads 1 2

For each shape it times (best of --reps, after warm-up):
  * im2col: the native primitive vs pad + strided slices + stack (the MLX-op form);
  * col2im: the native primitive vs the MLX-op form (MLX's VJP of those slices);
  * conv2d forward+backward as ``W @ im2col(x)`` under ``mx.value_and_grad`` with either
    im2col (the backward then runs col2im), next to PyTorch's conv2d when torch is installed.
and prints the ratio (MLX-op time / native time: above 1 means the native one is faster).
mlx.core is imported first on purpose (metalnn's startup hook gives MLX OpenBLAS anyway).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import metalnn.cpu.im2col as ic  # noqa: E402

# (label, x shape [N, C, *S], kernel, stride, padding, dilation, out channels for the conv)
SHAPES = [
    ("conv2d 16x32x32x32 k3 p1", (16, 32, 32, 32), (3, 3), (1, 1), (1, 1), (1, 1), 64),
    ("conv2d 16x64x32x32 k3 s2 p1", (16, 64, 32, 32), (3, 3), (2, 2), (1, 1), (1, 1), 128),
    ("conv2d 8x16x64x64 k5 p2 d1", (8, 16, 64, 64), (5, 5), (1, 1), (2, 2), (1, 1), 32),
    ("conv1d 32x64x512 k7 p3", (32, 64, 512), (7,), (1,), (3,), (1,), 64),
    ("conv3d 4x8x16x32x32 k3 p1", (4, 8, 16, 32, 32), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), 16),
]


def best(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        t = min(t, time.perf_counter() - t0)
    return t


def torch_conv_ms(shape, k, s, p, d, o, warmup, reps):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(k)]
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn((o, shape[1], *k), requires_grad=True)

    def step():
        y = conv(x, w, stride=s, padding=p, dilation=d)
        y.square().sum().backward()

    for _ in range(warmup):
        step()
    t = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        t = min(t, time.perf_counter() - t0)
    return t * 1e3


def run(args) -> None:
    print(f"mlx {mx.__version__}  native: {ic.available()} ({ic.unavailable_reason() or 'loaded'})  "
          f"cpus: {os.cpu_count()}  threads tried: {args.threads}")
    print("times in ms, best of", args.reps, "(this machine may be shared: compare ratios, not times)\n")
    if not ic.available():
        print("the native primitives are not available; nothing to compare")
        return
    default_threads = ic.get_num_threads()
    header = f"{'shape':32} {'op':22} {'MLX ops':>9} " + " ".join(f"{'native t=' + str(t):>12}" for t in args.threads)
    header += f" {'ratio':>7}"
    print(header)
    for label, shape, k, s, p, d, o in SHAPES:
        x = mx.random.normal(shape)
        w = mx.random.normal((o, shape[1] * math.prod(k))) * 0.1
        mx.eval(x, w)
        cols = ic.im2col(x, k, stride=s, padding=p, dilation=d)
        mx.eval(cols)

        def conv_loss(im2col_fn):
            def loss(xx, ww):
                c = im2col_fn(xx)
                return (ww @ c).square().sum()

            return mx.value_and_grad(loss, argnums=(0, 1))

        native_conv = conv_loss(lambda xx: ic.im2col(xx, k, stride=s, padding=p, dilation=d))
        mlx_conv = conv_loss(lambda xx: ic.im2col(xx, k, stride=s, padding=p, dilation=d, native=False))
        rows = [
            ("im2col", lambda: ic.im2col(x, k, stride=s, padding=p, dilation=d, native=False),
             lambda: ic.im2col(x, k, stride=s, padding=p, dilation=d)),
            ("col2im", lambda: ic.col2im(cols, shape[2:], k, stride=s, padding=p, dilation=d, native=False),
             lambda: ic.col2im(cols, shape[2:], k, stride=s, padding=p, dilation=d)),
            ("conv fwd+bwd (GEMM)", lambda: mlx_conv(x, w), lambda: native_conv(x, w)),
        ]
        for op, mlx_fn, native_fn in rows:
            t_mlx = best(mlx_fn, args.warmup, args.reps) * 1e3
            t_nat = []
            for threads in args.threads:
                ic.set_num_threads(threads)
                t_nat.append(best(native_fn, args.warmup, args.reps) * 1e3)
            ic.set_num_threads(default_threads)
            ratio = t_mlx / t_nat[args.threads.index(default_threads)] if default_threads in args.threads else t_mlx / min(t_nat)
            print(f"{label:32} {op:22} {t_mlx:9.2f} " + " ".join(f"{t:12.2f}" for t in t_nat) + f" {ratio:6.1f}x")
        t_torch = torch_conv_ms(shape, k, s, p, d, o, args.warmup, args.reps)
        if t_torch is not None:
            print(f"{label:32} {'torch conv fwd+bwd':22} {t_torch:9.2f}")
        print()
    print(f"ratio = MLX-op time / native time with {default_threads} thread(s) (the default here)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    run(ap.parse_args())


if __name__ == "__main__":
    main()

"""Time metalnn's kernel-backed ops against MLX's own fused ops, forward and forward+backward.

    python scripts/bench_kernels.py [--repeats 20]

On a Mac with Metal it times the ``metal`` kernels against ``mx.fast``; elsewhere Metal is
unavailable, so it times the ``reference`` path (plain MLX ops) against ``mx.fast`` and says so.
Prints milliseconds per call and the ratio mx.fast time / metalnn time (> 1 means metalnn is faster).
"""

from __future__ import annotations

import argparse
import time

import metalnn as mn  # before mlx: fast BLAS on Linux

import mlx.core as mx  # noqa: E402

from metalnn import functional as F  # noqa: E402


def timeit(fn, repeats):
    for _ in range(3):
        mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def cases(device):
    x = mx.random.normal((8, 512, 4096))
    w = mx.random.normal((4096,))
    q = mx.random.normal((4, 32, 512, 128))
    cot_x, cot_q = mx.random.normal(x.shape), mx.random.normal(q.shape)

    def grad_of(f, arg, cot):
        return lambda: mx.vjp(f, [arg], [cot])[1][0]

    norm_ours = lambda a: F.rms_norm(a, w, 1e-5, device=device)  # noqa: E731
    norm_fast = lambda a: mx.fast.rms_norm(a, w, 1e-5)  # noqa: E731
    rope_ours = lambda a: F.rope(a, 128, offset=7, device=device)  # noqa: E731
    rope_fast = lambda a: mx.fast.rope(a, 128, traditional=False, base=10000.0, scale=1.0, offset=7)  # noqa: E731
    return [
        ("rms_norm fwd  [8,512,4096]", lambda: norm_ours(x), lambda: norm_fast(x)),
        ("rms_norm f+b  [8,512,4096]", grad_of(norm_ours, x, cot_x), grad_of(norm_fast, x, cot_x)),
        ("rope fwd      [4,32,512,128]", lambda: rope_ours(q), lambda: rope_fast(q)),
        ("rope f+b      [4,32,512,128]", grad_of(rope_ours, q, cot_q), grad_of(rope_fast, q, cot_q)),
    ]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if mx.metal.is_available():
        device = mn.Device(kernels="metal")
        print("Metal available: timing metalnn's metal kernels against mx.fast")
    else:
        device = mn.Device(kernels="reference")
        print("Metal is unavailable on this machine: timing metalnn's reference path (plain MLX ops) "
              "against mx.fast's CPU implementation")
    print(f"{'op':30s} {'metalnn ms':>11s} {'mx.fast ms':>11s} {'ratio':>7s}")
    for name, ours, fast in cases(device):
        a, b = timeit(ours, args.repeats), timeit(fast, args.repeats)
        print(f"{name:30s} {a:11.3f} {b:11.3f} {b / a:7.2f}x")


if __name__ == "__main__":
    main()

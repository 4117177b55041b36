"""Benchmark metalnn.cpu.fastmath against MLX's CPU ops and numpy.

    python scripts/bench_fastmath.py [--n 4194304] [--repeat 10]

Prints ns/element for exp/sigmoid/silu/tanh/softmax (forward, and forward+backward
through mx.grad), and the time of a softmax-attention forward+backward on
[8, 4, 256, 256] scores.
"""

from __future__ import annotations

import argparse
import math
import time

import metalnn  # noqa: F401
import metalnn.cpu.fastmath as fm
import mlx.core as mx
import numpy as np


def bench(fn, *args, repeat=10, warmup=2):
    for _ in range(warmup):
        mx.eval(fn(*args))
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        mx.eval(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def bench_np(fn, *args, repeat=10):
    fn(*args)
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1 << 22, help="elements per op")
    p.add_argument("--row", type=int, default=256, help="softmax row length")
    p.add_argument("--repeat", type=int, default=10)
    a = p.parse_args()

    print(f"fastmath available: {fm.available()} ({fm.unavailable_reason() or 'native'}), avx2: {fm.has_avx2()}")
    mx.set_default_device(mx.cpu)
    n = a.n - a.n % a.row
    x = mx.random.normal((n // a.row, a.row)) * 3
    mx.eval(x)
    xn = np.array(x)
    r = a.repeat

    def silu_ref(t):
        return t * mx.sigmoid(t)

    rows = [
        ("exp", mx.exp, fm.exp, np.exp),
        ("sigmoid", mx.sigmoid, fm.sigmoid, lambda t: 1.0 / (1.0 + np.exp(-t))),
        ("silu", silu_ref, fm.silu, lambda t: t / (1.0 + np.exp(-t))),
        ("tanh", mx.tanh, fm.tanh, np.tanh),
        ("softmax", lambda t: mx.softmax(t, axis=-1), fm.softmax, np_softmax),
    ]
    print(f"\nforward, {n} float32 elements (softmax rows of {a.row}), ns/element (median of {r})")
    print(f"{'op':10s} {'mlx':>8s} {'fastmath':>9s} {'numpy':>8s} {'speedup':>8s}")
    for name, f_mx, f_fm, f_np in rows:
        t_mx = bench(f_mx, x, repeat=r) / n * 1e9
        t_fm = bench(f_fm, x, repeat=r) / n * 1e9
        t_np = bench_np(f_np, xn, repeat=r) / n * 1e9
        print(f"{name:10s} {t_mx:8.2f} {t_fm:9.2f} {t_np:8.2f} {t_mx / t_fm:7.1f}x")

    print("\nforward+backward (mx.grad of sum(op(x) * w)), ns/element")
    w = mx.random.normal(x.shape)
    mx.eval(w)
    print(f"{'op':10s} {'mlx':>8s} {'fastmath':>9s} {'speedup':>8s}")
    for name, f_mx, f_fm, _ in rows:
        g_mx = mx.grad(lambda t, f=f_mx: (f(t) * w).sum())
        g_fm = mx.grad(lambda t, f=f_fm: (f(t) * w).sum())
        t_mx = bench(g_mx, x, repeat=r) / n * 1e9
        t_fm = bench(g_fm, x, repeat=r) / n * 1e9
        print(f"{name:10s} {t_mx:8.2f} {t_fm:9.2f} {t_mx / t_fm:7.1f}x")

    # softmax attention forward + backward
    B, H, L, D = 8, 4, 256, 64
    q, k, v = (mx.random.normal((B, H, L, D)) for _ in range(3))
    mask = mx.triu(mx.full((L, L), -math.inf), k=1)
    mx.eval(q, k, v, mask)
    scale = 1.0 / math.sqrt(D)

    def make(sm):
        def loss(q, k, v):
            s = (q @ k.transpose(0, 1, 3, 2)) * scale + mask
            return (sm(s) @ v).sum()

        return mx.value_and_grad(loss, argnums=(0, 1, 2))

    def sm_mx(s):
        return mx.softmax(s, axis=-1)

    print(f"\nsoftmax attention fwd+bwd, scores [{B}, {H}, {L}, {L}], head dim {D}: ms (median of {r})")
    results = {}
    for label, sm in [("mlx softmax", sm_mx), ("fastmath softmax", fm.softmax)]:
        f = make(sm)
        results[label] = bench(lambda: f(q, k, v), repeat=r) * 1e3
        fc = mx.compile(f)
        results[label + " (compiled)"] = bench(lambda: fc(q, k, v), repeat=r) * 1e3
    for label, t in results.items():
        print(f"  {label:28s} {t:8.2f} ms")
    print(
        f"  speedup: {results['mlx softmax'] / results['fastmath softmax']:.2f}x eager, "
        f"{results['mlx softmax (compiled)'] / results['fastmath softmax (compiled)']:.2f}x compiled"
    )
    # softmax alone on the scores
    s = (q @ k.transpose(0, 1, 3, 2)) * scale + mask
    mx.eval(s)
    t_mx = bench(sm_mx, s, repeat=r) * 1e3
    t_fm = bench(fm.softmax, s, repeat=r) * 1e3
    print(f"  softmax only: mlx {t_mx:.2f} ms, fastmath {t_fm:.2f} ms ({t_mx / t_fm:.1f}x)")


if __name__ == "__main__":
    main()

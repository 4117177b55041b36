"""Benchmark conv2d forward+backward: metalnn (kernels="auto") vs PyTorch CPU, in one process.

Case (default): batch 16, 32 -> 64 channels, 32x32, 3x3, padding 1, with bias; gradients of
``sum(conv(x) * g)`` in input, weight and bias. Prints median/min times and the speed ratio
(PyTorch time / metalnn time; >= 0.5 is the target on a 2-core x86_64 CPU).

    python scripts/bench_conv.py [--reps 30] [--batch 16] [--size 32] [--cin 32] [--cout 64] [--stride 1]
    OPENBLAS_NUM_THREADS=1 METALNN_NUM_THREADS=1 python scripts/bench_conv.py --threads 1 --cpu-time

mlx.core is imported first, as users do (metalnn's startup hook gives MLX OpenBLAS anyway).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx  # first, as users do (metalnn's startup hook gives MLX OpenBLAS anyway)
import metalnn
import numpy as np


def _timeit(fns, reps, warmup=3, block=5, clock=time.perf_counter):
    """Median and min seconds of each function over ``reps`` runs, in rounds of ``block`` runs of
    each function in turn, so that load from other processes on a shared machine hits all of them
    alike (blocks rather than single runs: each library's worker threads stay warm)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(max(1, reps // block)):
        for name, fn in fns.items():
            for _ in range(block):
                t0 = clock()
                fn()
                times[name].append(clock() - t0)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--cin", type=int, default=32)
    ap.add_argument("--cout", type=int, default=64)
    ap.add_argument("--kernel", type=int, default=3)
    ap.add_argument("--stride", type=int, default=1)
    ap.add_argument("--padding", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="PyTorch intra-op threads (default: all cores)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by process CPU time (with OPENBLAS_NUM_THREADS=1 METALNN_NUM_THREADS=1 and "
                         "--threads 1: the work each library does, whatever else runs on the machine)")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as TF

    if args.threads:
        torch.set_num_threads(args.threads)

    from metalnn.functional import conv2d

    rng = np.random.default_rng(0)
    n, c, o, s, k = args.batch, args.cin, args.cout, args.size, args.kernel
    x = rng.standard_normal((n, c, s, s)).astype(np.float32)
    w = (rng.standard_normal((o, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
    b = rng.standard_normal((o,)).astype(np.float32)
    kw = dict(stride=args.stride, padding=args.padding)
    out_shape = TF.conv2d(torch.tensor(x), torch.tensor(w), **kw).shape
    g = rng.standard_normal(tuple(out_shape)).astype(np.float32)

    device = metalnn.Device(kernels="auto")
    mx_x, mx_w, mx_b, mx_g = (mx.array(a) for a in (x, w, b, g))
    fwd = lambda: mx.eval(conv2d(mx_x, mx_w, mx_b, device=device, **kw))  # noqa: E731
    loss = lambda x_, w_, b_: (conv2d(x_, w_, b_, device=device, **kw) * mx_g).sum()  # noqa: E731
    vg = mx.value_and_grad(loss, argnums=(0, 1, 2))
    fwd_bwd = lambda: mx.eval(vg(mx_x, mx_w, mx_b))  # noqa: E731

    tx = torch.tensor(x, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    tb = torch.tensor(b, requires_grad=True)
    tg = torch.tensor(g)

    def t_fwd():
        with torch.no_grad():
            TF.conv2d(tx, tw, tb, **kw)

    def t_fwd_bwd():
        tx.grad = tw.grad = tb.grad = None
        (TF.conv2d(tx, tw, tb, **kw) * tg).sum().backward()

    flops = 2 * n * o * c * k * k * out_shape[2] * out_shape[3]
    print(f"conv2d x[{n},{c},{s},{s}] w[{o},{c},{k},{k}] stride {args.stride} pad {args.padding} "
          f"(torch threads {torch.get_num_threads()}, {flops / 1e9:.2f} GFLOP forward)")
    timings = _timeit({"metalnn fwd": fwd, "torch fwd": t_fwd, "metalnn fwd+bwd": fwd_bwd,
                       "torch fwd+bwd": t_fwd_bwd}, args.reps,
                      clock=time.process_time if args.cpu_time else time.perf_counter)
    if args.cpu_time:
        print("  (process CPU time per call, not wall time)")
    for name, (med, best) in timings.items():
        print(f"  {name:18s} median {med * 1e3:8.2f} ms   min {best * 1e3:8.2f} ms")
    results = {}
    for what in ("fwd", "fwd+bwd"):
        (tm, tb), (mm, mb) = timings[f"torch {what}"], timings[f"metalnn {what}"]
        results[what] = tm / mm
        print(f"  speed ratio {what:8s} metalnn/torch = {tm / mm:.2f}x (median)   {tb / mb:.2f}x (min)")
    return results


if __name__ == "__main__":
    main()

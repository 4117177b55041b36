"""Benchmark the gated delta rule, forward + backward, in one process: metalnn's default CPU path
(``mode="auto"`` on the default device: the native form, `metalnn.cpu.gated_delta`) and its chunked
form in MLX ops vs transformers' ``torch_chunk_gated_delta_rule`` (torch autograd) vs metalnn's
per-token recurrent form in MLX ops.

The native, chunked and torch steps are timed interleaved (one of each per round), so load from
other processes hits them alike; the load average is printed.

Case: B=1, 4 heads, 64x64 state (K = V = 64), q/k L2-normalised in the rule, chunk 64, gradients of
``sum(o * do)`` in q, k, v, g and beta, at T = 512, 2048, 8192. Prints median/min times, the speed
ratios and the peak memory of one forward+backward: ``mx.get_peak_memory`` above the inputs for
metalnn; for torch (CPU, which has no allocator statistics) the peak resident set of a fresh
process during one forward+backward above its resident set before it (Linux: the peak is reset
through ``/proc/self/clear_refs`` and read from ``VmHWM``).

    python scripts/bench_gated_delta.py [--lengths 512 2048 8192] [--reps 5] [--torch-threads N]
                                        [--no-recurrent-above T]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import metalnn  # noqa: F401  (first: binds MLX to the optimized BLAS)
import mlx.core as mx
import numpy as np

B, H, K, V = 1, 4, 64, 64


def inputs(T, seed=0):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    g = np.log(rng.uniform(0.9, 1.0, (B, T, H))).astype(np.float32)       # log-decay <= 0
    beta = rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32)
    do = rng.standard_normal((B, T, H, V)).astype(np.float32)
    return q, k, v, g, beta, do


def _interleaved(fns: dict, reps, warmup=1):
    """Per name: (median, min) seconds of ``reps`` calls, one call of each function per round."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


def _timeit(fn, reps, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def metalnn_step(arrays, mode):
    """``mode="auto"``: the default device (the native form on the CPU); else the MLX-op forms."""
    from metalnn.functional import gated_delta_rule

    device = metalnn.Device() if mode == "auto" else metalnn.Device(kernels="reference")
    q, k, v, g, beta, do = (mx.array(a) for a in arrays)
    mx.eval(q, k, v, g, beta, do)

    def loss(q, k, v, g, beta):
        o, _ = gated_delta_rule(q, k, v, g, beta, mode=mode, device=device, use_qk_l2norm_in_kernel=True)
        return (o * do).sum()

    vg = mx.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
    return lambda: mx.eval(vg(q, k, v, g, beta))


def metalnn_peak(step):
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    step()
    return mx.get_peak_memory() - base


def torch_step(arrays):
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    q, k, v, g, beta = (torch.tensor(a, requires_grad=True) for a in arrays[:5])
    do = torch.tensor(arrays[5])

    def step():
        for t in (q, k, v, g, beta):
            t.grad = None
        o, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, use_qk_l2norm_in_kernel=True)
        (o * do).sum().backward()

    return step


def torch_peak(T, threads):
    """Peak resident-set growth of one torch forward+backward, measured in a fresh process."""
    out = subprocess.run([sys.executable, __file__, "--torch-peak", str(T), "--torch-threads", str(threads)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _torch_peak_child(T, threads):
    import torch

    torch.set_num_threads(threads)
    step = torch_step(inputs(T))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set (VmHWM) to the current one
    before = _status_kib("VmRSS")
    step()
    print(json.dumps({"peak": (_status_kib("VmHWM") - before) * 1024}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-recurrent-above", type=int, default=None,
                    help="skip the recurrent form for longer sequences (its graph has T steps)")
    ap.add_argument("--torch-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--torch-peak", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.torch_peak is not None:
        return _torch_peak_child(args.torch_peak, torch.get_num_threads())

    import os

    from metalnn.cpu import im2col

    print(f"gated delta rule fwd+bwd, B={B}, heads={H}, state {K}x{V}, chunk 64 "
          f"(torch threads {torch.get_num_threads()}, metalnn threads {im2col.get_num_threads()}); "
          f"times in ms, memory in MiB")
    rows = []
    for T in args.lengths:
        arrays = inputs(T)
        native, chunk = metalnn_step(arrays, "auto"), metalnn_step(arrays, "chunk")
        res = {"T": T, "load": os.getloadavg()[0]}
        res.update(_interleaved({"native": native, "chunk": chunk, "torch": torch_step(arrays)}, args.reps))
        res["native_mem"] = metalnn_peak(native)
        res["chunk_mem"] = metalnn_peak(chunk)
        res["torch_mem"] = torch_peak(T, torch.get_num_threads())
        if args.no_recurrent_above is None or T <= args.no_recurrent_above:
            rec = metalnn_step(arrays, "recurrent")
            res["recurrent"] = _timeit(rec, max(1, args.reps // 2))
            res["recurrent_mem"] = metalnn_peak(rec)
        rows.append(res)
        line = (f"  T={T:5d}  metalnn native {res['native'][0] * 1e3:8.1f} (min {res['native'][1] * 1e3:7.1f})"
                f"  metalnn chunked {res['chunk'][0] * 1e3:8.1f} (min {res['chunk'][1] * 1e3:7.1f})"
                f"  torch chunked {res['torch'][0] * 1e3:8.1f} (min {res['torch'][1] * 1e3:7.1f})")
        if "recurrent" in res:
            line += f"  metalnn recurrent {res['recurrent'][0] * 1e3:9.1f}"
        print(line)
        mem = (f"           peak memory: native {res['native_mem'] / 2**20:7.1f}"
               f"  chunked {res['chunk_mem'] / 2**20:7.1f}  torch {res['torch_mem'] / 2**20:7.1f}")
        if "recurrent_mem" in res:
            mem += f"  recurrent {res['recurrent_mem'] / 2**20:8.1f}"
        mem += f"   (chunked per chunk: {res['chunk_mem'] / (T / 64) / 2**20:.2f})"
        print(mem)
        ratio = (f"           vs torch chunked: metalnn native {res['torch'][0] / res['native'][0]:.2f}x, "
                 f"metalnn chunked {res['torch'][0] / res['chunk'][0]:.2f}x (load average {res['load']:.2f})")
        if "recurrent" in res:
            ratio += f", vs recurrent {res['recurrent'][0] / res['chunk'][0]:.1f}x"
        print(ratio)
    return rows


if __name__ == "__main__":
    main()

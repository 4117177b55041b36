"""Time each implementation of metalnn's ops against MLX's built-in op, forward and forward+backward.

    python scripts/bench_kernels.py [--repeats 10] [--ops rms_norm,attention] [--kernels auto,reference]
    OPENBLAS_NUM_THREADS=1 METALNN_NUM_THREADS=1 python scripts/bench_kernels.py --cpu-time

For every op (rms_norm, rope, attention, gated, cross_entropy, conv2d, conv_transpose2d,
gated_delta) it times the MLX built-in (``mx.fast.rms_norm``, ``mx.fast.rope``,
``mx.fast.scaled_dot_product_attention``, ``nn.silu(a) * b``, ``mx.fast.cross_entropy``,
``mx.conv_general`` with MLX autodiff; the gated delta rule has none, so its baseline is MLX ops
in the chunked form) and metalnn's implementations on a `Device` of each ``kernels`` choice:
``reference``, ``auto`` and, on a Mac with Metal, ``metal``. It prints a Markdown table of the
best milliseconds per call (of ``--repeats`` runs) and the ratio ``built-in time / metalnn time`` (> 1: metalnn is
faster). On the CPU backend the ``auto`` column is what justifies each CPU stand-in that
`metalnn.functional` documents (the fused CPU primitives of `metalnn.cpu.fused`, the im2col
convolutions).

The timings of one run are comparable with each other (same process, same machine state); say
whether the machine was shared when quoting them. scripts/validate_metal.py reuses `WORKLOADS`.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx  # first, as users do
import mlx.nn as nn

import metalnn as mn
from metalnn import functional as F  # noqa: E402
from metalnn.functional.conv import conv_mlx, conv_transpose_mlx  # noqa: E402
from metalnn.functional.gated_delta import gated_delta_chunk  # noqa: E402


@dataclass
class Workload:
    op: str
    shape: str
    make: Callable[[], tuple]                 # -> input arrays (differentiated)
    ours: Callable[..., mx.array]             # (device, *inputs) -> output
    builtin: Callable[..., mx.array] | None   # (*inputs) -> output, MLX's own op


def _normal(*shape, scale=1.0, seed=0):
    return mx.random.normal(shape, key=mx.random.key(seed)) * scale


_TARGETS = mx.random.randint(0, 256, (2048,), key=mx.random.key(7))


def _gated_delta_inputs():
    B, T, H, K, V = 2, 256, 4, 64, 64
    q = _normal(B, T, H, K, seed=1)
    k = _normal(B, T, H, K, seed=2)
    q, k = (a * mx.rsqrt((a * a).sum(-1, keepdims=True)) for a in (q, k))
    return (q, k, _normal(B, T, H, V, seed=3), -mx.abs(_normal(B, T, H, seed=4)) * 0.1,
            mx.sigmoid(_normal(B, T, H, seed=5)))


def _gated_delta_chunk_mlx(q, k, v, g, beta):
    B, T, H, K = q.shape
    h0 = mx.zeros((B, H, K, v.shape[-1]))
    return gated_delta_chunk(q * K ** -0.5, k, v, g, beta, h0)[0]


WORKLOADS = [
    Workload("rms_norm", "x [8, 512, 1024]", lambda: (_normal(8, 512, 1024), _normal(1024, seed=1)),
             lambda d, x, w: F.rms_norm(x, w, 1e-5, device=d), lambda x, w: mx.fast.rms_norm(x, w, 1e-5)),
    Workload("rope", "x [4, 16, 512, 128]", lambda: (_normal(4, 16, 512, 128),),
             lambda d, x: F.rope(x, 128, offset=7, device=d),
             lambda x: mx.fast.rope(x, 128, traditional=False, base=10000.0, scale=1.0, offset=7)),
    Workload("attention", "q [2, 8, 256, 64], kv 2 heads, causal",
             lambda: (_normal(2, 8, 256, 64), _normal(2, 2, 256, 64, seed=1), _normal(2, 2, 256, 64, seed=2)),
             lambda d, q, k, v: F.attention(q, k, v, device=d),
             lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=64 ** -0.5, mask="causal")),
    Workload("gated", "gate, up [8, 256, 688] (SwiGLU)", lambda: (_normal(8, 256, 688), _normal(8, 256, 688, seed=1)),
             lambda d, a, b: F.gated_activation(a, b, "silu", device=d), lambda a, b: nn.silu(a) * b),
    Workload("cross_entropy", "logits [2048, 256]", lambda: (_normal(2048, 256, scale=3.0),),
             lambda d, z: mn.losses.cross_entropy(z, _TARGETS, reduction="none", device=d),
             lambda z: mx.fast.cross_entropy(z, _TARGETS)),
    Workload("conv2d", "x [16, 32, 32, 32], w [64, 32, 3, 3], pad 1",
             lambda: (_normal(16, 32, 32, 32), _normal(64, 32, 3, 3, scale=0.05, seed=1)),
             lambda d, x, w: F.conv2d(x, w, padding=1, device=d),
             lambda x, w: conv_mlx(x, w, (1, 1), (1, 1), (1, 1), 1)),
    Workload("conv_transpose2d", "x [16, 64, 16, 16], w [64, 32, 4, 4], stride 2, pad 1",
             lambda: (_normal(16, 64, 16, 16), _normal(64, 32, 4, 4, scale=0.05, seed=1)),
             lambda d, x, w: F.conv_transpose2d(x, w, stride=2, padding=1, device=d),
             lambda x, w: conv_transpose_mlx(x, w, (2, 2), (1, 1), (0, 0), (1, 1), 1)),
    Workload("gated_delta", "q, k, v [2, 256, 4, 64] (no MLX op: baseline = MLX ops, chunked form)",
             _gated_delta_inputs, lambda d, *a: F.gated_delta_rule(*a, device=d)[0], _gated_delta_chunk_mlx),
]


def forward_and_backward(fn, inputs):
    """Callables running ``fn`` forward, and forward + the VJP in every input (cotangent of ones)."""
    out = fn(*inputs)
    cot = mx.ones(out.shape, out.dtype)
    return (lambda: fn(*inputs)), (lambda: mx.vjp(fn, list(inputs), [cot]))


CLOCK = [time.perf_counter]  # time.process_time with --cpu-time


def time_ms(fn, repeats: int, warmup: int = 2) -> float:
    """Best time of ``mx.eval(fn())`` over ``repeats`` runs, in milliseconds (the minimum is the
    least disturbed by other work on a shared machine)."""
    clock = CLOCK[0]
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = clock()
        mx.eval(fn())
        times.append(clock() - t0)
    return min(times) * 1e3


def time_workload(w: Workload, kernels: list, repeats: int) -> list:
    """Rows ``[op, shape, pass, built-in ms, (ms, ratio) per kernels choice...]`` for both passes."""
    inputs = w.make()
    mx.eval(inputs)
    rows = []
    for label, pick in (("forward", 0), ("forward+backward", 1)):
        base = time_ms(forward_and_backward(w.builtin, inputs)[pick], repeats) if w.builtin else None
        row = [w.op, w.shape, label, f"{base:.2f}" if base else "-"]
        for kind in kernels:
            device = mn.Device(kernels=kind)
            ms = time_ms(forward_and_backward(lambda *a: w.ours(device, *a), inputs)[pick], repeats)
            row += [f"{ms:.2f}", f"{base / ms:.2f}x" if base else "-"]
        rows.append(row)
    return rows


def markdown_table(header: list, rows: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--ops", default=",".join(w.op for w in WORKLOADS), help="comma-separated subset")
    default_kernels = "reference,auto" + (",metal" if mx.metal.is_available() else "")
    p.add_argument("--kernels", default=default_kernels, help=f"comma-separated (default {default_kernels})")
    p.add_argument("--cpu-time", action="store_true",
                   help="time by process CPU time; with OPENBLAS_NUM_THREADS=1 METALNN_NUM_THREADS=1 this "
                        "compares the work of each implementation whatever else runs on the machine")
    args = p.parse_args(argv)
    if args.cpu_time:
        CLOCK[0] = time.process_time
    ops, kernels = args.ops.split(","), args.kernels.split(",")
    unknown = set(ops) - {w.op for w in WORKLOADS}
    if unknown:
        p.error(f"unknown ops {sorted(unknown)}; choose from {[w.op for w in WORKLOADS]}")
    print(f"MLX {mx.__version__}, default device {mx.default_device()}, metalnn native extension "
          f"{'on' if mn.cpu.fused.available() else 'off'}; best of {args.repeats} runs"
          f"{' (process CPU time)' if args.cpu_time else ''}\n")
    header = ["op", "shape", "pass", "MLX built-in ms"]
    for kind in kernels:
        header += [f"{kind} ms", f"{kind} speed"]
    rows = [row for w in WORKLOADS if w.op in ops for row in time_workload(w, kernels, args.repeats)]
    print(markdown_table(header, rows))
    print("\nspeed = MLX built-in time / metalnn time (> 1: metalnn faster)")


if __name__ == "__main__":
    main()

"""Benchmark the native GGML products (metalnn.cpu.ggml) against the native affine 4-bit product.

    python scripts/bench_ggml.py [--threads 1,2] [--repeat 15] [--rows 1,64,512]
                                 [--skip-products] [--skip-token] [--skip-crossover]

OpenBLAS (MLX's BLAS here) uses its own threads: ``OPENBLAS_NUM_THREADS=1`` in the environment
makes the dequantize + BLAS figures single-threaded like ``--threads 1`` (on a busy 2-core machine
its threads otherwise stall for whole scheduler ticks).

The peer, measured in the same process, is `metalnn.cpu.qmatmul.quantized_matmul` with groups of 32
and float16 scales and biases: what a Q4_1 GGUF file runs on today (its blocks become MLX's affine
layout). Shapes are SmolLM2-135M's (out x in): 576x576 (q, o), 192x576 (k, v), 1536x576 (gate, up),
576x1536 (down) and 49152x576 (the tied head).

Tables (ratio = affine time / ours: above 1 is faster than the peer):

1. Decoding (1 row) and prompts (64, 512 rows) for Q4_K, Q6_K, Q5_0, Q8_0 and IQ4_XS. For prompts
   the product is the one `MATMUL_MAX_ROWS` picks (native matmul up to it, dequantize + MLX's
   BLAS product above), against the faster of the affine product and affine dequantize + BLAS.
2. A whole decoded token's linear layers: the 30 layers and the head of SmolLM2-135M in the
   tensor types llama-quantize gives Q4_K_M on that model (rows of 576 are not whole 256-value
   super-blocks, so Q4_K falls back to Q5_0 and Q6_K to Q8_0 there; ffn_down, rows of 1536, is
   Q4_K or Q6_K), against the Q4_1 file (every layer affine 4-bit, the Q8_0 head affine 8-bit).
3. The crossover: rows of x at which dequantize + BLAS overtakes the native product.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import metalnn  # noqa: E402,F401
import metalnn.cpu.ggml as cg  # noqa: E402
import metalnn.cpu.im2col as ic  # noqa: E402
import metalnn.cpu.qmatmul as qm  # noqa: E402
import mlx.core as mx  # noqa: E402
from ggml_blocks import random_blocks  # noqa: E402
from metalnn import ggml  # noqa: E402

TYPES = ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "IQ4_XS"]
SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]
LAYERS = 30


def bench(fn, repeat):
    """Median seconds of mx.eval(fn()) (after two warm-up runs)."""
    for _ in range(2):
        mx.eval(fn())
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def affine(n, k, bits=4):
    w = mx.random.normal((n, k), key=mx.random.key(n * 7 + k))
    wq, s, b = mx.quantize(w, 32, bits)
    out = wq, s.astype(mx.float16), b.astype(mx.float16)
    mx.eval(out)
    return out


def packed(name, n, k, seed=0):
    cls = ggml.get_type(name)
    w = mx.array(random_blocks(name, n * (k // cls.block_size), np.random.default_rng(seed)).reshape(n, -1))
    mx.eval(w)
    return w


def affine_product(x, w, bits=4):
    wq, s, b = w
    return qm.quantized_matmul(x, wq, s, b, group_size=32, bits=bits)


def affine_dequantized(x, w, bits=4):
    wq, s, b = w
    return x @ qm.dequantize(wq, s, b, group_size=32, bits=bits, dtype=mx.float32).T


def ours(x, w, name):
    if x.shape[0] <= cg.MATMUL_MAX_ROWS:
        return cg.matmul(x, w, name)
    return x @ cg.dequantize(w, name).T


def products_table(threads, repeat, row_counts):
    print(f"\n== products (ratio = affine 4-bit time / ours), {threads} thread(s) ==")
    print(f"{'shape':>10} {'rows':>4} {'affine':>10} " + " ".join(f"{t:>7}" for t in TYPES))
    for n, k in SHAPES:
        waff = affine(n, k)
        weights = {t: packed(t, n, k) for t in TYPES if k % ggml.get_type(t).block_size == 0}
        for rows in row_counts:
            if n * rows > 8_000_000 and rows > 64:
                reps = max(3, repeat // 5)
            else:
                reps = repeat
            x = mx.random.normal((rows, k))
            mx.eval(x)
            ta = bench(lambda: affine_product(x, waff), reps)
            if rows > 1:
                ta = min(ta, bench(lambda: affine_dequantized(x, waff), reps))
            cells = []
            for t in TYPES:
                if t not in weights:
                    cells.append(f"{'-':>7}")
                    continue
                cells.append(f"{ta / bench(lambda: ours(x, weights[t], t), reps):7.2f}")
            print(f"{n:>5}x{k:<4} {rows:>4} {ta * 1e6:8.0f}us " + " ".join(cells), flush=True)


def use_more_bits(i, n):
    """llama.cpp's choice of the layers that get more bits in a K-quant mix."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_layout():
    """(name, out, in, type) of each linear layer of SmolLM2-135M in llama-quantize's Q4_K_M."""
    layers = []
    for i in range(LAYERS):
        more = use_more_bits(i, LAYERS)
        layers += [("q", 576, 576, "Q5_0"), ("k", 192, 576, "Q5_0"), ("v", 192, 576, "Q8_0" if more else "Q5_0"),
                   ("o", 576, 576, "Q5_0"), ("gate", 1536, 576, "Q5_0"), ("up", 1536, 576, "Q5_0"),
                   ("down", 576, 1536, "Q6_K" if more else "Q4_K")]
    layers.append(("head", 49152, 576, "Q8_0"))
    return layers


def token_table(threads, repeat):
    print(f"\n== one decoded token, every linear layer of SmolLM2-135M, {threads} thread(s) ==")
    x = {576: mx.random.normal((1, 576)), 1536: mx.random.normal((1, 1536))}
    mx.eval(x)
    q41, qkm, qkm_affine = {}, {}, {}
    counts = {}
    for name, n, k, t in q4_k_m_layout():
        counts[(n, k, t, name == "head")] = counts.get((n, k, t, name == "head"), 0) + 1
    total_q41 = total_qkm = total_mixed = 0.0
    for (n, k, t, head), count in sorted(counts.items()):
        bits = 8 if head else 4
        key = (n, k, bits)
        if key not in q41:
            waff = affine(n, k, bits)
            q41[key] = bench(lambda: affine_product(x[k], waff, bits), repeat)
        w = packed(t, n, k)
        tq = bench(lambda: cg.matmul(x[k], w, t), repeat)
        # what today's loader runs for the legacy types of the mix: MLX's affine layout
        if t in ("Q5_0", "Q8_0"):
            wa = affine(n, k, 5 if t == "Q5_0" else 8)
            ta = bench(lambda: affine_product(x[k], wa, 5 if t == "Q5_0" else 8), repeat)
        else:
            ta = tq
        qkm[(n, k, t)], qkm_affine[(n, k, t)] = tq, ta
        total_q41 += count * q41[key]
        total_qkm += count * tq
        total_mixed += count * ta
        print(f"  {n:>5}x{k:<4} {t:<5} x{count:<3} Q4_1 {q41[key] * 1e6:8.0f}us  ours {tq * 1e6:8.0f}us "
              f"({q41[key] / tq:4.2f})", flush=True)
    print(f"  Q4_1 file (affine 4-bit layers, affine 8-bit head):       {total_q41 * 1e3:7.2f} ms")
    print(f"  Q4_K_M file, every tensor on the GGML kernels:            {total_qkm * 1e3:7.2f} ms "
          f"(Q4_1 / Q4_K_M = {total_q41 / total_qkm:4.2f})")
    print(f"  Q4_K_M file, Q5_0/Q8_0 as affine, Q4_K/Q6_K on ours:      {total_mixed * 1e3:7.2f} ms "
          f"(Q4_1 / Q4_K_M = {total_q41 / total_mixed:4.2f})")


def crossover_table(threads, repeat, counts=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96)):
    print(f"\n== crossover: native matmul / (dequantize + BLAS) time, {threads} thread(s) "
          f"(below 1: the native product is faster) ==")
    print(f"{'shape':>10} {'type':>7} " + " ".join(f"{c:>5}" for c in counts))
    for n, k in [(1536, 576), (576, 1536)]:
        for t in TYPES:
            if k % ggml.get_type(t).block_size:
                continue
            w = packed(t, n, k)
            cells = []
            for rows in counts:
                x = mx.random.normal((rows, k))
                mx.eval(x)
                tm = bench(lambda: cg.matmul(x, w, t), repeat)
                td = bench(lambda: x @ cg.dequantize(w, t).T, repeat)
                cells.append(f"{tm / td:5.2f}")
            print(f"{n:>5}x{k:<4} {t:>7} " + " ".join(cells), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--rows", default="1,64,512", help="rows of x in the products table")
    p.add_argument("--skip-products", action="store_true")
    p.add_argument("--skip-token", action="store_true")
    p.add_argument("--skip-crossover", action="store_true")
    a = p.parse_args()
    mx.set_default_device(mx.cpu)
    print(f"metalnn.cpu.ggml native: {cg.available()} ({cg.unavailable_reason() or 'loaded'}), "
          f"avx2: {cg.has_avx2()}; affine peer native: {qm.available()}; cores: {os.cpu_count()}; "
          f"MATMUL_MAX_ROWS = {cg.MATMUL_MAX_ROWS}")
    rows = [int(r) for r in a.rows.split(",")]
    for threads in [int(t) for t in a.threads.split(",")]:
        ic.set_num_threads(threads)
        if not a.skip_products:
            products_table(threads, a.repeat, rows)
        if not a.skip_token:
            token_table(threads, a.repeat)
        if not a.skip_crossover:
            crossover_table(threads, max(5, a.repeat // 3))


if __name__ == "__main__":
    main()

"""metalnn's GGML encoders against llama.cpp's own reference quantizers, byte for byte.

Compiles ``ggml/src/ggml-quants.c`` from a llama.cpp source tree (default ``~/.cache/llamacpp/src``)
into a small shared library, with the same flags llama.cpp's build gives it (``-O3 -std=gnu11``, no
``-march``: on x86-64 that leaves no fused multiply-adds for the compiler to contract;
``-ffp-contract=off`` makes that explicit on other machines) and stubs for the four ggml functions it
calls but the quantizers never reach. F16 and BF16 go through ggml's own ``GGML_FP32_TO_FP16`` /
``GGML_FP32_TO_BF16`` from ``ggml-impl.h``. The library calls ``quantize_row_<type>_ref``: what
``llama-quantize`` writes when it is given no importance matrix.

For every type it prints the fraction of identical blocks over random rows of several kinds (normal,
heavy-tailed, uniform, one sign, rows with zero / constant / tiny / huge / subnormal blocks, outliers),
and, with ``--weights``, over the 2-D tensors of a safetensors file (each type on the tensors whose
rows are whole blocks of it).

    python scripts/check_ggml_encoders.py [--src DIR] [--rows N] [--types Q4_K,Q6_K] [--seed S]
                                          [--weights model.safetensors]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from metalnn import ggml

STUBS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <stddef.h>
#include "ggml-impl.h"

/* ggml-quants.c refers to these from code the reference quantizers never reach */
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    fprintf(stderr, "ggml_abort from %s:%d\n", file, line);
    abort();
}
size_t ggml_row_size(enum ggml_type type, int64_t ne) { (void) type; (void) ne; abort(); }
const char * ggml_type_name(enum ggml_type type) { (void) type; return "?"; }
size_t ggml_type_size(enum ggml_type type) { (void) type; abort(); }

void check_fp32_to_fp16_row(const float * x, ggml_fp16_t * y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = GGML_FP32_TO_FP16(x[i]);
}
void check_fp32_to_bf16_row(const float * x, ggml_bf16_t * y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = GGML_FP32_TO_BF16(x[i]);
}
"""

#: metalnn type name -> the C function that writes it
FUNCTIONS = {
    "F16": "check_fp32_to_fp16_row", "BF16": "check_fp32_to_bf16_row",
    "Q4_0": "quantize_row_q4_0_ref", "Q4_1": "quantize_row_q4_1_ref", "Q5_0": "quantize_row_q5_0_ref",
    "Q5_1": "quantize_row_q5_1_ref", "Q8_0": "quantize_row_q8_0_ref",
    "Q2_K": "quantize_row_q2_K_ref", "Q3_K": "quantize_row_q3_K_ref", "Q4_K": "quantize_row_q4_K_ref",
    "Q5_K": "quantize_row_q5_K_ref", "Q6_K": "quantize_row_q6_K_ref",
}


def build_library(src: Path, cache: Path) -> Path:
    """Compile ggml-quants.c and the stubs into ``cache/ggml-ref-<hash>.so`` (once per source)."""
    ggml_src = src / "ggml" / "src"
    quants = ggml_src / "ggml-quants.c"
    if not quants.is_file():
        raise SystemExit(f"{quants} not found: pass --src, a llama.cpp source tree")
    digest = hashlib.sha256(quants.read_bytes() + STUBS.encode()).hexdigest()[:16]
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"ggml-ref-{digest}.so"
    if lib.exists():
        return lib
    stubs = cache / f"stubs-{digest}.c"
    stubs.write_text(STUBS)
    flags = ["-O3", "-DNDEBUG", "-std=gnu11", "-fPIC", "-ffp-contract=off",
             f"-I{ggml_src}", f"-I{src / 'ggml' / 'include'}"]
    cc = os.environ.get("CC", "cc")
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cc, *flags, "-shared", "-o", str(tmp), str(quants), str(stubs), "-lm"]
    print("compiling:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    tmp.replace(lib)
    return lib


def reference(lib: ctypes.CDLL, qtype: str, rows: np.ndarray) -> np.ndarray:
    """llama.cpp's bytes for ``float32 [r, cols]`` rows."""
    cls = ggml.get_type(qtype)
    x = np.ascontiguousarray(rows, dtype=np.float32)
    out = np.zeros((x.shape[0], cls.row_bytes(x.shape[1])), dtype=np.uint8)
    fn = getattr(lib, FUNCTIONS[qtype])
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    fn(x.ctypes.data, out.ctypes.data, x.size)
    return out


def sample_rows(rng: np.random.Generator, n: int, cols: int) -> dict:
    """Rows of several kinds, ``float32 [n, cols]`` each."""
    kinds = {
        "normal": rng.normal(size=(n, cols)),
        "student-t(3)": rng.standard_t(3, size=(n, cols)) * 0.02,
        "uniform": rng.uniform(-1, 1, size=(n, cols)),
        "positive": np.abs(rng.normal(size=(n, cols))) + 0.1,
        "negative": -np.abs(rng.normal(size=(n, cols))) * 1e-3,
        "weights-like": rng.normal(size=(n, cols)) * rng.lognormal(-3.5, 0.5, size=(n, 1)),
    }
    odd = rng.normal(size=(n, cols))
    segment = 32
    for row in range(n):  # whole 32-value stretches (a sub-block, or a legacy block) of special values
        for start in range(0, cols, segment * 7):
            kind = rng.integers(0, 9)
            part = odd[row, start:start + segment]
            if kind == 0:
                part[:] = 0.0
            elif kind == 1:
                part[:] = rng.normal()
            elif kind == 2:
                part *= 1e-20
            elif kind == 3:
                part *= 1e4
            elif kind == 4:
                part *= 1e-41  # subnormal float32 values
            elif kind == 5:
                part[rng.integers(0, segment)] *= 1e3
            elif kind == 6:
                part[:] = np.round(part * 4) / 4  # values on a grid: ties in the rounding
            elif kind == 7:
                part[: segment // 2] = 0.0
            else:  # zeros of both signs, alone or beside values of one sign
                part[:] = np.where(rng.random(segment) < 0.5, -0.0, 0.0)
                if rng.random() < 0.5:
                    part[segment // 2:] = np.abs(part[segment // 2:]) * rng.choice([-1.0, 1.0])
    kinds["special blocks"] = odd
    return {name: np.asarray(v, dtype=np.float32) for name, v in kinds.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", type=Path, default=Path.home() / ".cache" / "llamacpp" / "src")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "metalnn" / "ggml-ref")
    parser.add_argument("--rows", type=int, default=64, help="rows of 4096 values per kind")
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--types", default=",".join(FUNCTIONS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", type=Path, help="a safetensors file whose 2-D tensors are encoded too")
    args = parser.parse_args(argv)

    lib = ctypes.CDLL(str(build_library(args.src.expanduser(), args.cache.expanduser())))
    rng = np.random.default_rng(args.seed)
    rows = sample_rows(rng, args.rows, args.cols)
    if args.weights:
        import mlx.core as mx

        for name, tensor in mx.load(str(args.weights)).items():
            if tensor.ndim == 2:
                rows[f"weights {name}"] = np.array(tensor.astype(mx.float32))
    failed = []
    print(f"{'type':6} {'blocks':>8} {'identical':>10}  {'metalnn s':>9} {'ggml s':>7}  worst kind")
    for qtype in args.types.split(","):
        cls = ggml.get_type(qtype)
        total = same = 0
        t_ours = t_ref = 0.0
        worst = (1.0, "")
        for kind, x in rows.items():
            if x.shape[1] % cls.block_size:
                continue
            t0 = time.perf_counter()
            ours = cls.encode(x)
            t1 = time.perf_counter()
            want = reference(lib, qtype, x)
            t2 = time.perf_counter()
            t_ours, t_ref = t_ours + t1 - t0, t_ref + t2 - t1
            eq = (ours.reshape(-1, cls.type_size) == want.reshape(-1, cls.type_size)).all(axis=1)
            total, same = total + eq.size, same + int(eq.sum())
            worst = min(worst, (float(eq.mean()), kind))
        if not total:
            print(f"{qtype:6} no rows of whole blocks")
            continue
        frac = same / total
        note = "" if frac == 1.0 else f"{worst[1]} ({worst[0]:.4%})"
        print(f"{qtype:6} {total:8d} {frac:10.4%}  {t_ours:9.2f} {t_ref:7.2f}  {note}", flush=True)
        if frac != 1.0:
            failed.append(qtype)
    if failed:
        print("not identical:", ", ".join(failed))
        return 1
    print("every block identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())

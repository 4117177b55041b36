"""Decoding products side by side with llama.cpp's own kernels: one input row times a packed weight.

The products are most of a decoded token (two thirds of it on SmolLM2, nearly all of it on a 1B
model), so this compares them alone, kernel against kernel, on the same bytes:

* llama.cpp: its CPU backend's ``vec_dot`` of each type (what a ``[1, K] x [N, K]`` product runs per
  weight row when the type is not repacked), the input quantized to the type's ``vec_dot_type``
  (Q8_0 for the legacy types, Q8_K for the K-quants) as llama.cpp does; rows split evenly over
  OpenMP threads. A small C program, compiled here against the ``libggml`` that
  ``../shared/tools/build-llamacpp`` built.
* metalnn: `metalnn.cpu.ggml.matmul` on the same weight bytes and the same input, with float32
  inputs (`metalnn.functional.ggml_exact_inputs`), as by default (split inputs, two int8 levels,
  for the common types: `metalnn.cpu.ggml.split_inputs`) and with int8 inputs
  (`metalnn.functional.ggml_int8_inputs`).

``--mats`` copies of an ``N x K`` weight (default 16 of 8192 x 2048: ~140-280 MB, more than the
caches hold, as a model's weights are) are multiplied in turn; the best of ``--repeat`` passes is
kept. Ratios are llama.cpp's time / metalnn's (above 1: metalnn faster). The two results are
compared as a check that both read the same blocks (they differ by the inputs' int8 rounding).

    python scripts/bench_products_llamacpp.py [--types Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K] [--threads 1,2]
                                               [--shape 8192x2048] [--mats 16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_common as common  # noqa: E402

# take split inputs by default (metalnn.cpu.ggml.split_inputs)
SPLIT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

HARNESS = r"""
// out = W . x for `mats` copies of one packed weight, llama.cpp's vec_dot per row; prints the best
// time of `repeat` passes (ms) and writes the first copy's output.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "ggml.h"
#include "ggml-cpu.h"
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void* slurp(const char* path, size_t want) {
  FILE* f = fopen(path, "rb"); if (!f) { perror(path); exit(2); }
  void* p = malloc(want); if (fread(p, 1, want, f) != want) { fprintf(stderr, "short file %s\n", path); exit(2); }
  fclose(f); return p;
}
int main(int argc, char** argv) {
  if (argc != 9) { fprintf(stderr, "usage: type N K mats repeat weights x out\n"); return 2; }
  const int type = atoi(argv[1]), N = atoi(argv[2]), K = atoi(argv[3]), mats = atoi(argv[4]), repeat = atoi(argv[5]);
  ggml_cpu_init();
  const struct ggml_type_traits_cpu* tc = ggml_get_type_traits_cpu(type);
  const size_t rb = ggml_row_size(type, K);
  char* first = slurp(argv[6], rb * N);
  char** w = malloc(sizeof(char*) * mats);
  for (int i = 0; i < mats; ++i) { w[i] = malloc(rb * N); memcpy(w[i], first, rb * N); }
  float* x = slurp(argv[7], sizeof(float) * K);
  const enum ggml_type vt = tc->vec_dot_type;
  char* xq = malloc(ggml_row_size(vt, K));
  ggml_get_type_traits_cpu(vt)->from_float(x, xq, K);
  float* out = malloc(sizeof(float) * N * mats);
  double best = 1e30;
  for (int rep = 0; rep < repeat; ++rep) {
    const double t = now();
    for (int i = 0; i < mats; ++i) {
      #pragma omp parallel for schedule(static)
      for (int r = 0; r < N; ++r) tc->vec_dot(K, out + (size_t)i * N + r, 0, w[i] + rb * r, 0, xq, 0, 1);
    }
    const double d = now() - t;
    if (d < best) best = d;
  }
  FILE* f = fopen(argv[8], "wb"); fwrite(out, sizeof(float), N, f); fclose(f);
  printf("%.6f\n", best * 1e3);
  return 0;
}
"""


def build_harness(folder: Path, home: Path) -> Path:
    """Compile the C harness against llama.cpp's libggml (built by ../shared/tools/build-llamacpp)."""
    src, exe = folder / "vec_dot.c", folder / "vec_dot"
    src.write_text(HARNESS)
    lib = home / "build" / "bin"
    inc = home / "src" / "ggml" / "include"
    if not (lib / "libggml-cpu.so").exists():
        sys.exit(f"libggml-cpu.so not found in {lib}: build llama.cpp (../shared/tools/build-llamacpp)")
    res = subprocess.run(["gcc", "-O2", "-fopenmp", "-o", str(exe), str(src), f"-I{inc}", f"-L{lib}", "-lggml-cpu",
                          "-lggml-base", f"-Wl,-rpath,{lib}"], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"compiling the harness failed:\n{res.stderr[-3000:]}")
    return exe


def ms(t: float) -> str:
    """A time in milliseconds with three significant digits (weights that fit in the caches take < 1 ms)."""
    return f"{t:.1f}" if t >= 10 else f"{t:.{2 if t >= 1 else 3}f}"


def time_metalnn(cls, weights, x, repeat: int) -> float:
    import mlx.core as mx
    from metalnn.cpu import ggml as cg

    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        mx.eval([cg.matmul(x, w, cls) for w in weights])
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K", help="comma-separated GGML types")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--shape", default="8192x2048", help="N x K of the weight (default 8192x2048)")
    p.add_argument("--mats", type=int, default=16, help="copies of the weight multiplied in turn (default 16)")
    p.add_argument("--repeat", type=int, default=5, help="passes, the best kept (default 5)")
    p.add_argument("--llamacpp-home", type=Path, default=Path("~/.cache/llamacpp").expanduser(),
                   help="where ../shared/tools/build-llamacpp put llama.cpp (default ~/.cache/llamacpp)")
    args = p.parse_args(argv)
    n, k = (int(v) for v in args.shape.lower().split("x"))

    import mlx.core as mx

    from metalnn import ggml as gg
    from metalnn.cpu import ggml as cg
    from metalnn.cpu import im2col
    from metalnn.functional import ggml_exact_inputs, ggml_int8_inputs

    if not cg.has_avx2():
        sys.exit("metalnn's AVX2 kernels are not running here (no extension or no AVX2)")
    rng = np.random.default_rng(0)
    values = mx.array((rng.random((n, k), dtype=np.float32) - 0.5) * 0.04)
    x_np = rng.standard_normal(k).astype(np.float32)
    x = mx.array(x_np[None, :])
    print(f"{common.load_line()}; weight {n} x {k}, {args.mats} copies, best of {args.repeat}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        exe = build_harness(tmp, args.llamacpp_home)
        (tmp / "x.bin").write_bytes(x_np.tobytes())
        for name in args.types.split(","):
            cls = gg.get_type(name)
            packed = np.array(cls.encode(values))
            (tmp / "w.bin").write_bytes(packed.tobytes())
            weights = [mx.array(packed.copy()) for _ in range(args.mats)]
            mx.eval(weights)
            mb = packed.nbytes * args.mats / 1e6
            for threads in (int(t) for t in args.threads.split(",")):
                res = subprocess.run([str(exe), str(cls.type_id), str(n), str(k), str(args.mats), str(args.repeat),
                                      str(tmp / "w.bin"), str(tmp / "x.bin"), str(tmp / "out.bin")],
                                     capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
                if res.returncode != 0:
                    sys.exit(f"the harness failed on {name}: {res.stderr[-2000:]}")
                peer = float(res.stdout.split()[-1])
                reference = np.fromfile(tmp / "out.bin", dtype=np.float32)
                im2col.set_num_threads(threads)
                times = {}
                modes = {"float": ggml_exact_inputs(), "default": contextlib.nullcontext(),
                         "int8": ggml_int8_inputs()}
                for mode, context in modes.items():
                    if mode == "default" and name not in SPLIT_TYPES:
                        times[mode] = times["float"]  # the default is float32 inputs
                        continue
                    with context:
                        time_metalnn(cls, weights[:1], x, 1)
                        times[mode] = time_metalnn(cls, weights, x, args.repeat)
                        ours = np.array(cg.matmul(x, weights[0], cls))[0]
                    diff = np.abs(ours - reference).max() / max(np.abs(reference).max(), 1e-30)
                    if diff > 0.05:
                        sys.exit(f"{name}: metalnn and llama.cpp disagree (max difference {diff:.3g} of the largest)")
                rows.append((name, threads, mb, peer, times))
                print(f"  {name} {threads} thread(s): llama.cpp {ms(peer)} ms ({mb / peer:.1f} GB/s); metalnn "
                      + ", ".join(f"{mode} inputs {ms(t)} ms ({peer / t:.2f}x)" for mode, t in times.items()),
                      flush=True)
            del weights
    print(f"\n{common.load_line()}")
    print("| type | threads | llama.cpp vec_dot | metalnn float inputs | ratio | default (split inputs) "
          "| ratio | int8 inputs | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, threads, mb, peer, times in rows:
        print(f"| {name} | {threads} | {ms(peer)} ms ({mb / peer:.1f} GB/s) | "
              + " | ".join(f"{ms(times[m])} ms | {peer / times[m]:.2f}x" for m in ("float", "default", "int8"))
              + " |")


if __name__ == "__main__":
    main()

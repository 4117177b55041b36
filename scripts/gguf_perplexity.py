"""Perplexity of llama.cpp-made GGUF files three ways: metalnn, transformers, llama.cpp itself.

From the bundled SmolLM2-135M-Instruct Q4_1 file, ``llama-quantize --allow-requantize`` makes an F16
file, then from that F16 file llama.cpp's common mixes (Q4_K_M, Q5_K_M, Q6_K, Q3_K_M, Q2_K, IQ4_XS,
Q4_0, Q8_0), cached in ``--work``. For each file the perplexity of a text from ``examples/data/`` is
computed as ``llama-perplexity`` computes it: the whole text tokenized once (a BOS token first when
the vocabulary adds one: ``tokenizer.ggml.add_bos_token``, else the tokenizer model's default), cut
in chunks of ``n_ctx`` tokens, the first token of each chunk replaced by BOS when BOS is added, each
chunk a fresh context, and only the second half scored (the logits at positions
``n_ctx/2 .. n_ctx-2`` predict the tokens ``n_ctx/2+1 .. n_ctx-1``: 255 tokens per chunk of 512):

* metalnn: ``load_pretrained(file)`` (blocks kept packed) and ``load_tokenizer(file)``;
* transformers: ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)``,
  its own dequantization of the same file (gguf-py): the exact float model;
* llama.cpp: ``llama-perplexity -m FILE -f TEXT -c n_ctx --chunks N -t THREADS`` ("Final estimate").
  On the first file it also writes its tokens (``--kl-divergence-base``), compared with ours; where they
  differ, metalnn is also run on llama.cpp's tokens and transformers only on those (the two models are
  compared on the same tokens, and the tokenizer apart from the model).

Where metalnn and llama.cpp differ by more than 2% on the same tokens, llama.cpp is also run on its own
float32 dequantization of the file (``llama-quantize --allow-requantize FILE OUT F32``): when that agrees
with metalnn, the difference is llama.cpp's products with 8-bit-quantized activations, not the weights.

Also each file's size and metalnn's loaded parameter bytes. Checks (exit status 1 when one fails):
params <= 1.2x file, |metalnn/transformers - 1| <= 0.2%, |metalnn/llama.cpp - 1| <= 2%.

    python scripts/gguf_perplexity.py [--chunks 4] [--types Q4_K_M,Q8_0] [--work DIR] [--no-transformers]
"""

from __future__ import annotations

import argparse
import gc
import math
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_common as common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = ROOT / "examples" / "data" / "kjv_genesis_exodus.txt"
ALL_TYPES = ("Q4_1", "F16") + common.MIXES
MAX_PARAMS_RATIO = 1.2
MAX_TRANSFORMERS = 0.002
MAX_LLAMACPP = 0.02


def add_bos_of(meta: dict) -> bool:
    """Whether llama.cpp's tokenizer adds BOS: the file's ``tokenizer.ggml.add_bos_token``, else the
    default of its tokenizer model (SentencePiece ``llama``: yes; BPE ``gpt2`` and the others: no)."""
    value = meta.get("tokenizer.ggml.add_bos_token")
    if value is not None:
        return bool(value)
    return meta.get("tokenizer.ggml.model") == "llama"


def tokens_of(path: Path, text: str):
    """``(tokens, add_bos, bos_id)`` of ``text`` as ``llama-perplexity`` tokenizes it, with metalnn's
    tokenizer of the file."""
    import metalnn as mn
    from metalnn.llm.gguf.reader import read_header

    meta = read_header(path).metadata
    tok = mn.models.load_tokenizer(path)
    add_bos = add_bos_of(meta)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    ids = tok.encode(text, add_special_tokens=False)
    return ([bos] if add_bos else []) + ids, add_bos, bos


def tok_pre(path: Path):
    from metalnn.llm.gguf.reader import read_header

    return read_header(path).metadata.get("tokenizer.ggml.pre")


def chunks(tokens, n_ctx: int, n_chunks: int, add_bos: bool, bos):
    for i in range(n_chunks):
        seq = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if add_bos:
            seq[0] = bos
        yield seq


def nll_sum(logits: np.ndarray, targets) -> float:
    """Sum of ``-log softmax(logits)[target]`` (float64, as llama.cpp sums)."""
    x = logits.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=-1)) + m[:, 0]
    return float((lse - x[np.arange(len(targets)), targets]).sum())


def ppl_metalnn(path: Path, seqs, n_ctx: int):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import metalnn as mn

    model = mn.models.load_pretrained(path)
    params = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    first = n_ctx // 2
    nll = count = 0
    for seq in seqs:
        logits = model(mx.array(seq, dtype=mx.int32)[None])[0, first:n_ctx - 1].astype(mx.float32)
        nll += nll_sum(np.array(logits), np.array(seq[first + 1:]))
        count += n_ctx - 1 - first
    del model
    gc.collect()
    return math.exp(nll / count), params


def ppl_transformers(path: Path, seqs, n_ctx: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    first = n_ctx // 2
    nll = count = 0
    with torch.no_grad():
        for seq in seqs:
            logits = model(torch.tensor([seq])).logits[0, first:n_ctx - 1]
            nll += nll_sum(logits.numpy(), np.array(seq[first + 1:]))
            count += n_ctx - 1 - first
    del model
    gc.collect()
    return math.exp(nll / count)


def ppl_llamacpp(path: Path, text_file: Path, n_ctx: int, n_chunks: int, threads: int, bin_folder,
                 tokens_out: Path | None = None, timeout: int = 900):
    """``(PPL, tokens or None)`` from ``llama-perplexity``; the tokens (the first ``n_chunks * n_ctx``)
    from the ``--kl-divergence-base`` file when ``tokens_out`` is given."""
    cmd = [common.tool("llama-perplexity", bin_folder), "-m", str(path), "-f", str(text_file), "-c", str(n_ctx),
           "--chunks", str(n_chunks), "-t", str(threads)]
    if tokens_out is not None:
        cmd += ["--kl-divergence-base", str(tokens_out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    out = res.stdout + res.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    if res.returncode != 0 or not m:
        sys.exit(f"llama-perplexity failed on {path.name} ({res.returncode}):\n{out[-3000:]}")
    toks = None
    if tokens_out is not None:
        with open(tokens_out, "rb") as f:
            magic = f.read(8)
            assert magic == b"_logits_", magic
            ctx, _n_vocab, n_chunk = struct.unpack("<iii", f.read(12))
            toks = np.frombuffer(f.read(4 * ctx * n_chunk), dtype=np.int32).tolist()
        tokens_out.unlink()
    return float(m.group(1)), toks


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=common.DEFAULT_WORK, help="where the made files are cached")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="the text (default: examples/data/kjv_...)")
    p.add_argument("--chars", type=int, default=60000,
                   help="use the text's first N characters, cut at a line end (default 60000)")
    p.add_argument("--ctx", type=int, default=512, help="n_ctx (default 512)")
    p.add_argument("--chunks", type=int, default=4, help="chunks scored (default 4)")
    p.add_argument("--threads", type=int, default=2, help="llama-perplexity threads (default 2)")
    p.add_argument("--types", default=",".join(ALL_TYPES), help="comma-separated types (default: all)")
    p.add_argument("--llamacpp", default=None, help="folder of llama.cpp's tools")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers column")
    args = p.parse_args(argv)

    types = [t.strip() for t in args.types.split(",") if t.strip()]
    print(f"llama.cpp {common.llamacpp_version(args.llamacpp)}; {common.load_line()}", flush=True)
    files = common.make_files(args.work, types, args.llamacpp)

    text = args.text.read_text()
    if args.chars and len(text) > args.chars:
        text = text[:text.rfind("\n", 0, args.chars) + 1]
    text_file = args.work / f"perplexity-{args.text.stem}-{len(text)}.txt"
    args.work.mkdir(parents=True, exist_ok=True)
    text_file.write_text(text)

    rows, failures, ref_tokens, ll_tokens = [], [], None, None
    for n, t in enumerate(types):
        path = files[t]
        t0 = time.perf_counter()
        tokens, add_bos, bos = tokens_of(path, text)
        n_chunks = min(args.chunks, len(tokens) // args.ctx)
        if ref_tokens is not None and tokens != ref_tokens:
            failures.append(f"{t}: metalnn's tokens differ from those of {types[0]}")
        with tempfile.TemporaryDirectory() as tmp:
            ppl_ll, got = ppl_llamacpp(path, text_file, args.ctx, n_chunks, args.threads, args.llamacpp,
                                       Path(tmp) / "base.bin" if n == 0 else None)
        ours = tokens[:n_chunks * args.ctx]
        if n == 0:
            ref_tokens, ll_tokens = tokens, got
            diff = [i for i, (a, b) in enumerate(zip(ll_tokens, ours)) if a != b]
            print(f"tokens: {len(tokens)} ({'BOS first' if add_bos else 'no BOS'}: add_bos_token {add_bos}); "
                  f"llama-perplexity's first {len(ll_tokens)} tokens "
                  f"{'equal ours' if not diff else f'DIFFER from ours from token {diff[0]} on'}", flush=True)
            if diff:
                tok = __import__("metalnn").models.load_tokenizer(path)
                i = diff[0]
                show = lambda ids: [tok.decode([x], skip_special_tokens=False) for x in ids]  # noqa: E731
                print(f"  metalnn:   {ours[i - 2:i + 4]} {show(ours[i - 2:i + 4])}\n"
                      f"  llama.cpp: {ll_tokens[i - 2:i + 4]} {show(ll_tokens[i - 2:i + 4])}", flush=True)
                failures.append(f"metalnn's tokenization differs from llama-perplexity's from token {diff[0]} on "
                                f"(pre-tokenizer {tok_pre(path)!r})")
        same = ll_tokens == ours
        seqs = list(chunks(tokens, args.ctx, n_chunks, add_bos, bos))
        ppl_mn, params = ppl_metalnn(path, seqs, args.ctx)
        # the models compared on the same tokens: llama.cpp's (the same as ours when they agree)
        ll_seqs = seqs if same else [ll_tokens[i * args.ctx:(i + 1) * args.ctx] for i in range(n_chunks)]
        ppl_mn_ll = ppl_mn if same else ppl_metalnn(path, ll_seqs, args.ctx)[0]
        ppl_hf = None if args.no_transformers else ppl_transformers(path, ll_seqs, args.ctx)
        size = path.stat().st_size
        row = dict(type=t, file=size, params=params, ratio=params / size, mn=ppl_mn, mn_ll=ppl_mn_ll, hf=ppl_hf,
                   ll=ppl_ll, d_hf=None if ppl_hf is None else abs(ppl_mn_ll / ppl_hf - 1),
                   d_ll=abs(ppl_mn / ppl_ll - 1), d_ll_same=abs(ppl_mn_ll / ppl_ll - 1))
        rows.append(row)
        if row["ratio"] > MAX_PARAMS_RATIO:
            failures.append(f"{t}: parameters {row['ratio']:.3f}x the file (> {MAX_PARAMS_RATIO})")
        if row["d_hf"] is not None and row["d_hf"] > MAX_TRANSFORMERS:
            failures.append(f"{t}: metalnn/transformers off by {row['d_hf']:.3%} (> {MAX_TRANSFORMERS:.1%})")
        for key, what in (("d_ll", "metalnn (its tokens)"), ("d_ll_same", "metalnn (llama.cpp's tokens)")):
            if row[key] > MAX_LLAMACPP and (key == "d_ll" or not same):
                failures.append(f"{t}: {what}/llama.cpp off by {row[key]:.3%} (> {MAX_LLAMACPP:.0%})")
        if row["d_ll_same"] > MAX_LLAMACPP and t not in ("F16", "BF16", "F32"):
            # Which side is off: llama.cpp on its own float32 dequantization of the file (its products then
            # take float activations, not the 8-bit-quantized ones of its quantized dot products).
            with tempfile.TemporaryDirectory() as tmp:
                f32 = common.quantize(path, Path(tmp) / f"{t}-dequantized.F32.gguf", "F32", args.llamacpp)
                ppl_f32, _ = ppl_llamacpp(f32, text_file, args.ctx, n_chunks, args.threads, args.llamacpp)
            note = (f"{t}: llama.cpp on its own F32 dequantization of the file: PPL {ppl_f32:.4f} "
                    f"(metalnn/that - 1 = {abs(ppl_mn_ll / ppl_f32 - 1):.3%}; llama.cpp's quantized products "
                    f"{ppl_ll / ppl_f32 - 1:+.3%})")
            print("  " + note, flush=True)
            failures.append(note)
        hf = "-" if ppl_hf is None else f"{ppl_hf:.4f}"
        print(f"  {t}: metalnn {ppl_mn:.4f} (on llama.cpp's tokens {ppl_mn_ll:.4f}), transformers {hf}, "
              f"llama.cpp {ppl_ll:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    print(f"\n{args.text.name} (first {len(text)} characters), {n_chunks} chunks of {args.ctx} tokens, "
          f"{n_chunks * (args.ctx - 1 - args.ctx // 2)} tokens scored; {common.load_line()}")
    if same:
        print("| type | file MB | params MB | params/file | PPL metalnn | PPL transformers | PPL llama.cpp "
              "| metalnn/transformers - 1 | metalnn/llama.cpp - 1 |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    else:
        print("Tokens differ: 'own' = metalnn on its own tokens; the other columns on llama-perplexity's tokens")
        print("| type | file MB | params MB | params/file | PPL metalnn (own) | PPL metalnn | PPL transformers "
              "| PPL llama.cpp | metalnn/transformers - 1 | metalnn (own)/llama.cpp - 1 | metalnn/llama.cpp - 1 |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        hf = "-" if r["hf"] is None else f"{r['hf']:.4f}"
        dhf = "-" if r["d_hf"] is None else f"{r['d_hf']:.3%}"
        own = "" if same else f"{r['mn']:.4f} | "
        d_own = "" if same else f"{r['d_ll']:.3%} | "
        print(f"| {r['type']} | {r['file'] / 1e6:.1f} | {r['params'] / 1e6:.1f} | {r['ratio']:.3f} | {own}"
              f"{r['mn_ll']:.4f} | {hf} | {r['ll']:.4f} | {dhf} | {d_own}{r['d_ll_same']:.3%} |")
    if failures:
        print("\nFAILED:\n  " + "\n  ".join(failures))
        return 1
    print("\nall checks hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""metalnn's GGUF export checked in llama.cpp (not run in CI: needs llama.cpp's tools).

1. llama.cpp makes the float model: ``llama-quantize --allow-requantize`` turns the bundled SmolLM2
   Q4_1 file into F16 (the float model metalnn exports from).
2. metalnn exports that model as Q4_K_M (``metalnn export F16.gguf OUT.gguf --type Q4_K_M``); llama.cpp
   quantizes the same F16 file to Q4_K_M (``llama-quantize F16.gguf OUT.gguf Q4_K_M``).
3. Both files: per-tensor types and bytes compared, then ``llama-perplexity -f TEXT -c 512`` of each in
   llama.cpp (which also proves llama.cpp loads metalnn's file). The issue asks for metalnn's within 2%.

    python scripts/check_gguf_export.py [--llamacpp ~/.cache/llamacpp/build/bin] [--chunks 40] [--threads 2]

Measured (SmolLM2-135M-Instruct, kjv_genesis_exodus.txt, -c 512, 20 chunks): metalnn's Q4_K_M file has
llama.cpp's 272 tensors with the same types and is byte-identical with llama-quantize's; perplexity F16
5.2835, Q4_K_M by llama-quantize 5.9146, Q4_K_M by metalnn 5.9146 (+0.000%).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "examples" / "data" / "kjv_genesis_exodus.txt"


def run(cmd, **kw):
    print("$", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, **kw)


def perplexity(bin_dir: Path, model: Path, chunks: int, threads: int) -> float:
    out = run([bin_dir / "llama-perplexity", "-m", model, "-f", TEXT, "-c", 512, "--chunks", chunks, "-t", threads])
    text = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", text)
    if m is None:
        sys.exit(f"llama-perplexity printed no final estimate for {model}:\n{text[-2000:]}")
    return float(m.group(1))


def compare(a: Path, b: Path) -> tuple:
    import gguf
    import numpy as np

    ra, rb = gguf.GGUFReader(str(a)), gguf.GGUFReader(str(b))
    ta = {t.name: t for t in ra.tensors}
    tb = {t.name: t for t in rb.tensors}
    names = set(ta) == set(tb)
    types = sum(ta[n].tensor_type != tb[n].tensor_type for n in ta if n in tb)
    same = sum(np.array_equal(np.asarray(ta[n].data), np.asarray(tb[n].data)) for n in ta if n in tb)
    return names, types, same, len(ta)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llamacpp", type=Path, default=Path.home() / ".cache/llamacpp/build/bin")
    parser.add_argument("--chunks", type=int, default=40, help="512-token chunks scored (default 40)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep", type=Path, default=None, help="folder for the files (default: a temporary one)")
    args = parser.parse_args()
    from metalnn.llm.bundled import smollm2_path

    bins = args.llamacpp
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        f16, theirs, ours = folder / "f16.gguf", folder / "llamacpp_q4km.gguf", folder / "metalnn_q4km.gguf"
        run([bins / "llama-quantize", "--allow-requantize", smollm2_path(), f16, "F16", args.threads])
        run([bins / "llama-quantize", f16, theirs, "Q4_K_M", args.threads])
        run([sys.executable, "-m", "metalnn", "export", f16, ours, "--type", "Q4_K_M", "--force"])
        names, types, same, total = compare(ours, theirs)
        print(f"tensors: names equal {names}; {types} of {total} differ in type; {same} of {total} byte-identical")
        ppl_f16 = perplexity(bins, f16, args.chunks, args.threads)
        ppl_theirs = perplexity(bins, theirs, args.chunks, args.threads)
        ppl_ours = perplexity(bins, ours, args.chunks, args.threads)
        rel = ppl_ours / ppl_theirs - 1
        print(f"llama-perplexity, {TEXT.name}, -c 512, {args.chunks} chunks:")
        print(f"  F16 (llama.cpp)          {ppl_f16:.4f}")
        print(f"  Q4_K_M by llama-quantize {ppl_theirs:.4f}")
        print(f"  Q4_K_M by metalnn export {ppl_ours:.4f}   ({rel:+.3%} vs llama.cpp's; required within 2%)")
        return 0 if abs(rel) <= 0.02 and names else 1


if __name__ == "__main__":
    sys.exit(main())

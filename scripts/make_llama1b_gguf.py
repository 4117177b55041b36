"""A 1B-class Llama with random weights as GGUF files, for memory and speed measurements (their values
do not matter there): Q8_0 and Q4_K_M, made as people make them from a Hugging Face folder.

* a Hugging Face folder: ``config.json`` (Llama, hidden 2048, 16 layers, 32 heads, 8 KV heads,
  intermediate 8192, tied embeddings: 1.07B parameters), the weights in float16 safetensors shards
  (normal, std 0.02; norms at one; seeded) and SmolLM2's tokenizer (vocabulary 49152), rebuilt by
  transformers from the bundled SmolLM2 GGUF file (no downloads);
* ``llama1b.F16.gguf``: llama.cpp's ``convert_hf_to_gguf.py --outtype f16`` on that folder;
* ``llama1b.Q8_0.gguf`` and ``llama1b.Q4_K_M.gguf``: ``llama-quantize`` of the F16 file.

Idempotent: a file that exists is kept. The float16 shards are deleted once the F16 file is made
(``--keep-hf`` keeps them). Default folder: ``~/.cache/metalnn-gguf/llama1b``.

    python scripts/make_llama1b_gguf.py [--out DIR] [--types Q8_0,Q4_K_M] [--keep-hf]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_common as common  # noqa: E402

DEFAULT_OUT = common.DEFAULT_WORK / "llama1b"
CONVERTER = Path("~/.cache/llamacpp/src/convert_hf_to_gguf.py").expanduser()
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 49152,
    "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "torch_dtype": "float16",
    "bos_token_id": 1, "eos_token_id": 2,
}


def layer_shapes(cfg: dict, i: int) -> dict:
    """``{name: shape}`` of layer ``i``'s weights, Hugging Face's names and ``[out, in]`` shapes."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    p = f"model.layers.{i}."
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)}


def write_hf(folder: Path, seed: int = 0):
    """The Hugging Face folder: config, one float16 shard per layer (plus one for the table and the
    final norm) with its index, and the tokenizer."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    cfg = CONFIG
    groups = [{"model.embed_tokens.weight": (cfg["vocab_size"], cfg["hidden_size"]),
               "model.norm.weight": (cfg["hidden_size"],)}]
    groups += [layer_shapes(cfg, i) for i in range(cfg["num_hidden_layers"])]
    weight_map, total = {}, 0
    for n, group in enumerate(groups):
        shard = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in group.items():
            if name.endswith("norm.weight"):
                tensors[name] = np.ones(shape, dtype=np.float16)
            else:
                tensors[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
            weight_map[name] = shard
            total += tensors[name].nbytes
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(folder)


def write_tokenizer(folder: Path):
    """SmolLM2's tokenizer (``tokenizer.json``), rebuilt by transformers from the bundled GGUF file."""
    from transformers import AutoTokenizer

    src = common.bundled()
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.save_pretrained(str(folder))


def convert_f16(hf: Path, out: Path, timeout: int = 3600) -> Path:
    """``convert_hf_to_gguf.py hf --outtype f16 --outfile out`` unless ``out`` exists."""
    if out.exists():
        return out
    if not CONVERTER.is_file():
        sys.exit(f"{CONVERTER} not found: llama.cpp's source is needed (../shared/tools/build-llamacpp)")
    if not (hf / "config.json").exists():
        write_hf(hf)
    tmp = out.with_suffix(".part")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as stub:
        # the converter imports sentencepiece before it looks for a tokenizer.model (this folder has
        # none, it falls back to tokenizer.json): an empty module stands in when the package is absent
        (Path(stub) / "sentencepiece.py").write_text("class SentencePieceProcessor:\n    pass\n")
        env = dict(os.environ)
        if importlib.util.find_spec("sentencepiece") is None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (stub, env.get("PYTHONPATH")) if p)
        res = subprocess.run([sys.executable, str(CONVERTER), str(hf), "--outtype", "f16", "--outfile", str(tmp)],
                             capture_output=True, text=True, timeout=timeout, env=env)
    if res.returncode != 0:
        sys.exit(f"convert_hf_to_gguf.py failed ({res.returncode}):\n{res.stderr[-3000:]}")
    tmp.rename(out)
    print(f"  made {out.name} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


def make_files(out: Path = DEFAULT_OUT, types=("Q8_0", "Q4_K_M"), keep_hf: bool = False) -> dict:
    """``{type: path}`` of the 1B files (F16 and each of ``types``), made when missing."""
    out.mkdir(parents=True, exist_ok=True)
    files = {t: out / f"llama1b.{t}.gguf" for t in types}
    if all(p.exists() for p in files.values()):
        f16 = out / "llama1b.F16.gguf"
        return {"F16": f16, **files} if f16.exists() else files
    free = shutil.disk_usage(out).free
    if free < 8 << 30:
        sys.exit(f"{out}: {free / 2**30:.1f} GiB free; making the files takes up to 8 GiB")
    f16 = convert_f16(out / "hf", out / "llama1b.F16.gguf")
    for t, path in files.items():
        if t != "F16":
            common.quantize(f16, path, t)
    if not keep_hf and (out / "hf").exists():
        shutil.rmtree(out / "hf")
    return {"F16": f16, **files}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder of the files (default {DEFAULT_OUT})")
    p.add_argument("--types", default="Q8_0,Q4_K_M", help="llama-quantize types (default Q8_0,Q4_K_M)")
    p.add_argument("--keep-hf", action="store_true", help="keep the float16 Hugging Face folder")
    args = p.parse_args(argv)
    for t, path in make_files(args.out, [t for t in args.types.split(",") if t], args.keep_hf).items():
        print(f"{t:8s} {path} ({os.path.getsize(path) / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()

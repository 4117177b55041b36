"""Peak resident memory while decoding, side by side with llama.cpp on the same GGUF files.

Each side runs in a fresh process, one after the other; its peak resident set is the ``VmHWM`` of
its ``/proc/PID/status`` (the kernel's high-water mark of the process's memory, file pages it maps
included), read every 20 ms while it runs; metalnn's process also reports its own at the end. (Not
``ru_maxrss``: Linux carries the parent's resident set at ``fork`` into the child's ``ru_maxrss``
across ``exec``, so a child of a large parent would report the parent's size.)

* llama.cpp: ``llama-bench -m FILE -t THREADS -p 0 -n N -r 1`` (loads the model, mapped, and its
  vocabulary, then decodes N tokens one at a time from an empty context);
* metalnn: ``load_pretrained(FILE)`` and ``load_tokenizer(FILE)`` (as ``metalnn generate`` loads),
  then a greedy decode of N tokens after a short encoded prompt. The process also reports its
  ``VmHWM`` and resident set after each stage, MLX's peak and active memory, the parameters' bytes and
  the load time (it reads ``/proc/self/status``: Linux).

Files: the bundled SmolLM2-135M-Instruct Q4_1 and the 1B Llama Q8_0 and Q4_K_M files of
``make_llama1b_gguf.py`` (made when missing), or ``--files``. Check (exit status 1 when it fails):
metalnn's peak <= ``--limit`` x llama.cpp's (default 1.2). ``--runs N`` runs metalnn N times per file
(load times vary with the machine's load); ``--metalnn DIR`` measures another checkout's metalnn (an
earlier commit's, to compare load times and peaks).

    python scripts/bench_memory.py [--files A.gguf,B.gguf] [--tokens 16] [--threads 2] [--limit 1.2]
                                   [--runs 3] [--metalnn DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_common as common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

# Runs in the measured metalnn process: prints one JSON line of what it saw.
CHILD = r"""
import json, sys, time
file, tokens = sys.argv[1], int(sys.argv[2])

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out

import mlx.core as mx
import metalnn
from metalnn.llm.generation import generate
from metalnn.llm.models import load_pretrained, load_tokenizer

stages = {"imported": status()}
start = time.perf_counter()
model = load_pretrained(file)
load_s = time.perf_counter() - start
stages["model loaded"] = status()
load_peak = mx.get_peak_memory()
tok = load_tokenizer(file)
tokenizer_s = time.perf_counter() - start - load_s
stages["tokenizer loaded"] = status()
prompt = tok.encode("The quick brown fox")
start = time.perf_counter()
out = generate(model, prompt, tokens, eos_token_id=())
decode_s = time.perf_counter() - start
stages["decoded"] = status()
params = sum(p.nbytes for p in model.named_parameters().values())
print(json.dumps({"metalnn": metalnn.__file__, "load_s": load_s, "tokenizer_s": tokenizer_s,
                  "decode_s": decode_s, "tokens": len(out), "param_bytes": params,
                  "mlx_peak": mx.get_peak_memory(), "mlx_load_peak": load_peak, "mlx_active": mx.get_active_memory(),
                  "mlx_cache": mx.get_cache_memory(), "stages": stages}))
"""


def high_water(pid: int) -> int:
    """The ``VmHWM`` of process ``pid`` in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def spawn(cmd, env=None, cwd=None, timeout: int = 900):
    """``(stdout, stderr, returncode, peak resident bytes of this child)``: the child's ``VmHWM``,
    read every 20 ms until it exits."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    out_chunks, err_chunks = [], []

    def drain(stream, chunks):
        for block in iter(lambda: stream.read(65536), b""):
            chunks.append(block)

    readers = [threading.Thread(target=drain, args=(proc.stdout, out_chunks), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, err_chunks), daemon=True)]
    for r in readers:
        r.start()
    deadline = time.monotonic() + timeout
    peak = 0
    while True:
        peak = max(peak, high_water(proc.pid))  # before wait4 reaps it: a zombie has no memory to report
        pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            os.wait4(proc.pid, 0)
            sys.exit(f"{cmd[0]} ran past {timeout} s")
        time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    for r in readers:
        r.join()
    return (b"".join(out_chunks).decode(errors="replace"), b"".join(err_chunks).decode(errors="replace"),
            proc.returncode, peak)


def measure_llamacpp(path: Path, tokens: int, threads: int, bin_folder=None) -> dict:
    """llama-bench's peak resident bytes and decode speed over ``tokens`` tokens."""
    cmd = [common.tool("llama-bench", bin_folder), "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(tokens),
           "-r", "1", "-o", "json"]
    start = time.perf_counter()
    out, err, rc, peak = spawn(cmd)
    if rc != 0:
        sys.exit(f"llama-bench failed on {path.name} ({rc}):\n{err[-3000:]}")
    rows = json.loads(out)
    return {"peak": peak, "tokens_per_s": rows[0]["avg_ts"], "wall_s": time.perf_counter() - start}


def measure_metalnn(path: Path, tokens: int, root: Path = ROOT) -> dict:
    """What the metalnn process reports (`CHILD`), with its peak resident bytes from ``os.wait4``;
    ``root``: the checkout whose ``metalnn`` is measured."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    out, err, rc, peak = spawn([sys.executable, "-c", CHILD, str(path), str(tokens)], env=env, cwd=root)
    if rc != 0:
        sys.exit(f"metalnn failed on {path.name} ({rc}):\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    if Path(result["metalnn"]).resolve().parents[1] != root.resolve():
        sys.exit(f"measured {result['metalnn']}, not the metalnn of {root}")
    result["peak"] = max(peak, result["stages"]["decoded"]["VmHWM"])
    result["warnings"] = [l for l in err.splitlines() if "Warning" in l]
    return result


def measure_metalnn_runs(path: Path, tokens: int, runs: int, root: Path = ROOT) -> dict:
    """`measure_metalnn` ``runs`` times: the run of the median load time, with every run's peak and
    load time (``peaks``, ``load_times``)."""
    results = sorted((measure_metalnn(path, tokens, root) for _ in range(runs)), key=lambda r: r["load_s"])
    median = dict(results[len(results) // 2])
    median["peaks"] = [r["peak"] for r in results]
    median["load_times"] = [r["load_s"] for r in results]
    return median


def default_files() -> list:
    import make_llama1b_gguf

    made = make_llama1b_gguf.make_files(types=("Q8_0", "Q4_K_M"))
    return [common.bundled(), made["Q8_0"], made["Q4_K_M"]]


def report(path: Path, ll: dict, mn: dict, limit: float) -> bool:
    """Print one file's figures; True when metalnn's peak is within ``limit`` x llama.cpp's."""
    ratio = mn["peak"] / ll["peak"]
    size = path.stat().st_size
    print(f"\n{path.name} ({size / MiB:.0f} MiB file, {mn['param_bytes'] / MiB:.0f} MiB of parameters)")
    print(f"  llama.cpp peak {ll['peak'] / MiB:7.0f} MiB   (decoding {ll['tokens_per_s']:.1f} tokens/s)")
    print(f"  metalnn   peak {mn['peak'] / MiB:7.0f} MiB   ratio {ratio:.2f}x (limit {limit}x): "
          f"{'ok' if ratio <= limit else 'OVER'}")
    if len(mn["peaks"]) > 1:
        print(f"  metalnn over {len(mn['peaks'])} runs: peaks {', '.join(f'{b / MiB:.0f}' for b in mn['peaks'])} MiB; "
              f"load times {', '.join(f'{t:.2f}' for t in mn['load_times'])} s (the median run below)")
    print(f"  metalnn: load {mn['load_s']:.2f} s, tokenizer {mn['tokenizer_s']:.2f} s, decode {mn['tokens']} tokens "
          f"{mn['decode_s']:.2f} s; MLX peak {mn['mlx_peak'] / MiB:.0f} MiB (loading {mn['mlx_load_peak'] / MiB:.0f}), "
          f"active {mn['mlx_active'] / MiB:.0f}, cache {mn['mlx_cache'] / MiB:.0f}")
    for stage, s in mn["stages"].items():
        print(f"    {stage:17s} resident {s['VmRSS'] / MiB:6.0f} MiB (anonymous {s['RssAnon'] / MiB:6.0f}, file "
              f"{s['RssFile'] / MiB:4.0f}), high-water {s['VmHWM'] / MiB:6.0f}")
    for w in mn["warnings"]:
        print(f"  stderr: {w}")
    return ratio <= limit


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", default=None, help="comma-separated GGUF files (default: SmolLM2 Q4_1, 1B Q8_0, Q4_K_M)")
    p.add_argument("--tokens", type=int, default=16, help="tokens decoded (default 16)")
    p.add_argument("--threads", type=int, default=2, help="llama-bench threads (default 2)")
    p.add_argument("--limit", type=float, default=1.2, help="largest metalnn / llama.cpp peak ratio (default 1.2)")
    p.add_argument("--runs", type=int, default=1, help="metalnn runs per file (the median load time's is shown)")
    p.add_argument("--metalnn", type=Path, default=ROOT,
                   help="the checkout whose metalnn is measured (default: this one)")
    p.add_argument("--llamacpp", default=None, help="folder of llama.cpp's tools")
    args = p.parse_args(argv)

    files = [Path(f).expanduser() for f in args.files.split(",")] if args.files else default_files()
    print(f"llama.cpp {common.llamacpp_version(args.llamacpp)}; metalnn of {args.metalnn}; {common.load_line()}",
          flush=True)
    ok = True
    for path in files:
        ll = measure_llamacpp(path, args.tokens, args.threads, args.llamacpp)
        mn = measure_metalnn_runs(path, args.tokens, args.runs, args.metalnn)
        ok = report(path, ll, mn, args.limit) and ok
    print(f"\n{common.load_line()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

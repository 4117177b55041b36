"""The run around a distributed model: the group ``mlx.launch`` set up (`launch_group`), a rank's
parameter bytes (`parameter_bytes`) and `watch_peers`, which ends this rank with an error naming the
rank that died.

A rank blocked in a collective or a receive whose peer died waits forever on some backends (the ring
backend's sockets may not report a peer that was killed before it wrote). `watch_peers` starts a
thread that every ``interval`` seconds checks that the other ranks' processes (their pids, exchanged
at start through one ``all_gather``; ranks on one machine) are alive; when one is gone it prints
``metalnn: rank R (pid P) died; stopping rank Q`` to stderr and ends this process with exit code 1
within ``interval`` seconds. ``mlx.launch`` also ends the others when one exits with an error.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import mlx.core as mx

#: the environment variables ``mlx.launch`` sets for a distributed run (ring, JACCL, MPI)
LAUNCH_VARIABLES = ("MLX_RANK", "MLX_HOSTFILE", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_SIZE")


def launch_group():
    """The ``mx.distributed`` group of a process started by ``mlx.launch`` (None outside one, or when
    the group has a single rank)."""
    if not any(v in os.environ for v in LAUNCH_VARIABLES):
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def parameter_bytes(model) -> int:
    """The bytes of the arrays a model's parameters hold (packed weights as stored)."""
    return sum(a.nbytes for a in model.named_parameters().values())


def watch_peers(group, interval: float = 1.0, exit=os._exit):
    """Watch the other ranks of ``group`` (on this machine): when one's process is gone, report it and
    end this one (``exit(1)``). Returns the thread (a daemon). Ranks on other machines are the
    launcher's to watch: their pids are skipped when the hostnames differ."""
    import socket
    import zlib

    mine = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
    me = mx.array([os.getpid(), mine], dtype=mx.int32)
    peers = mx.distributed.all_gather(me[None], group=group)
    mx.eval(peers)
    table = [(r, int(p), int(h)) for r, (p, h) in enumerate(peers.tolist())]
    watched = [(r, p) for r, p, h in table if r != group.rank() and h == mine]

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a zombie (killed, not yet reaped by the launcher) is dead
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return True

    def loop():
        while True:
            time.sleep(interval)
            for r, pid in watched:
                if not alive(pid):
                    print(f"metalnn: rank {r} (pid {pid}) died; stopping rank {group.rank()}", file=sys.stderr,
                          flush=True)
                    exit(1)

    thread = threading.Thread(target=loop, name="metalnn-watch-peers", daemon=True)
    thread.start()
    return thread

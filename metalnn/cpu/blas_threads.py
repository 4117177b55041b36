"""OpenBLAS's thread count for MLX (and NumPy, which shares the library): the setting and
the shim's thread governor.

OpenBLAS splits a product over a fixed number of threads that wait for each other by
spinning; with more of them than free cores (other busy processes), a product can take tens
of times longer than on one thread. metalnn's cblas shim therefore re-reads, before MLX's
BLAS/LAPACK calls and at most every 100 ms, how many cores other processes kept busy, and
sets OpenBLAS's thread count to::

    threads = clamp(cores - round(busy elsewhere), 1, cap)

(`metalnn_blas_threads_policy` in ``native/blas_threads.c``, a pure function; ``cores``: the
CPUs this process may run on; ``busy elsewhere``: those CPUs' busy time less this process's
own, in cores, where half a core or more counts as one). Two busy processes on two cores
thus leave OpenBLAS one thread; an idle machine, all of them.

Environment (read once, when `metalnn.cpu.blas.setup` runs):
  ``METALNN_BLAS_THREADS`` unset or ``auto``: adapt, at most OpenBLAS's own thread count
  (which honours ``OPENBLAS_NUM_THREADS``);
  ``METALNN_BLAS_THREADS=<k>``: adapt, at most ``k`` threads (as ``METALNN_NUM_THREADS=<k>``
  caps metalnn's own thread pool);
  ``METALNN_BLAS_THREADS=fixed``: leave OpenBLAS's count alone (the count of
  ``OPENBLAS_NUM_THREADS``, or one per core).

When NumPy shares the library, the count applies to NumPy's products too. A count set by
other means afterwards (``threadpoolctl``, ``openblas_set_num_threads``) becomes the new cap.

Loaded by file path from `metalnn.cpu.blas` (before ``mlx`` is imported); imports nothing
heavy.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["ThreadSetting", "read_setting", "configure", "state"]

ENV = "METALNN_BLAS_THREADS"


class ThreadSetting:
    """What ``METALNN_BLAS_THREADS`` asks for: ``adapt`` (bool) and ``cap`` (int or None: no cap
    beyond OpenBLAS's own count); ``error`` names an unusable value (then: adapt, no cap)."""

    def __init__(self, adapt: bool = True, cap: int | None = None, error: str | None = None):
        self.adapt, self.cap, self.error = adapt, cap, error

    def __repr__(self) -> str:
        return f"ThreadSetting(adapt={self.adapt}, cap={self.cap}, error={self.error!r})"


def read_setting(value: str | None = None) -> ThreadSetting:
    """Parse ``METALNN_BLAS_THREADS`` (or ``value``)."""
    raw = os.environ.get(ENV, "") if value is None else value
    text = raw.strip().lower()
    if text in ("", "auto"):
        return ThreadSetting()
    if text == "fixed":
        return ThreadSetting(adapt=False)
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k >= 1:
        return ThreadSetting(cap=k)
    return ThreadSetting(error=f"{ENV}={raw!r} is not 'auto', 'fixed' or a whole number >= 1")


def _bind(shim: ctypes.CDLL) -> bool:
    """Declare the governor's functions on ``shim``; False for a shim without them (built
    from an older source)."""
    try:
        shim.metalnn_blas_governor_configure.argtypes = [ctypes.c_int]
        shim.metalnn_blas_governor_configure.restype = ctypes.c_int
        shim.metalnn_blas_governor_state.argtypes = [ctypes.POINTER(ctypes.c_int)] * 3 + [
            ctypes.POINTER(ctypes.c_double),
            ctypes.POINTER(ctypes.c_int),
        ]
        shim.metalnn_blas_governor_state.restype = None
        shim.metalnn_blas_threads_policy.argtypes = [ctypes.c_int, ctypes.c_double, ctypes.c_int]
        shim.metalnn_blas_threads_policy.restype = ctypes.c_int
    except AttributeError:
        return False
    return True


def configure(shim: ctypes.CDLL, library_threads: int | None, setting: ThreadSetting) -> str | None:
    """Turn the shim's governor on (capped) or off, as ``setting`` says. ``library_threads``:
    OpenBLAS's count now. Returns None, or why the governor stays off."""
    if not _bind(shim):
        return "the cblas shim predates the thread governor (rebuild it: pip install .)"
    if not setting.adapt:
        shim.metalnn_blas_governor_configure(0)
        return f"{ENV}=fixed"
    cap = max(1, library_threads or 1)
    if setting.cap is not None:
        cap = min(cap, setting.cap)
    if shim.metalnn_blas_governor_configure(cap) != 0:
        return "the OpenBLAS library exports no openblas_set_num_threads/openblas_get_num_threads"
    return None


def state(shim: ctypes.CDLL | None) -> dict:
    """The governor's state: ``adaptive`` (bool), ``cap``, and from its last look ``cpus``,
    ``busy_elsewhere`` (cores; None before the first look) and ``chosen`` (threads)."""
    if shim is None or not _bind(shim):
        return {"adaptive": False, "cap": None, "cpus": None, "busy_elsewhere": None, "chosen": None}
    on, cap, cpus, threads = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    busy = ctypes.c_double()
    shim.metalnn_blas_governor_state(ctypes.byref(on), ctypes.byref(cap), ctypes.byref(cpus), ctypes.byref(busy),
                                     ctypes.byref(threads))
    looked = busy.value >= 0
    return {
        "adaptive": bool(on.value),
        "cap": cap.value if on.value else None,
        "cpus": cpus.value if looked else None,
        "busy_elsewhere": round(busy.value, 3) if looked else None,
        "chosen": threads.value if on.value else None,
    }

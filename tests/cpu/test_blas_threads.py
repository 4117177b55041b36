"""OpenBLAS's thread count (metalnn.cpu.blas_threads and the governor in native/blas_threads.c).

The policy is a pure function of the cores, the cores busy elsewhere and the cap; it is checked
on a table. The governor is checked end to end in fresh subprocesses pinned to (at most) two
CPUs: with each taken by a busy-loop process it must drop to one thread (a fact of the load, not
a timing), a fixed or capped setting must hold, and a count set through threadpoolctl must
become the cap. No timing figures here; scripts/bench_under_load.py measures speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from metalnn.cpu import blas, blas_threads

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINUX_X86_64 = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
needs_shim = pytest.mark.skipif(not LINUX_X86_64, reason="the OpenBLAS shim is used on Linux x86_64 only")
# The governor's subprocesses and the busy loops run on the same (at most two) CPUs, whatever the
# size of the machine.
PINNED = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []
CPUS = len(PINNED)
PIN = f"import os\nos.sched_setaffinity(0, {set(PINNED)!r})\n" if PINNED else ""


# --------------------------------------------------------------------------- the policy


@pytest.fixture(scope="module")
def policy():
    shim = blas.blas_info()["shim"]
    assert shim, "no cblas shim in this process: " + str(blas.blas_info()["reason"])
    lib = ctypes.CDLL(shim)
    fn = lib.metalnn_blas_threads_policy
    fn.argtypes = [ctypes.c_int, ctypes.c_double, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


# (cores, cores busy elsewhere, cap) -> threads: cores less the busy ones rounded (half a core
# or more counts as one), at least 1, at most the cap.
POLICY_TABLE = [
    ((2, 0.0, 2), 2),
    ((2, 0.49, 2), 2),
    ((2, 0.5, 2), 1),  # one other process on one core, measured while sharing: still a core
    ((2, 0.67, 2), 1),
    ((2, 1.0, 2), 1),
    ((2, 2.0, 2), 1),  # every core busy elsewhere: one thread, never zero
    ((2, 5.0, 2), 1),
    ((8, 2.4, 8), 6),
    ((8, 2.6, 8), 5),
    ((8, 0.0, 4), 4),  # the cap
    ((8, 6.0, 4), 2),
    ((1, 0.0, 1), 1),
    ((4, -1.0, 4), 4),  # a negative measurement counts as idle
    ((4, float("nan"), 4), 4),
    ((4, 0.0, 0), 1),  # a cap below one is one
    ((0, 0.0, 4), 1),
]


@needs_shim
@pytest.mark.parametrize("args,want", POLICY_TABLE)
def test_policy_table(policy, args, want):
    assert policy(*args) == want


@pytest.mark.parametrize(
    "value,adapt,cap,error",
    [("", True, None, False), ("auto", True, None, False), (" Auto ", True, None, False), ("fixed", False, None, False),
     ("3", True, 3, False), ("1", True, 1, False), ("0", True, None, True), ("-2", True, None, True),
     ("many", True, None, True)],
)
def test_setting(value, adapt, cap, error):
    s = blas_threads.read_setting(value)
    assert (s.adapt, s.cap, s.error is not None) == (adapt, cap, error)
    if error:
        assert "METALNN_BLAS_THREADS" in s.error


# --------------------------------------------------------------------------- the governor

# Products with pauses between them: each product after a pause lets the governor look at the
# load of the pause. Prints blas_info() at the end.
PRODUCTS = PIN + textwrap.dedent(
    """
    import json, sys, time
    import metalnn
    import numpy as np
    import mlx.core as mx
    from metalnn.cpu import blas
    a = mx.array(np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32))
    first = blas.blas_info()
    SETUP
    for _ in range(3):
        time.sleep(0.6)
        mx.eval(a @ a)
    from metalnn.cpu import native_ext
    ext = native_ext.extension()
    native = None if ext is None else [ext.get_num_threads(), ext.free_num_threads()]
    print(json.dumps({"first": first, "last": blas.blas_info(), "native": native}))
    """
)


def _run(env=None, setup="") -> dict:
    drop = ("METALNN_BLAS", "METALNN_BLAS_THREADS", "OPENBLAS_NUM_THREADS", "LD_PRELOAD", "METALNN_BLAS_SHIM")
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update(env or {})
    code = PRODUCTS.replace("SETUP", setup)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=REPO,
                          timeout=600)
    assert proc.returncode == 0, f"subprocess failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def every_core_busy():
    """One busy-loop process per pinned CPU, for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", PIN + "while True: pass"]) for _ in range(CPUS)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@needs_shim
@pytest.mark.skipif(not PINNED, reason="needs sched_setaffinity")
@pytest.mark.parametrize("library", ["auto", "scipy-openblas32"])
def test_every_core_busy_leaves_one_thread(policy, library):
    """With a busy process on every core it may use the governor measures them and gives
    OpenBLAS one thread (NumPy's ILP64 library and scipy-openblas32's alike)."""
    with every_core_busy():
        out = _run({"METALNN_BLAS": library})
    first, last = out["first"], out["last"]
    assert first["threads"]["adaptive"] is True and first["threads_reason"] is None, first
    gov = last["threads"]
    assert gov["cpus"] == CPUS, gov
    # the busy loops held (nearly) every core while the products paused
    assert gov["busy_elsewhere"] >= CPUS - 0.5, gov
    assert gov["chosen"] == policy(gov["cpus"], gov["busy_elsewhere"], gov["cap"]) == 1, gov
    assert last["num_threads"] == 1, last
    # metalnn's own native loops follow the same measurement (one thread, whatever their cap)
    if out["native"] is not None:
        assert out["native"][1] == 1, out["native"]


@needs_shim
def test_fixed_setting_leaves_the_count_alone():
    with every_core_busy():
        out = _run({"METALNN_BLAS_THREADS": "fixed"})
    first, last = out["first"], out["last"]
    assert last["threads"]["adaptive"] is False and last["threads_reason"] == "METALNN_BLAS_THREADS=fixed", last
    assert last["num_threads"] == first["num_threads"] >= 1
    if out["native"] is not None:  # and the native loops keep their cap
        assert out["native"][1] == out["native"][0], out["native"]


@needs_shim
@pytest.mark.parametrize("env", [{"METALNN_BLAS_THREADS": "1"}, {"OPENBLAS_NUM_THREADS": "1"}])
def test_cap_from_the_environment(env):
    out = _run(env)
    for info in (out["first"], out["last"]):
        assert info["threads"]["adaptive"] is True and info["threads"]["cap"] == 1, info
        assert info["num_threads"] == 1, info


@needs_shim
@pytest.mark.skipif(CPUS < 2, reason="needs two cores (with one the cap is one already)")
def test_count_set_through_threadpoolctl_becomes_the_cap():
    out = _run(setup="import threadpoolctl\nthreadpoolctl.threadpool_limits(limits=1, user_api='blas')")
    last = out["last"]
    assert out["first"]["threads"]["cap"] >= 2, out["first"]
    assert last["threads"]["cap"] == 1 and last["num_threads"] == 1, last

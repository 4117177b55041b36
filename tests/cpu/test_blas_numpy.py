"""One OpenBLAS for NumPy and MLX: metalnn forwards MLX's BLAS/LAPACK calls to the OpenBLAS that
NumPy's wheel bundles (ILP64), so a process that uses both has one library and one thread pool;
where NumPy's library cannot be found, MLX gets scipy-openblas32's as before.

Each case runs in a fresh subprocess (which library MLX binds is decided once per process). What
is loaded is read independently of metalnn: the process's own memory map (/proc/self/maps), the
dynamic linker's binding trace (``LD_DEBUG=bindings``) and threadpoolctl's view of the process.
The correctness of every forwarded routine is in test_blas.py (``CORRECTNESS``).
"""

from __future__ import annotations

import glob
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLAS_PY = os.path.join(REPO, "metalnn", "cpu", "blas.py")
SITE_PACKAGES = sysconfig.get_paths()["purelib"]
LINUX_X86_64 = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")

pytestmark = pytest.mark.skipif(not LINUX_X86_64, reason="the OpenBLAS shim is used on Linux x86_64 only")

# Independent of metalnn: the OpenBLAS libraries mapped into the process, and what the process
# computes with both libraries.
PROBE = textwrap.dedent(
    """
    import json, os, re, sys
    def mapped_openblas():
        libs = set()
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and re.search(r"openblas", os.path.basename(parts[5].strip())):
                    libs.add(os.path.realpath(parts[5].strip()))
        return sorted(libs)
    rng = np.random.default_rng(0)
    A = rng.standard_normal((300, 200)).astype(np.float32)
    B = rng.standard_normal((200, 100)).astype(np.float32)
    want = A @ B  # NumPy's product
    got = np.array(mx.array(A) @ mx.array(B))  # MLX's
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    blas = sys.modules["metalnn.cpu.blas"]
    numpy_libs = os.path.realpath(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs"))
    out = {"maps": mapped_openblas(), "numpy_libs": numpy_libs, "info": blas.blas_info(), "err": err}
    try:
        import threadpoolctl
        out["pools"] = [(os.path.realpath(p["filepath"]), p["num_threads"])
                        for p in threadpoolctl.threadpool_info() if p["internal_api"] == "openblas"]
        with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
            out["threads_in_limit"] = blas.blas_info()["num_threads"]
    except ImportError:
        out["pools"] = None
    print(json.dumps(out))
    """
)

ORDERS = {
    "numpy_then_metalnn": "import numpy as np\nimport metalnn\nimport mlx.core as mx\n",
    "metalnn_then_numpy": "import metalnn\nimport numpy as np\nimport mlx.core as mx\n",
    "mlx_alone": "import mlx.core as mx\nimport numpy as np\n",  # the startup hook sets up the BLAS
}

_BINDING = re.compile(r"binding file (\S*libmlx\.so) \[\d+\] to (\S+) \[\d+\]: normal symbol `cblas_sgemm'")


def _env(extra=None) -> dict:
    drop = ("METALNN_BLAS", "METALNN_BLAS_THREADS", "LD_PRELOAD", "METALNN_BLAS_SHIM", "LD_DEBUG",
            "LD_DEBUG_OUTPUT", "OPENBLAS_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra or {})
    return env


def _run(code: str, env=None, args=(), cwd=REPO) -> dict:
    proc = subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True, env=_env(env),
                          cwd=cwd, timeout=600)
    assert proc.returncode == 0, f"subprocess failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "RuntimeWarning" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_one_openblas_serves_numpy_and_mlx(order, tmp_path):
    trace = tmp_path / "trace"
    out = _run(ORDERS[order] + PROBE, env={"LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(trace)})
    info = out["info"]
    # one OpenBLAS in the process: the one NumPy's wheel bundles
    assert len(out["maps"]) == 1, f"OpenBLAS libraries mapped: {out['maps']}"
    (library,) = out["maps"]
    assert os.path.dirname(library) == out["numpy_libs"], (library, out["numpy_libs"])
    assert info["active"] and os.path.realpath(info["library"]) == library, info
    assert info["interface"] == "ILP64" and info["shared_with_numpy"] is True, info
    assert info["loaded_by"] == ("startup hook" if order == "mlx_alone" else "import metalnn"), info
    # libmlx.so's cblas_sgemm is bound to metalnn's shim (which forwards to that library)
    bound = set()
    for path in glob.glob(str(trace) + ".*"):
        with open(path, errors="replace") as f:
            bound |= {m.group(2) for m in map(_BINDING.search, f) if m}
    assert len(bound) == 1 and "cblas_shim" in os.path.basename(bound.pop()), bound
    # one pool: threadpoolctl sees one OpenBLAS, and a limit set through it is MLX's thread count
    if out["pools"] is not None:
        assert [p for p, _ in out["pools"]] == [library], out["pools"]
        assert out["threads_in_limit"] == 1
    assert out["err"] < 1e-5


def test_without_numpys_library_mlx_gets_scipy_openblas32(tmp_path):
    """A NumPy whose wheel bundles no OpenBLAS (seen at set-up time through a stand-in package
    that is never imported): MLX gets scipy-openblas32's LP64 library, and results stay right."""
    fake = tmp_path / "fake"
    (fake / "numpy").mkdir(parents=True)
    (fake / "numpy" / "__init__.py").write_text("raise ImportError('stand-in: never imported')\n")
    code = textwrap.dedent(
        f"""
        import importlib.util, sys
        sys.path[:0] = [{str(fake)!r}, {REPO!r}, {SITE_PACKAGES!r}]
        spec = importlib.util.spec_from_file_location("metalnn.cpu.blas", {BLAS_PY!r})
        _blas = importlib.util.module_from_spec(spec)
        sys.modules["metalnn.cpu.blas"] = _blas
        spec.loader.exec_module(_blas)
        _blas.setup()
        sys.path.remove({str(fake)!r})
        import numpy as np
        import mlx.core as mx
        """
    )
    out = _run(code + PROBE, args=["-S"], cwd=tmp_path)
    info = out["info"]
    assert info["active"] is True and info["interface"] == "LP64" and info["shared_with_numpy"] is False, info
    assert "scipy_openblas32" in info["library"] and "numpy.libs" not in info["library"], info
    assert "no ILP64 OpenBLAS" in info["numpy_library_reason"], info
    assert os.path.realpath(info["library"]) in out["maps"]
    assert out["err"] < 1e-5


def test_env_chooses_scipy_openblas32():
    """``METALNN_BLAS=scipy-openblas32`` keeps MLX on scipy-openblas32's library."""
    out = _run("import metalnn\nimport numpy as np\nimport mlx.core as mx\n" + PROBE,
               env={"METALNN_BLAS": "scipy-openblas32"})
    info = out["info"]
    assert info["interface"] == "LP64" and info["shared_with_numpy"] is False, info
    assert info["numpy_library_reason"] == "METALNN_BLAS=scipy-openblas32"
    assert len(out["maps"]) == 2, out["maps"]  # NumPy's own and scipy-openblas32's
    assert out["err"] < 1e-5

"""Tests for metalnn._blas: MLX bound to scipy-openblas32 through the cblas shim.

Everything that depends on import order runs in a fresh subprocess, because whether
MLX got the optimized BLAS is decided once per process, when mlx.core is first
imported (and other tests in this session may already have imported it).
No timing assertions here; see scripts/bench_blas.py for speed.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLAS_PY = os.path.join(REPO, "metalnn", "_blas.py")
SHIM_C = os.path.join(REPO, "metalnn", "_native", "cblas_shim.c")

LINUX = sys.platform.startswith("linux")
LINUX_X86_64 = LINUX and platform.machine() in ("x86_64", "AMD64")

# Prelude for subprocesses: get `_blas` the way users do (`import metalnn`, which calls
# setup() first thing), or, while metalnn/__init__.py is missing or broken, load
# metalnn/_blas.py standalone by path. setup() is idempotent, so calling it again is a
# no-op when `import metalnn` already ran it.
PRELUDE = textwrap.dedent(
    f"""
    import importlib.util, json, sys, warnings
    sys.path.insert(0, {REPO!r})
    warnings.simplefilter("always")
    try:
        import metalnn
        from metalnn import _blas
        HOW = "import metalnn"
    except Exception as exc:  # metalnn/__init__.py missing or in flux
        spec = importlib.util.spec_from_file_location("metalnn_blas_standalone", {BLAS_PY!r})
        _blas = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_blas)
        HOW = "standalone: " + repr(exc)
    _blas.setup()
    """
)


def run_py(code: str, env: dict | None = None, prelude: bool = True) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("METALNN_BLAS", "LD_PRELOAD", "METALNN_BLAS_SHIM")}
    full_env.update(env or {})
    src = (PRELUDE if prelude else "") + textwrap.dedent(code)
    proc = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, env=full_env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, f"subprocess failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def last_json(proc: subprocess.CompletedProcess):
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- activation


@pytest.mark.skipif(not LINUX_X86_64, reason="the OpenBLAS shim is used on Linux x86_64 only")
def test_active_in_fresh_process():
    proc = run_py(
        """
        info = _blas.blas_info()
        import mlx.core as mx
        print(json.dumps({"info": info, "how": HOW}))
        """
    )
    out = last_json(proc)
    info = out["info"]
    assert info["active"] is True, f"{info} ({out['how']})"
    assert info["reason"] is None
    assert "scipy_openblas" in os.path.basename(info["library"])
    assert os.path.isfile(info["library"]) and os.path.isfile(info["shim"])
    assert info["num_threads"] >= 1
    assert "RuntimeWarning" not in proc.stderr, proc.stderr


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_env_off_leaves_inactive():
    out = last_json(
        run_py(
            """
            import mlx.core as mx
            print(json.dumps(_blas.blas_info()))
            """,
            env={"METALNN_BLAS": "off"},
        )
    )
    assert out["active"] is False
    assert "METALNN_BLAS" in out["reason"]


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_mlx_imported_first_warns():
    code = textwrap.dedent(
        f"""
        import importlib.util, json, sys, warnings
        sys.path.insert(0, {REPO!r})
        import mlx.core as mx  # too early
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                import metalnn
                from metalnn import _blas
            except Exception:
                spec = importlib.util.spec_from_file_location("metalnn_blas_standalone", {BLAS_PY!r})
                _blas = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(_blas)
            _blas.setup()
            _blas.setup()
        msgs = [str(w.message) for w in caught if "BLAS" in str(w.message)]
        print(json.dumps({{"msgs": msgs, "info": _blas.blas_info()}}))
        """
    )
    out = last_json(run_py(code, prelude=False))
    assert out["info"]["active"] is False
    assert len(out["msgs"]) == 1, out["msgs"]  # warned exactly once
    msg = out["msgs"][0]
    assert "before" in msg and "LD_PRELOAD=" in msg
    if LINUX_X86_64:
        # The hint names the real paths, not placeholders.
        assert out["info"]["library"] and out["info"]["library"] in msg
        assert out["info"]["shim"] and out["info"]["shim"] in msg


@pytest.mark.skipif(not LINUX_X86_64, reason="the OpenBLAS shim is used on Linux x86_64 only")
def test_ld_preload_hint_works():
    """The LD_PRELOAD line from the warning makes MLX fast even if mlx is imported first."""
    info = last_json(run_py("print(json.dumps(_blas.blas_info()))"))
    preload = f"{info['library']}:{info['shim']}"
    code = textwrap.dedent(
        f"""
        import importlib.util, json, sys, warnings
        import numpy as np
        import mlx.core as mx
        a = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
        err = float(np.max(np.abs(np.array(mx.array(a) @ mx.array(a.T)) - a @ a.T)))
        sys.path.insert(0, {REPO!r})
        spec = importlib.util.spec_from_file_location("metalnn_blas_standalone", {BLAS_PY!r})
        _blas = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_blas)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _blas.setup()
        print(json.dumps({{"info": _blas.blas_info(), "err": err, "n_warn": len(caught)}}))
        """
    )
    out = last_json(run_py(code, env={"LD_PRELOAD": preload}, prelude=False))
    assert out["info"]["active"] is True, out
    assert out["n_warn"] == 0
    assert out["err"] < 1e-3


@pytest.mark.skipif(not LINUX_X86_64, reason="the OpenBLAS shim is used on Linux x86_64 only")
def test_fallback_compiles_shim_into_cache(tmp_path):
    """Without a built shim next to _blas.py, setup() compiles one into the cache dir."""
    assert shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"), "no C compiler on PATH"
    pkg = tmp_path / "pkg"
    (pkg / "_native").mkdir(parents=True)
    shutil.copy(BLAS_PY, pkg / "_blas.py")
    shutil.copy(SHIM_C, pkg / "_native" / "cblas_shim.c")
    cache = tmp_path / "cache"
    code = textwrap.dedent(
        f"""
        import importlib.util, json
        spec = importlib.util.spec_from_file_location("blas_copy", {str(pkg / "_blas.py")!r})
        _blas = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_blas)
        _blas.setup()
        import numpy as np, mlx.core as mx
        a = np.random.default_rng(1).standard_normal((33, 65)).astype(np.float32)
        err = float(np.max(np.abs(np.array(mx.array(a) @ mx.array(a.T)) - a @ a.T)))
        print(json.dumps({{"info": _blas.blas_info(), "err": err}}))
        """
    )
    out = last_json(run_py(code, env={"XDG_CACHE_HOME": str(cache)}, prelude=False))
    assert out["info"]["active"] is True, out
    assert out["info"]["shim"].startswith(str(cache / "metalnn")), out
    assert out["err"] < 1e-3


@pytest.mark.skipif(not LINUX_X86_64, reason="the OpenBLAS shim is used on Linux x86_64 only")
def test_shim_covers_mlx_blas_imports():
    """Every BLAS/LAPACK symbol libmlx.so imports is forwarded by the shim."""
    nm = shutil.which("nm")
    assert nm is not None, "nm (binutils) not on PATH"
    info = last_json(run_py("import mlx.core as mx, mlx; print(json.dumps([_blas.blas_info(), mlx.__path__[0]]))"))
    shim, mlx_dir = info[0]["shim"], info[1]
    libmlx = os.path.join(mlx_dir, "lib", "libmlx.so")
    assert os.path.isfile(libmlx), f"{libmlx} not found"
    undefined = subprocess.run([nm, "-D", "--undefined-only", libmlx], capture_output=True, text=True, check=True).stdout
    wanted = set()
    for line in undefined.splitlines():
        name = line.split()[-1].split("@")[0]
        if name.startswith("cblas_") or (name.endswith("_") and not name.startswith("_") and len(name) <= 8):
            wanted.add(name)
    assert "cblas_sgemm" in wanted
    defined = subprocess.run([nm, "-D", "--defined-only", shim], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in defined.splitlines() if line.strip()}
    assert not (wanted - exported), f"libmlx.so imports BLAS/LAPACK symbols the shim lacks: {sorted(wanted - exported)}"


@pytest.mark.skipif(LINUX, reason="non-Linux only")
def test_noop_off_linux():
    out = last_json(run_py("print(json.dumps(_blas.blas_info()))"))
    assert out["active"] is False and out["reason"]


# --------------------------------------------------------------------------- correctness

CORRECTNESS = """
import numpy as np
import mlx.core as mx

info = _blas.blas_info()
rng = np.random.default_rng(0)
res = {"active": info["active"]}

def rel(got, want):
    got = np.asarray(got, dtype=np.float64); want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))

def r(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)

# float32 GEMM: shapes and transposes (MLX passes transposed views straight to sgemm)
for (m, k, n) in [(1, 1, 1), (7, 5, 3), (64, 64, 64), (67, 129, 33), (1, 300, 257), (257, 300, 1), (513, 200, 130)]:
    A, B = r(m, k), r(k, n)
    a, b = mx.array(A), mx.array(B)
    At, Bt = mx.array(np.ascontiguousarray(A.T)), mx.array(np.ascontiguousarray(B.T))
    res[f"nn_{m}x{k}x{n}"] = rel(a @ b, A @ B)
    res[f"tn_{m}x{k}x{n}"] = rel(At.T @ b, A @ B)
    res[f"nt_{m}x{k}x{n}"] = rel(a @ Bt.T, A @ B)
    res[f"tt_{m}x{k}x{n}"] = rel(At.T @ Bt.T, A @ B)
A, B = r(90, 70), r(70, 50)
res["strided"] = rel(mx.array(A)[::2, 1:] @ mx.array(B)[1:, ::3], A[::2, 1:] @ B[1:, ::3])
res["gemv"] = rel(mx.array(A) @ mx.array(B[:, 0]), A @ B[:, 0])
res["addmm"] = rel(mx.addmm(mx.array(A[:, :50]), mx.array(A), mx.array(B), alpha=0.5, beta=2.0),
                   2.0 * A[:, :50] + 0.5 * (A @ B))
# batched / broadcast
X, Y = r(3, 4, 20, 30), r(4, 30, 10)
res["batched_bcast"] = rel(mx.array(X) @ mx.array(Y), X @ Y)
X, Y = r(8, 33, 17), r(8, 17, 29)
res["batched"] = rel(mx.array(X) @ mx.array(Y), X @ Y)
res["batched_t"] = rel(mx.swapaxes(mx.array(np.ascontiguousarray(np.swapaxes(X, 1, 2))), 1, 2) @ mx.array(Y), X @ Y)
# float16 / bfloat16 inputs: compare against float32 math on the rounded inputs
A, B = r(65, 130), r(130, 40)
for name, dt in [("float16", mx.float16), ("bfloat16", mx.bfloat16)]:
    a, b = mx.array(A).astype(dt), mx.array(B).astype(dt)
    Ar, Br = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    out = a @ b
    assert out.dtype == dt
    res[name] = rel(out.astype(mx.float32), Ar @ Br)
# float64 and complex64 (dgemm / cgemm)
A64, B64 = r(40, 50, dtype=np.float64), r(50, 30, dtype=np.float64)
res["float64"] = rel(mx.array(A64) @ mx.array(B64), A64 @ B64)
C = (r(30, 30) + 1j * r(30, 30)).astype(np.complex64)
got = np.array(mx.array(C) @ mx.array(C))
res["complex64"] = float(np.max(np.abs(got - C @ C)) / np.max(np.abs(C @ C)))
# conv2d (im2col + sgemm on CPU) against an explicit numpy convolution
x, w = r(2, 9, 9, 5), r(7, 3, 3, 5)
xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
ref = np.zeros((2, 9, 9, 7), np.float64)
for i in range(3):
    for j in range(3):
        ref += np.einsum("nhwc,oc->nhwo", xp[:, i:i + 9, j:j + 9, :], w[:, i, j, :])
res["conv2d"] = rel(mx.conv2d(mx.array(x), mx.array(w), padding=1), ref)
# LAPACK-backed linalg (CPU stream), forwarded by the shim too
S = r(40, 40); SPD = S @ S.T + 40 * np.eye(40, dtype=np.float32)
cpu = mx.cpu
res["inv"] = rel(mx.linalg.inv(mx.array(SPD), stream=cpu), np.linalg.inv(SPD))
res["cholesky"] = rel(mx.linalg.cholesky(mx.array(SPD), stream=cpu), np.linalg.cholesky(SPD))
res["svd"] = rel(mx.linalg.svd(mx.array(S), compute_uv=False, stream=cpu), np.linalg.svd(S, compute_uv=False))
q, rr = mx.linalg.qr(mx.array(S), stream=cpu)
res["qr"] = rel(q @ rr, S)
res["eigvalsh"] = rel(mx.linalg.eigvalsh(mx.array(SPD), stream=cpu), np.linalg.eigvalsh(SPD))
# concurrent sgemm calls from two MLX CPU streams (OpenBLAS thread safety)
M = r(256, 256)
s1, s2 = mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)
outs = [mx.matmul(mx.array(M), mx.array(M), stream=(s1 if i % 2 else s2)) for i in range(8)]
mx.eval(*outs)
res["two_streams"] = max(rel(o, M @ M) for o in outs)
print(json.dumps(res))
"""

TOL = {"float16": 2e-3, "bfloat16": 1e-2}


def _check_correctness(env=None):
    res = last_json(run_py(CORRECTNESS, env=env))
    active = res.pop("active")
    bad = {k: v for k, v in res.items() if not v <= TOL.get(k, 1e-5)}
    assert not bad, f"MLX results differ from NumPy (relative max error): {bad}"
    return active


def test_matmul_correct_with_shim():
    active = _check_correctness()
    if LINUX_X86_64:
        assert active, "expected the OpenBLAS shim to be active on Linux x86_64"


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_matmul_correct_without_shim():
    assert _check_correctness(env={"METALNN_BLAS": "off"}) is False


@pytest.mark.skipif(not LINUX_X86_64, reason="the OpenBLAS shim is used on Linux x86_64 only")
def test_matmul_correct_single_thread():
    assert _check_correctness(env={"OPENBLAS_NUM_THREADS": "1"}) is True

"""Tests for metalnn.cpu.blas and its startup hook: MLX bound to OpenBLAS (NumPy's own, else
scipy-openblas32's) through the cblas shim, whatever the process imports first.

Everything that depends on import order runs in a fresh subprocess, because whether
MLX got the optimized BLAS is decided once per process, when libmlx.so loads (and other
tests in this session have imported mlx.core already). What libmlx.so bound its
``cblas_sgemm`` call to is read independently of metalnn from the dynamic linker's own
trace (``LD_DEBUG=bindings``). No timing assertions here; see scripts/bench_blas.py.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import platform
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLAS_PY = os.path.join(REPO, "metalnn", "cpu", "blas.py")
HOOK_PY = os.path.join(REPO, "metalnn", "cpu", "blas_hook.py")
SHIM_C = os.path.join(REPO, "metalnn", "cpu", "native", "cblas_shim.c")
SITE_PACKAGES = sysconfig.get_paths()["purelib"]

LINUX = sys.platform.startswith("linux")
LINUX_X86_64 = LINUX and platform.machine() in ("x86_64", "AMD64")
needs_shim = pytest.mark.skipif(not LINUX_X86_64, reason="the OpenBLAS shim is used on Linux x86_64 only")

# Prelude for subprocesses that get `_blas` the way users do: `import metalnn` first.
PRELUDE = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("always")
    import metalnn
    from metalnn import _blas
    """
)

# Prelude for processes without site-packages processing (`python -S`): the startup
# hook cannot run there. site-packages and the checkout are put on sys.path by hand.
NO_SITE_PRELUDE = textwrap.dedent(
    f"""
    import json, sys, warnings
    sys.path[:0] = [{REPO!r}, {SITE_PACKAGES!r}]
    """
)

# Every script below ends with a matmul, so that libmlx.so's cblas_sgemm gets bound.
MATMUL = textwrap.dedent(
    """
    import numpy as _np
    _a = _np.random.default_rng(0).standard_normal((64, 48)).astype(_np.float32)
    MATMUL_ERR = float(_np.max(_np.abs(_np.array(mx.array(_a) @ mx.array(_a.T)) - _a @ _a.T)))
    """
)


def _clean_env(env: dict | None) -> dict:
    drop = ("METALNN_BLAS", "LD_PRELOAD", "METALNN_BLAS_SHIM", "LD_DEBUG", "LD_DEBUG_OUTPUT")
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update(env or {})
    return full


def run_py(code: str, env: dict | None = None, prelude: bool = True, args=(), cwd=REPO, python=None):
    src = (PRELUDE if prelude else "") + textwrap.dedent(code)
    cmd = [python or sys.executable, *args, "-c", src]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(env), cwd=cwd, timeout=600)
    assert proc.returncode == 0, f"subprocess failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def run_cmd(cmd, env=None, cwd=REPO, timeout=600):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(env), cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def last_json(proc: subprocess.CompletedProcess):
    return json.loads(proc.stdout.strip().splitlines()[-1])


_BINDING = re.compile(r"binding file (\S*libmlx\.so) \[\d+\] to (\S+) \[\d+\]: normal symbol `cblas_sgemm'")


def traced(tmp_path) -> tuple[dict, callable]:
    """Environment that makes the dynamic linker log its symbol bindings into tmp_path,
    and a function returning {pid: library libmlx.so bound cblas_sgemm to}."""
    out = tmp_path / "ld-trace"
    out.mkdir(exist_ok=True)

    def providers() -> dict:
        found = {}
        for path in glob.glob(str(out / "trace.*")):
            with open(path, errors="replace") as f:
                for line in f:
                    m = _BINDING.search(line)
                    if m:
                        found[path.rsplit(".", 1)[-1]] = os.path.realpath(m.group(2))
        return found

    return {"LD_DEBUG": "bindings", "LD_DEBUG_OUTPUT": str(out / "trace")}, providers


def is_shim(path: str) -> bool:
    return "cblas_shim" in os.path.basename(path)


# --------------------------------------------------------------------------- activation


@needs_shim
def test_active_in_fresh_process(tmp_path):
    env, providers = traced(tmp_path)
    proc = run_py(
        "info = _blas.blas_info()\nimport mlx.core as mx\n" + MATMUL
        + 'print(json.dumps({"info": info, "err": MATMUL_ERR}))\n',
        env=env,
    )
    out = last_json(proc)
    info = out["info"]
    assert info["active"] is True, info
    assert info["reason"] is None and info["loaded_by"] == "import metalnn"
    assert "scipy_openblas" in os.path.basename(info["library"])
    assert os.path.isfile(info["library"]) and os.path.isfile(info["shim"])
    assert info["num_threads"] >= 1
    assert "RuntimeWarning" not in proc.stderr, proc.stderr
    bound = providers()
    assert len(bound) == 1 and is_shim(next(iter(bound.values()))), bound
    assert out["err"] < 1e-3


# Ways a process can start using MLX before (or without) importing metalnn. Each script
# prints one JSON line per process that ran MLX: {"info": blas_info(), "err": ...}.
_REPORT = textwrap.dedent(
    """
    def report():
        import json, sys
        blas = sys.modules.get("metalnn.cpu.blas")
        return json.dumps({"info": blas.blas_info() if blas else None, "err": MATMUL_ERR,
                           "metalnn_imported": "metalnn" in sys.modules})
    """
)

ORDERS = {
    "mlx_core_then_metalnn": "import mlx.core as mx\nimport metalnn\n" + MATMUL + _REPORT + "print(report())\n",
    "mlx_nn_alone": "from mlx import nn\nimport mlx.core as mx\n" + MATMUL + _REPORT + "print(report())\n",
    "mlx_optimizers_alone": "import mlx.optimizers\nimport mlx.core as mx\n" + MATMUL + _REPORT + "print(report())\n",
}


@needs_shim
@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("how", ["python -c", "script"])
def test_import_order_does_not_matter(order, how, tmp_path):
    """The startup hook gives MLX OpenBLAS even when mlx is imported first or alone."""
    env, providers = traced(tmp_path)
    code = ORDERS[order]
    if how == "script":
        (tmp_path / "main.py").write_text(code)
        proc = run_cmd([sys.executable, "main.py"], env=env, cwd=tmp_path)
    else:
        proc = run_py(code, env=env, prelude=False, cwd=tmp_path)
    out = last_json(proc)
    assert out["info"] is not None and out["info"]["active"] is True, out
    assert out["info"]["loaded_by"] == "startup hook", out
    assert out["metalnn_imported"] is (order == "mlx_core_then_metalnn")
    assert "RuntimeWarning" not in proc.stderr, proc.stderr
    bound = providers()
    assert len(bound) == 1 and is_shim(next(iter(bound.values()))), bound
    assert out["err"] < 1e-3


@needs_shim
def test_import_order_in_pytest(tmp_path):
    """A test module that imports mlx.core at the top, run by pytest."""
    env, providers = traced(tmp_path)
    (tmp_path / "test_inner.py").write_text(
        "import mlx.core as mx\n" + MATMUL + _REPORT + textwrap.dedent(
            """
            def test_blas():
                import json
                out = json.loads(report())
                assert out["info"]["active"] and out["info"]["loaded_by"] == "startup hook", out
                assert out["err"] < 1e-3
            """
        )
    )
    run_cmd([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inner.py"], env=env, cwd=tmp_path)
    bound = providers()
    assert bound and all(is_shim(p) for p in bound.values()), bound


@needs_shim
def test_import_order_in_spawned_subprocess(tmp_path):
    """A multiprocessing child started with "spawn" (a fresh interpreter) gets the hook too."""
    env, providers = traced(tmp_path)
    (tmp_path / "main.py").write_text(
        textwrap.dedent(
            """
            import multiprocessing as mp

            def child():
                import mlx.core as mx
            """
        )
        + textwrap.indent(MATMUL + _REPORT + "return report()\n", "    ")
        + textwrap.dedent(
            """
            if __name__ == "__main__":
                with mp.get_context("spawn").Pool(1) as pool:
                    print(pool.apply(child))
            """
        )
    )
    out = last_json(run_cmd([sys.executable, "main.py"], env=env, cwd=tmp_path))
    assert out["info"]["active"] is True and out["info"]["loaded_by"] == "startup hook", out
    bound = providers()
    assert len(bound) == 1 and is_shim(next(iter(bound.values()))), bound  # only the child ran MLX
    assert out["err"] < 1e-3


@needs_shim
def test_import_order_in_mlx_launch_ranks(tmp_path):
    """Both ranks of `mlx.launch -n 2 --backend ring` get OpenBLAS with mlx imported first."""
    from ring_launch import launch_ranks

    env, providers = traced(tmp_path)
    (tmp_path / "rank.py").write_text(
        "import mlx.core as mx\ngroup = mx.distributed.init()\n" + MATMUL + _REPORT
        + "import json\nprint(json.dumps({'rank': group.rank(), 'size': group.size(), **json.loads(report())}))\n"
    )
    proc = launch_ranks(2, [sys.executable, "rank.py"], env=_clean_env(env), cwd=tmp_path, timeout=600)
    assert proc.ok, proc.text
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1] and all(r["size"] == 2 for r in ranks), proc.stdout
    for r in ranks:
        assert r["info"]["active"] is True and r["info"]["loaded_by"] == "startup hook", r
        assert r["err"] < 1e-3
    bound = providers()
    # the two ranks, and the launcher itself where it loads libmlx.so too
    assert len(bound) >= 2 and all(is_shim(p) for p in bound.values()), bound


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_env_off_leaves_inactive(tmp_path):
    env, providers = traced(tmp_path)
    env["METALNN_BLAS"] = "off"
    proc = run_py(
        "import json, warnings\nwarnings.simplefilter('always')\nimport mlx.core as mx\nimport metalnn\n"
        "from metalnn import _blas\n" + MATMUL + "print(json.dumps(_blas.blas_info()))\n",
        env=env,
        prelude=False,
    )
    out = last_json(proc)
    assert out["active"] is False and out["loaded_by"] is None
    assert "METALNN_BLAS" in out["reason"]
    assert "RuntimeWarning" not in proc.stderr, proc.stderr  # turned off on purpose: no warning
    bound = providers()
    assert len(bound) == 1 and not is_shim(next(iter(bound.values()))), bound


def test_hook_is_light_at_startup():
    """The .pth only registers the finder: no numpy, mlx, ctypes or metalnn at start-up."""
    out = last_json(
        run_py(
            """
            import json, sys
            heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("numpy", "mlx", "metalnn", "ctypes", "scipy_openblas32"))
            hooks = [type(f).__module__ + "." + type(f).__name__ for f in sys.meta_path if type(f).__name__ == "BlasImportHook"]
            print(json.dumps({"heavy": heavy, "hooks": hooks, "first": type(sys.meta_path[0]).__name__}))
            """,
            prelude=False,
            cwd=os.path.dirname(REPO),
        )
    )
    assert out["heavy"] == []
    if LINUX:
        assert out["hooks"] == ["_metalnn_blas_hook.BlasImportHook"]
        assert out["first"] == "BlasImportHook"
    else:
        assert out["hooks"] == []


@pytest.mark.skipif(not LINUX, reason="the startup hook acts on Linux only")
@pytest.mark.parametrize("given,want", [(None, "20"), ("8", "8"), ("off", None)],
                         ids=["default", "yours-kept", "metalnn-blas-off"])
def test_startup_shortens_openblas_polling_unless_told_otherwise(given, want):
    """A fresh interpreter starts with OPENBLAS_THREAD_TIMEOUT=20 (OpenBLAS's threads sleep ~0.4 ms
    after a product instead of polling ~0.1 s), set before anything can load OpenBLAS; a value of
    your own stays; METALNN_BLAS=off leaves the environment alone. The same holds after `import
    metalnn` from an interpreter that started without it."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if given == "off":
        env["METALNN_BLAS"] = "off"
    elif given is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = given
    code = "import json, os\nprint(json.dumps(os.environ.get('OPENBLAS_THREAD_TIMEOUT')))\n"
    at_start = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert at_start.returncode == 0, at_start.stderr
    assert json.loads(at_start.stdout.strip().splitlines()[-1]) == want
    # without site-packages' hooks (python -S, the source tree on sys.path): `import metalnn` sets it
    env["PYTHONPATH"] = os.pathsep.join([REPO, *site.getsitepackages()])
    late = subprocess.run([sys.executable, "-S", "-c", "import metalnn\n" + code], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)
    assert late.returncode == 0, late.stderr
    assert json.loads(late.stdout.strip().splitlines()[-1]) == want


@needs_shim
def test_hook_failure_never_breaks_import_mlx():
    """If metalnn's BLAS setup raises inside the hook, `import mlx.core` still works (warns)."""
    code = (
        textwrap.dedent("""
        import json, sys, types, warnings
        warnings.simplefilter("always")
        broken = types.ModuleType("metalnn.cpu.blas")
        def setup(**kw):
            raise OSError("simulated failure")
        broken.setup = setup
        sys.modules["metalnn.cpu.blas"] = broken
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import mlx.core as mx
        """)
        + MATMUL
        + textwrap.dedent("""
        msgs = [str(w.message) for w in caught]
        hooks = [f for f in sys.meta_path if type(f).__name__ == "BlasImportHook"]
        print(json.dumps({"msgs": msgs, "err": MATMUL_ERR, "hooks_left": len(hooks)}))
        """)
    )
    out = last_json(run_py(code, prelude=False, cwd=os.path.dirname(REPO)))
    assert out["err"] < 1e-3
    assert any("startup hook" in m and "simulated failure" in m for m in out["msgs"]), out["msgs"]
    assert out["hooks_left"] == 0  # it removed itself and does not run again


def test_hook_install_is_idempotent_and_one_shot():
    """install() registers one finder; it ignores non-mlx names and removes itself once run."""
    code = textwrap.dedent(
        f"""
        import importlib.util, json, sys
        spec = importlib.util.spec_from_file_location("hook_copy", {HOOK_PY!r})
        hook = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hook)
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "BlasImportHook"]
        hook.install(); hook.install()
        n_installed = sum(isinstance(f, hook.BlasImportHook) for f in sys.meta_path)
        calls = []
        hook._setup_blas = lambda: calls.append(1)
        import json as _j, email.utils  # other imports do not trigger it
        n_before = len(calls)
        import mlx.core
        import mlx.nn
        print(json.dumps({{"n": n_installed, "before": n_before, "calls": len(calls),
                           "left": hook.installed()}}))
        """
    )
    out = last_json(run_py(code, prelude=False, cwd=os.path.dirname(REPO)))
    expect = 1 if LINUX else 0
    assert out == {"n": expect, "before": 0, "calls": expect, "left": False}


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_mlx_imported_first_warns_without_site():
    """With `python -S` no startup hook runs: mlx imported first stays slow, and metalnn
    says so once, naming why and the LD_PRELOAD line that fixes it."""
    code = NO_SITE_PRELUDE + textwrap.dedent(
        """
        import mlx.core as mx  # too early, and no hook
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import metalnn
            from metalnn import _blas
            _blas.setup()
            _blas.setup()
        msgs = [str(w.message) for w in caught if "BLAS" in str(w.message)]
        print(json.dumps({"msgs": msgs, "info": _blas.blas_info()}))
        """
    )
    out = last_json(run_py(code, prelude=False, args=["-S"]))
    assert out["info"]["active"] is False
    assert len(out["msgs"]) == 1, out["msgs"]  # warned exactly once
    msg = out["msgs"][0]
    assert "before" in msg and "-S" in msg and "LD_PRELOAD=" in msg
    if LINUX_X86_64:
        # The hint names the real paths, not placeholders.
        assert out["info"]["library"] and out["info"]["library"] in msg
        assert out["info"]["shim"] and out["info"]["shim"] in msg


@needs_shim
def test_ld_preload_hint_works(tmp_path):
    """The LD_PRELOAD line from the warning makes MLX fast even without the startup hook."""
    info = last_json(run_py("print(json.dumps(_blas.blas_info()))"))
    env, providers = traced(tmp_path)
    env["LD_PRELOAD"] = f"{info['library']}:{info['shim']}"
    code = (
        NO_SITE_PRELUDE
        + textwrap.dedent("""
        import importlib.util
        import mlx.core as mx
        """)
        + MATMUL
        + textwrap.dedent(f"""
        spec = importlib.util.spec_from_file_location("metalnn_blas_standalone", {BLAS_PY!r})
        _blas = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_blas)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _blas.setup()
        print(json.dumps({{"info": _blas.blas_info(), "err": MATMUL_ERR, "n_warn": len(caught)}}))
        """)
    )
    out = last_json(run_py(code, env=env, prelude=False, args=["-S"]))
    assert out["info"]["active"] is True and out["info"]["loaded_by"] == "LD_PRELOAD", out
    assert out["n_warn"] == 0
    assert out["err"] < 1e-3
    bound = providers()
    assert len(bound) == 1 and is_shim(next(iter(bound.values()))), bound


@needs_shim
def test_fallback_compiles_shim_into_cache(tmp_path):
    """Without a built shim next to cpu/blas.py, setup() compiles one into the cache dir."""
    assert shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"), "no C compiler on PATH"
    pkg = tmp_path / "pkg"
    (pkg / "native").mkdir(parents=True)
    for name in ("blas.py", "blas_libs.py", "blas_threads.py", "blas_hook.py"):  # blas.py loads its siblings by path
        shutil.copy(os.path.join(os.path.dirname(BLAS_PY), name), pkg / name)
    for src in glob.glob(os.path.join(os.path.dirname(SHIM_C), "*.[ch]")):  # the shim's sources
        shutil.copy(src, pkg / "native" / os.path.basename(src))
    cache = tmp_path / "cache"
    code = (
        NO_SITE_PRELUDE
        + textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("blas_copy", {str(pkg / "blas.py")!r})
        _blas = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_blas)
        _blas.setup()
        import mlx.core as mx
        """)
        + MATMUL
        + 'print(json.dumps({"info": _blas.blas_info(), "err": MATMUL_ERR}))\n'
    )
    out = last_json(run_py(code, env={"XDG_CACHE_HOME": str(cache)}, prelude=False, args=["-S"]))
    assert out["info"]["active"] is True, out
    assert out["info"]["shim"].startswith(str(cache / "metalnn")), out
    assert out["err"] < 1e-3


@needs_shim
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


# --------------------------------------------------------------------------- installation


def _hook_pth_line() -> str:
    return "import _metalnn_blas_hook; _metalnn_blas_hook.install()"


@pytest.mark.skipif(not LINUX, reason="the startup hook is installed on Linux only")
def test_installed_distribution_carries_the_hook():
    """The metalnn installed in this environment (editable here) put the hook into
    site-packages, recorded in its RECORD, and the hook is the current source."""
    # the installed dist-info, not a metalnn.egg-info a build left in the checkout
    (dist,) = importlib.metadata.distributions(name="metalnn", path=[SITE_PACKAGES])
    files = {str(f) for f in dist.files or ()}
    assert {"metalnn-blas-hook.pth", "_metalnn_blas_hook.py"} <= files, sorted(files)
    pth = dist.locate_file("metalnn-blas-hook.pth")
    module = dist.locate_file("_metalnn_blas_hook.py")
    assert os.path.realpath(os.path.dirname(str(pth))) == os.path.realpath(SITE_PACKAGES)
    assert open(pth).read().strip() == _hook_pth_line()
    with open(module, "rb") as a, open(HOOK_PY, "rb") as b:
        assert a.read() == b.read(), "site-packages has a stale startup hook: re-run `pip install -e .`"


def _source_tree_copy(dest) -> str:
    """Copy the files git would ship (tracked and new, not ignored) to dest."""
    names = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split("\0")
    for name in filter(None, names):
        src = os.path.join(REPO, name)
        if os.path.isfile(src):
            os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, name))
    return str(dest)


def _venv_on_top_of_this_one(path) -> str:
    """A fresh venv that sees this environment's packages as a plain sys.path entry (so
    none of this environment's .pth files, e.g. its own metalnn install, take part)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = os.path.join(path, "bin", "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "zz_base_environment.pth"), "w") as f:
        f.write(SITE_PACKAGES + "\n")
    return python


@needs_shim
def test_wheel_install_gives_mlx_first_openblas(tmp_path):
    """`pip wheel .` + `pip install <wheel>` (not editable) installs the hook; with mlx
    imported first MLX binds the shim of that install; `pip uninstall` removes the hook."""
    src = _source_tree_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    # The optional fastmath extension is not what this test is about (and takes a minute).
    run_cmd([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)],
            env={"METALNN_BUILD_FASTMATH": "0"}, cwd=tmp_path)
    (wheel,) = glob.glob(str(dist / "metalnn-*.whl"))
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = z.read(next(n for n in names if n.endswith(".dist-info/RECORD"))).decode()
    assert {"metalnn-blas-hook.pth", "_metalnn_blas_hook.py"} <= names
    assert "\nmetalnn-blas-hook.pth,sha256=" in "\n" + record

    python = _venv_on_top_of_this_one(tmp_path / "venv")
    pip = [sys.executable, "-m", "pip", "--python", python]
    run_cmd([*pip, "install", "-q", "--no-deps", "--no-index", wheel], cwd=tmp_path)
    env, providers = traced(tmp_path)
    proc = run_py(
        "import mlx.core as mx\n" + MATMUL + _REPORT
        + "import json, metalnn\nprint(json.dumps({**json.loads(report()), 'metalnn': metalnn.__file__}))\n",
        env=env, prelude=False, cwd=tmp_path, python=python,
    )
    out = last_json(proc)
    venv_dir = str(tmp_path / "venv")
    assert out["metalnn"].startswith(venv_dir), out  # the wheel's metalnn, not the checkout
    assert out["info"]["active"] is True and out["info"]["loaded_by"] == "startup hook", out
    assert out["info"]["shim"].startswith(venv_dir), out
    bound = providers()
    assert len(bound) == 1, bound
    (provider,) = bound.values()
    assert is_shim(provider) and provider.startswith(os.path.realpath(venv_dir)), bound
    assert out["err"] < 1e-3

    run_cmd([*pip, "uninstall", "-q", "-y", "metalnn"], cwd=tmp_path)
    left = glob.glob(str(tmp_path / "venv" / "lib" / "python*" / "site-packages" / "*metalnn*"))
    assert left == [], left


# --------------------------------------------------------------------------- correctness

CORRECTNESS = """
import numpy as np
import mlx.core as mx

info = _blas.blas_info()
rng = np.random.default_rng(0)
res = {"active": info["active"], "interface": info["interface"]}

def rel(got, want):
    got = np.asarray(got, dtype=np.float64); want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))

def r(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)

def as_mx(A):  # keeps float64 (mx.array makes float32 of it by default)
    return mx.array(A, dtype=mx.float64) if A.dtype == np.float64 else mx.array(A)

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
res["float64"] = rel(as_mx(A64) @ as_mx(B64), A64 @ B64)
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
# the rest of the LAPACK routines libmlx.so imports (getrf pivots, gesdd/syevd/heevd integer
# workspaces, geev, trtri), in each precision it has
def lu_check(A):
    lu, piv = mx.linalg.lu_factor(as_mx(A), stream=cpu)
    lu, piv = np.array(lu).astype(np.float64), np.array(piv)
    L, U = np.tril(lu, -1) + np.eye(len(A)), np.triu(lu)
    PA = A.astype(np.float64).copy()
    for i, p in enumerate(piv):  # LAPACK's row interchanges, in order
        PA[[i, p]] = PA[[p, i]]
    return rel(L @ U, PA)
def sorted_eig(w):
    w = np.asarray(w).astype(np.complex128)
    return w[np.lexsort((np.round(w.imag, 4), np.round(w.real, 4)))]
def svd_check(A):
    u, s_, vt = mx.linalg.svd(as_mx(A), stream=cpu)
    u, s_, vt = np.array(u), np.array(s_), np.array(vt)
    k = len(s_)
    return max(rel((u[:, :k] * s_) @ vt[:k], A), rel(s_, np.linalg.svd(A, compute_uv=False)))
for name, dt in [("f32", np.float32), ("f64", np.float64)]:
    A = r(30, 30, dtype=dt)
    assert as_mx(A).dtype == (mx.float64 if dt == np.float64 else mx.float32)
    P = A @ A.T + 30 * np.eye(30, dtype=dt)
    T = np.triu(A) + 30 * np.eye(30, dtype=dt)
    res[f"lu_{name}"] = lu_check(A)
    res[f"inv_{name}"] = rel(mx.linalg.inv(as_mx(A), stream=cpu), np.linalg.inv(A))
    res[f"svd_{name}"] = svd_check(A[:, :20])
    res[f"eigh_{name}"] = rel(mx.linalg.eigvalsh(as_mx(P), stream=cpu), np.linalg.eigvalsh(P))
    res[f"eig_{name}"] = rel(sorted_eig(mx.linalg.eigvals(as_mx(A), stream=cpu)), sorted_eig(np.linalg.eigvals(A)))
    res[f"tri_inv_{name}"] = rel(mx.linalg.tri_inv(as_mx(T), upper=True, stream=cpu), np.linalg.inv(T))
    res[f"cholesky_{name}"] = rel(mx.linalg.cholesky(as_mx(P), stream=cpu), np.linalg.cholesky(P))
    q, rr = mx.linalg.qr(as_mx(A), stream=cpu)
    res[f"qr_{name}"] = rel(q @ rr, A)
Z = (r(24, 24) + 1j * r(24, 24)).astype(np.complex64)
Hz = Z @ Z.conj().T + 24 * np.eye(24, dtype=np.complex64)
res["eigh_c64"] = rel(mx.linalg.eigvalsh(mx.array(Hz), stream=cpu), np.linalg.eigvalsh(Hz))
res["eig_c64"] = float(np.max(np.abs(sorted_eig(mx.linalg.eigvals(mx.array(Z), stream=cpu))
                                     - sorted_eig(np.linalg.eigvals(Z)))) / np.max(np.abs(np.linalg.eigvals(Z))))
res["svd_c64"] = rel(mx.linalg.svd(mx.array(Z), compute_uv=False, stream=cpu), np.linalg.svd(Z, compute_uv=False))
# concurrent sgemm calls from two MLX CPU streams (OpenBLAS thread safety)
M = r(256, 256)
s1, s2 = mx.new_stream(mx.cpu), mx.new_stream(mx.cpu)
outs = [mx.matmul(mx.array(M), mx.array(M), stream=(s1 if i % 2 else s2)) for i in range(8)]
mx.eval(*outs)
res["two_streams"] = max(rel(o, M @ M) for o in outs)
print(json.dumps(res))
"""

TOL = {"float16": 2e-3, "bfloat16": 1e-2, "eig_f32": 1e-4, "eig_c64": 1e-4}


def _check_correctness(env=None, want_interface=None):
    res = last_json(run_py(CORRECTNESS, env=env))
    active, interface = res.pop("active"), res.pop("interface")
    bad = {k: v for k, v in res.items() if not v <= TOL.get(k, 1e-5)}
    assert not bad, f"MLX results differ from NumPy (relative max error): {bad}"
    if want_interface is not None:
        assert interface == want_interface, (interface, want_interface)
    return active


def test_matmul_correct_with_shim():
    """The default: MLX forwarded to NumPy's own (ILP64) OpenBLAS."""
    active = _check_correctness(want_interface="ILP64" if LINUX_X86_64 else None)
    if LINUX_X86_64:
        assert active, "expected the OpenBLAS shim to be active on Linux x86_64"


@needs_shim
def test_matmul_correct_with_scipy_openblas32():
    """MLX on scipy-openblas32's LP64 OpenBLAS (used where NumPy's library is missing)."""
    assert _check_correctness(env={"METALNN_BLAS": "scipy-openblas32"}, want_interface="LP64") is True


@pytest.mark.skipif(not LINUX, reason="Linux only")
def test_matmul_correct_without_shim():
    assert _check_correctness(env={"METALNN_BLAS": "off"}) is False


@pytest.mark.skipif(not LINUX_X86_64, reason="the OpenBLAS shim is used on Linux x86_64 only")
def test_matmul_correct_single_thread():
    assert _check_correctness(env={"OPENBLAS_NUM_THREADS": "1"}) is True


_CMAKE_MODULE = re.compile(r"nanobind_add_module\(\s*_fastmath\s+([^)]*)\)")
_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _fastmath_build_inputs(root) -> set[str]:
    """The files the native build of a source tree at ``root`` reads (paths relative to root): the
    CMake list, each source it names, every header those include by quotes (transitively), and the
    cblas shim's C files that setup.py names."""
    here = "metalnn/cpu/native/fastmath"
    cmake = open(os.path.join(root, here, "CMakeLists.txt")).read()
    (module,) = _CMAKE_MODULE.findall(cmake)
    sources = [w for w in module.split() if w.endswith(".cpp")]
    assert len(sources) >= 8, module  # the CMake call still lists the translation units this parser expects
    need, todo = {f"{here}/CMakeLists.txt", f"{here}/setup_helper.py"}, [f"{here}/{s}" for s in sources]
    while todo:
        name = todo.pop()
        if name in need:
            continue
        need.add(name)
        path = os.path.join(root, name)
        if os.path.exists(path):  # a missing one is reported by the caller's comparison
            for inc in _QUOTED_INCLUDE.findall(open(path).read()):
                if not inc.startswith("mlx/"):  # MLX's own headers come from the mlx wheel
                    todo.append(os.path.normpath(os.path.join(os.path.dirname(name), inc)))
    setup_py = open(os.path.join(root, "setup.py")).read()
    need |= set(re.findall(r'"(metalnn/cpu/native/[\w/.]+\.[ch])"', setup_py))
    return need


@needs_shim
def test_sdist_carries_what_the_native_build_needs_and_installs(tmp_path):
    """The sdist holds every file the native build reads (CMake's translation units and the headers
    they include, the cblas shim), CMake configures the extension from the unpacked sdist, and a
    wheel built from the sdist installs with its cblas shim loaded by the startup hook.

    (The extension's full compile from a clean tree is what `pip install -e .` does in CI and in the
    README's test command; compiling it a second time here would add a minute and test nothing
    more than which files the sdist carries.)"""
    src = _source_tree_copy(tmp_path / "src")
    need = _fastmath_build_inputs(src)
    missing_in_tree = sorted(n for n in need if not os.path.exists(os.path.join(src, n)))
    assert missing_in_tree == [], f"the native build reads files git does not ship: {missing_in_tree}"
    run_cmd([sys.executable, "-c", "from setuptools import build_meta; build_meta.build_sdist('dist')"], cwd=src)
    (sdist,) = glob.glob(os.path.join(src, "dist", "metalnn-*.tar.gz"))
    import tarfile

    with tarfile.open(sdist) as tar:
        top = os.path.basename(sdist)[: -len(".tar.gz")]
        names = {n[len(top) + 1:] for n in tar.getnames() if n.startswith(top + "/")}
        tar.extractall(tmp_path / "unpacked", filter="data")
    assert sorted(need - names) == [], f"the sdist lacks files the native build reads: {sorted(need - names)}"
    unpacked = tmp_path / "unpacked" / top
    assert _fastmath_build_inputs(unpacked) == need

    from metalnn.cpu.native.fastmath import setup_helper

    configure = run_cmd([setup_helper._cmake_executable(), "-S", str(unpacked / "metalnn/cpu/native/fastmath"),
                         "-B", str(tmp_path / "cmake-build"), f"-DPython_EXECUTABLE={sys.executable}"],
                        cwd=tmp_path)
    assert "Generating done" in configure.stdout, configure.stdout[-2000:]

    wheels = tmp_path / "wheels"
    run_cmd([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
             sdist], env={"METALNN_BUILD_FASTMATH": "0"}, cwd=tmp_path)
    (wheel,) = glob.glob(str(wheels / "metalnn-*.whl"))
    python = _venv_on_top_of_this_one(tmp_path / "venv")
    run_cmd([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
            cwd=tmp_path)
    out = last_json(
        run_py(
            "import json, sys\nimport mlx.core as mx\nimport metalnn, metalnn.cpu.fastmath as fm\n"
            "print(json.dumps({'file': metalnn.__file__, 'blas': sys.modules['metalnn.cpu.blas'].blas_info()}))\n",
            prelude=False, cwd=tmp_path, python=python,
        )
    )
    assert out["file"].startswith(str(tmp_path / "venv")), out
    assert out["blas"]["active"] is True and out["blas"]["loaded_by"] == "startup hook", out["blas"]

"""Give MLX an optimized BLAS on Linux.

The Linux ``mlx[cpu]`` wheel links the slow reference (netlib) BLAS/LAPACK it bundles
(``mlx_cpu.libs/libblas-*.so``). ``libmlx.so`` resolves ``cblas_sgemm`` and friends
through the normal dynamic-linker lookup, so if a library exporting those symbols is
in the process's global scope *before* ``mlx.core`` is first imported, MLX binds to
it instead (about 30x faster matmul, 15x faster conv on a 2-core x86_64 machine).

``setup()`` does exactly that. It runs at the first of ``import metalnn`` (which calls it
first thing) and the first ``import mlx`` of the process: ``pip install`` puts a startup
hook into site-packages (``metalnn-blas-hook.pth`` + ``_metalnn_blas_hook.py``, from
``metalnn/cpu/blas_hook.py``) that calls it just before MLX loads, so import order does not
matter. Steps:

1. loads OpenBLAS from the ``scipy-openblas32`` wheel with ``RTLD_GLOBAL``; its symbols
   carry a ``scipy_`` prefix (``scipy_cblas_sgemm``), so on its own MLX cannot use it;
2. loads ``metalnn/cpu/_cblas_shim*.so`` (built from ``metalnn/cpu/native/cblas_shim.c`` by
   ``pip install``; compiled on the fly into ``~/.cache/metalnn`` when missing and a C
   compiler exists), which exports the unprefixed ``cblas_*``/LAPACK names that
   ``libmlx.so`` imports and forwards each to its ``scipy_`` counterpart;
3. promotes the shim to the global scope once every forwarding target resolved.

Environment:
  ``METALNN_BLAS=off``  do nothing (MLX keeps its bundled reference BLAS).

Nothing happens on macOS (MLX uses Accelerate there) or on other platforms.
``blas_info()`` reports what happened. The only case left slow is ``mlx`` imported before
``metalnn`` in a process where the startup hook could not run (``python -S``, or metalnn
used from a source tree that was never pip-installed); setup() then warns once and names
the ``LD_PRELOAD`` line that fixes it.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings

__all__ = ["setup", "blas_info"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_SHIM_SOURCE = os.path.join(_HERE, "native", "cblas_shim.c")
_SHIM_EXT_GLOB = "_cblas_shim*.so"

_lock = threading.Lock()
_done = False
_warned: set[str] = set()
_info: dict = {
    "active": False,
    "library": None,  # OpenBLAS shared library that serves MLX's calls
    "shim": None,  # forwarding shim shared library
    "reason": "metalnn.cpu.blas.setup() has not run",
    "loaded_by": None,  # "import metalnn", "startup hook" or "LD_PRELOAD" when active
}
# Keep the CDLL objects alive for the life of the process.
_handles: list = []


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _disabled_by_env() -> bool:
    return os.environ.get("METALNN_BLAS", "").strip().lower() in {"off", "0", "false", "no", "none"}


def _mlx_already_loaded() -> bool:
    if "mlx.core" in sys.modules:
        return True
    # libmlx.so may also have been loaded without going through `import mlx.core`.
    try:
        with open("/proc/self/maps", "r") as f:
            return any("libmlx.so" in line for line in f)
    except OSError:
        return False


def _openblas_path() -> str | None:
    """Path of scipy-openblas32's shared library, or None if it is not installed."""
    try:
        # Importing it also loads the library with RTLD_GLOBAL (harmless; prefixed symbols).
        import scipy_openblas32  # type: ignore[import-not-found]
    except Exception:  # pragma: no cover - depends on the environment
        return None
    lib_dir = scipy_openblas32.get_lib_dir()
    try:
        name = scipy_openblas32.get_library(fullname=True)
    except Exception:
        name = None
    candidates = [os.path.join(lib_dir, name)] if name else []
    candidates += sorted(glob.glob(os.path.join(lib_dir, "libscipy_openblas*.so*")))
    for path in candidates:
        if os.path.isfile(path):
            return path
    return None


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "metalnn")


def _find_compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand:
            path = shutil.which(cand.split()[0])
            if path:
                return path
    return None


def _compile_shim() -> tuple[str | None, str]:
    """Compile the shim into the user cache dir. Returns (path, error)."""
    if not os.path.isfile(_SHIM_SOURCE):
        return None, f"shim source {_SHIM_SOURCE} not found"
    with open(_SHIM_SOURCE, "rb") as f:
        src = f.read()
    import platform

    tag = hashlib.sha256(src + platform.machine().encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    out = os.path.join(out_dir, f"cblas_shim-{tag}.so")
    if os.path.isfile(out):
        return out, ""
    cc = _find_compiler()
    if cc is None:
        return None, "no C compiler (cc/gcc/clang) found to build it"
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", tmp, _SHIM_SOURCE, "-ldl"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            os.unlink(tmp)
            return None, f"compiling it failed: {' '.join(cmd)}: {proc.stderr.strip()[-500:]}"
        os.replace(tmp, out)  # atomic: concurrent processes never see a partial file
        return out, ""
    except Exception as exc:  # pragma: no cover - depends on the environment
        return None, f"compiling it failed: {exc!r}"


def _shim_path() -> tuple[str | None, str]:
    """The packaged shim (built by pip install), else a cached compiled one."""
    override = os.environ.get("METALNN_BLAS_SHIM")
    if override:
        return (override, "") if os.path.isfile(override) else (None, f"METALNN_BLAS_SHIM={override} does not exist")
    built = sorted(glob.glob(os.path.join(_HERE, _SHIM_EXT_GLOB)))
    if built:
        return built[0], ""
    return _compile_shim()


def _load(openblas: str, shim: str) -> str:
    """Load OpenBLAS and the shim into the global scope. Returns '' or an error."""
    blas = ctypes.CDLL(openblas, mode=ctypes.RTLD_GLOBAL)
    _handles.append(blas)
    # Load the shim locally first: it only enters the global scope (where libmlx.so
    # will find it) after every forwarding target resolved.
    lib = ctypes.CDLL(shim, mode=ctypes.RTLD_LOCAL)
    _handles.append(lib)
    lib.metalnn_shim_init.argtypes = [ctypes.c_void_p]
    lib.metalnn_shim_init.restype = ctypes.c_int
    lib.metalnn_shim_symbol.argtypes = [ctypes.c_int]
    lib.metalnn_shim_symbol.restype = ctypes.c_char_p
    lib.metalnn_shim_is_resolved.argtypes = [ctypes.c_int]
    lib.metalnn_shim_is_resolved.restype = ctypes.c_int
    missing = lib.metalnn_shim_init(blas._handle)
    if missing < 0:
        return "the shim has no forwarding trampolines for this CPU architecture"
    if missing:
        names = [
            lib.metalnn_shim_symbol(i).decode()
            for i in range(lib.metalnn_shim_count())
            if not lib.metalnn_shim_is_resolved(i)
        ]
        return f"{openblas} lacks scipy_-prefixed symbols: {', '.join(names)}"
    _handles.append(ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD))
    # Check what a library loaded from now on binds `cblas_sgemm` to.
    lib.metalnn_shim_provider.argtypes = [ctypes.c_char_p]
    lib.metalnn_shim_provider.restype = ctypes.c_char_p
    provider = lib.metalnn_shim_provider(b"cblas_sgemm")
    provider = provider.decode() if provider else None
    if provider is None or os.path.realpath(provider) != os.path.realpath(shim):
        return f"cblas_sgemm in the global scope comes from {provider}, not the shim"
    return ""


def _preload_hint(openblas: str | None, shim: str | None) -> str:
    if openblas and shim:
        return f"LD_PRELOAD={openblas}:{shim}"
    return "LD_PRELOAD=<path of libscipy_openblas.so>:<path of metalnn's _cblas_shim .so>"


def setup(*, by: str = "import metalnn") -> dict:
    """Make MLX use OpenBLAS (Linux only). Idempotent; returns ``blas_info()``.

    ``by`` names the caller for ``blas_info()["loaded_by"]``.
    """
    global _done
    with _lock:
        if _done:
            return blas_info()
        _done = True
        _setup_locked()
        if _info["active"] and _info["loaded_by"] is None:
            _info["loaded_by"] = by
    return blas_info()


def _why_hook_did_not_run() -> str:
    """Why the startup hook did not load OpenBLAS before mlx (for the late warning)."""
    if sys.flags.no_site:
        return "Python runs with -S, so site-packages' startup hooks are skipped"
    if "_metalnn_blas_hook" not in sys.modules:
        return (
            "metalnn's startup hook is not installed (no metalnn-blas-hook.pth in "
            "site-packages: metalnn is used from a source tree without `pip install`)"
        )
    return "mlx was loaded before metalnn's startup hook could act"


def _setup_locked() -> None:
    if not sys.platform.startswith("linux"):
        _info["reason"] = f"not needed on {sys.platform}"
        return
    if _disabled_by_env():
        _info["reason"] = "disabled by METALNN_BLAS=off"
        return
    preloaded = _preloaded_shim()
    if preloaded:
        # LD_PRELOAD=libscipy_openblas.so:<shim> (or an earlier load) already did it.
        _info.update(active=True, shim=preloaded, reason=None, library=_openblas_path(), loaded_by="LD_PRELOAD")
        return
    openblas = _openblas_path()
    if _mlx_already_loaded():
        # Too late: libmlx.so already bound to its bundled reference BLAS. Report how
        # to fix it, without compiling anything.
        built = sorted(glob.glob(os.path.join(_HERE, _SHIM_EXT_GLOB)))
        built += sorted(glob.glob(os.path.join(_cache_dir(), "cblas_shim-*.so")))
        shim = built[0] if built else None
        _info["library"] = openblas
        _info["shim"] = shim
        why = _why_hook_did_not_run()
        _info["reason"] = f"mlx.core was imported before metalnn and {why}"
        _warn_once(
            "late",
            f"metalnn: mlx.core was imported before metalnn and {why}; MLX keeps the slow "
            "reference BLAS bundled with mlx[cpu] (matmul/conv ~30x slower). Import metalnn "
            f"before mlx, pip install metalnn, or set {_preload_hint(openblas, shim)}",
        )
        return
    if openblas is None:
        _info["reason"] = "scipy-openblas32 is not installed"
        _warn_once(
            "missing",
            "metalnn: scipy-openblas32 is not installed, so MLX uses its slow reference BLAS "
            "(matmul/conv ~30x slower). Fix: pip install scipy-openblas32",
        )
        return
    shim, shim_err = _shim_path()
    _info["library"] = openblas
    _info["shim"] = shim
    if shim is None:
        _info["reason"] = f"metalnn's cblas shim is not built and {shim_err}"
        _warn_once(
            "noshim",
            "metalnn: the cblas shim library is missing and could not be built "
            f"({shim_err}), so MLX uses its slow reference BLAS (matmul/conv ~30x slower). "
            "Fix: reinstall metalnn with a C compiler available (pip install .), or install "
            "cc/gcc so metalnn can build it into ~/.cache/metalnn.",
        )
        return
    try:
        err = _load(openblas, shim)
    except OSError as exc:
        err = f"loading failed: {exc}"
    if err:
        _info["reason"] = err
        _warn_once("loadfail", f"metalnn: could not give MLX an optimized BLAS: {err}")
        return
    _info["active"] = True
    _info["reason"] = None


def _preloaded_shim() -> str | None:
    """Path of a shim that already serves ``cblas_sgemm`` in the global scope (e.g.
    through LD_PRELOAD), else None."""
    try:
        fn = ctypes.CDLL(None).metalnn_shim_provider
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_char_p]
    fn.restype = ctypes.c_char_p
    me, provider = fn(b"metalnn_shim_provider"), fn(b"cblas_sgemm")
    if me and provider and os.path.realpath(me) == os.path.realpath(provider):
        return provider.decode()
    return None


def blas_info() -> dict:
    """What BLAS MLX uses through metalnn.

    Keys: ``active`` (bool: MLX's cblas/LAPACK calls go to OpenBLAS), ``loaded_by``
    (``"import metalnn"``, ``"startup hook"`` or ``"LD_PRELOAD"`` when active), ``library``
    (path of the OpenBLAS library, or None), ``shim`` (path of the forwarding shim, or
    None), ``reason`` (why not active, or None), ``config`` (OpenBLAS build string),
    ``core`` (CPU kernel set OpenBLAS picked, e.g. ``Haswell``; honours OPENBLAS_CORETYPE)
    and ``num_threads`` (OpenBLAS threads; honours OPENBLAS_NUM_THREADS) when active.
    """
    info = dict(_info)
    info["config"] = None
    info["core"] = None
    info["num_threads"] = None
    if info["active"] and info["library"]:
        try:
            # RTLD_NOLOAD: only look at the library if it is already loaded.
            blas = ctypes.CDLL(info["library"], mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD)
            fn = blas.scipy_openblas_get_config
            fn.restype = ctypes.c_char_p
            info["config"] = fn().decode()
            core = blas.scipy_openblas_get_corename
            core.restype = ctypes.c_char_p
            info["core"] = core().decode()
            nt = blas.scipy_openblas_get_num_threads
            nt.restype = ctypes.c_int
            info["num_threads"] = int(nt())
        except (OSError, AttributeError):
            pass
    return info

"""Give MLX an optimized BLAS on Linux: NumPy's own OpenBLAS where there is one.

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

1. picks the OpenBLAS (`metalnn.cpu.blas_libs`): NumPy's own, the ILP64 library its wheel
   bundles in ``numpy.libs`` (``scipy_cblas_sgemm64_``, 64-bit integers), so that NumPy and
   MLX share one library and one thread pool (two pools on the same cores spin against each
   other: each side's products took twice as long when a script alternated them); else the
   LP64 one of the ``scipy-openblas32`` wheel (``scipy_cblas_sgemm``);
2. loads ``metalnn/cpu/_cblas_shim*.so`` (built from ``metalnn/cpu/native/*.c`` by
   ``pip install``; compiled on the fly into ``~/.cache/metalnn`` when missing and a C
   compiler exists), which exports the unprefixed ``cblas_*``/LAPACK names that
   ``libmlx.so`` imports and forwards each to its OpenBLAS counterpart (through a wrapper
   that widens the integers for the ILP64 library);
3. promotes the shim to the global scope once every forwarding target resolved;
4. turns on the shim's thread governor, which fits OpenBLAS's thread count to the cores
   other processes leave free (`metalnn.cpu.blas_threads`).

Environment:
  ``METALNN_BLAS=off``  do nothing (MLX keeps its bundled reference BLAS);
  ``METALNN_BLAS=numpy`` / ``METALNN_BLAS=scipy-openblas32``  use that library only (the
  default, ``auto``, tries NumPy's first);
  ``METALNN_BLAS_THREADS``  ``auto`` (default), ``<k>`` or ``fixed``: see
  `metalnn.cpu.blas_threads`.

Nothing happens on macOS (MLX uses Accelerate there) or on other platforms.
``blas_info()`` reports what happened. The only case left slow is ``mlx`` imported before
``metalnn`` in a process where the startup hook could not run (``python -S``, or metalnn
used from a source tree that was never pip-installed); setup() then warns once and names
the ``LD_PRELOAD`` line that fixes it.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import sys
import threading
import warnings

__all__ = ["setup", "blas_info"]

_HERE = os.path.dirname(os.path.abspath(__file__))
_NATIVE = os.path.join(_HERE, "native")
# The shim's C sources (compiled together) and their shared header.
_SHIM_SOURCES = [os.path.join(_NATIVE, n) for n in ("cblas_shim.c", "cblas_typed.c", "blas_threads.c")]
_SHIM_HEADERS = [os.path.join(_NATIVE, "cblas_shim.h")]
_SHIM_EXT_GLOB = "_cblas_shim*.so"
_SHIM_MIN_VERSION = 2  # metalnn_shim_init_ilp64 and the thread governor
_OFF_VALUES = {"off", "0", "false", "no", "none"}
_CHOICES = {"", "auto", "on", "numpy", "scipy-openblas32"}

_lock = threading.Lock()
_done = False
_warned: set[str] = set()
_info: dict = {
    "active": False,
    "library": None,  # OpenBLAS shared library that serves MLX's calls
    "shim": None,  # forwarding shim shared library
    "reason": "metalnn.cpu.blas.setup() has not run",
    "loaded_by": None,  # "import metalnn", "startup hook" or "LD_PRELOAD" when active
    "interface": None,  # "ILP64" (NumPy's library) or "LP64" (scipy-openblas32's) when active
    "shared_with_numpy": False,  # the library is the one NumPy's wheel bundles
    "numpy_library_reason": None,  # why NumPy's library does not serve MLX (None when it does)
    "threads_reason": None,  # why the thread governor is off (None when it is on)
}
# Keep the CDLL objects alive for the life of the process.
_handles: list = []
_shim_lib: ctypes.CDLL | None = None  # the loaded shim (for the governor's state)
_names: tuple[str, str] = ("scipy_", "")  # OpenBLAS's name prefix and suffix (ILP64: "64_")


def _sibling(name: str):
    """``metalnn.cpu.<name>``, loaded by file path: this module may run before (and without)
    the ``metalnn`` package being importable (the startup hook loads it on its own)."""
    full = f"metalnn.cpu.{name}"
    module = sys.modules.get(full)
    if module is None:
        spec = importlib.util.spec_from_file_location(full, os.path.join(_HERE, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(full, None)
            raise
    return module


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _choice() -> str:
    """``METALNN_BLAS``: "off", "auto", "numpy" or "scipy-openblas32"."""
    value = os.environ.get("METALNN_BLAS", "").strip().lower()
    if value in _OFF_VALUES:
        return "off"
    if value not in _CHOICES:
        _warn_once("choice", f"metalnn: METALNN_BLAS={value!r} is not one of off, auto, numpy, scipy-openblas32; "
                             "using auto")
        return "auto"
    return "auto" if value in ("", "on") else value


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
    return _sibling("blas_libs").scipy_openblas32()


def _numpy_path() -> tuple[str | None, str]:
    """``(path, "")`` of NumPy's bundled ILP64 OpenBLAS, or ``(None, why not)``."""
    return _sibling("blas_libs").numpy_openblas()


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "metalnn")


def _find_compiler() -> str | None:
    import shutil

    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand:
            path = shutil.which(cand.split()[0])
            if path:
                return path
    return None


def _compile_shim() -> tuple[str | None, str]:
    """Compile the shim into the user cache dir. Returns (path, error)."""
    # (imported here, not at the top: the shim is compiled rarely, and these modules would cost every
    # process ~5 MiB resident, hashlib loading libcrypto)
    import hashlib
    import subprocess
    import tempfile

    missing = [p for p in _SHIM_SOURCES + _SHIM_HEADERS if not os.path.isfile(p)]
    if missing:
        return None, f"shim source {missing[0]} not found"
    digest = hashlib.sha256()
    for path in _SHIM_SOURCES + _SHIM_HEADERS:
        with open(path, "rb") as f:
            digest.update(os.path.basename(path).encode() + b"\0" + f.read())
    import platform

    digest.update(platform.machine().encode())
    out_dir = _cache_dir()
    out = os.path.join(out_dir, f"cblas_shim-{digest.hexdigest()[:16]}.so")
    if os.path.isfile(out):
        return out, ""
    cc = _find_compiler()
    if cc is None:
        return None, "no C compiler (cc/gcc/clang) found to build it"
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [cc, "-O2", "-shared", "-fPIC", "-o", tmp, *_SHIM_SOURCES, "-ldl", "-lpthread", "-lm"]
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
    if built and _shim_version(built[0]) >= _SHIM_MIN_VERSION:
        return built[0], ""
    # An older build (or none) next to this file: the cache's, compiled from the sources here.
    path, err = _compile_shim()
    if path is None and built:
        return built[0], ""  # better an older shim (LP64 only, no thread governor) than none
    return path, err


def _shim_version(path: str) -> int:
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
        return int(lib.metalnn_shim_version())
    except (OSError, AttributeError):
        return 0


def _declare(lib: ctypes.CDLL) -> None:
    lib.metalnn_shim_init.argtypes = [ctypes.c_void_p]
    lib.metalnn_shim_init.restype = ctypes.c_int
    lib.metalnn_shim_symbol.argtypes = [ctypes.c_int]
    lib.metalnn_shim_symbol.restype = ctypes.c_char_p
    lib.metalnn_shim_is_resolved.argtypes = [ctypes.c_int]
    lib.metalnn_shim_is_resolved.restype = ctypes.c_int
    lib.metalnn_shim_provider.argtypes = [ctypes.c_char_p]
    lib.metalnn_shim_provider.restype = ctypes.c_char_p
    if hasattr(lib, "metalnn_shim_init_ilp64"):
        lib.metalnn_shim_init_ilp64.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.metalnn_shim_init_ilp64.restype = ctypes.c_int
        lib.metalnn_shim_library.argtypes = []
        lib.metalnn_shim_library.restype = ctypes.c_char_p


def _missing_names(lib: ctypes.CDLL) -> str:
    """The names the library given to the last failed init lacks."""
    count = lib.metalnn_shim_count()
    return ", ".join(lib.metalnn_shim_symbol(i).decode() for i in range(count) if not lib.metalnn_shim_is_resolved(i))


def _bind_numpy(library: str, lib: ctypes.CDLL) -> str:
    """Point the shim at NumPy's ILP64 OpenBLAS. Returns '' or why not."""
    global _names
    if not hasattr(lib, "metalnn_shim_init_ilp64"):
        return "the cblas shim predates ILP64 forwarding (rebuild it: pip install .)"
    # Loaded locally, as NumPy loads it: the same file is one library, whoever loads it first.
    blas = ctypes.CDLL(library, mode=ctypes.RTLD_LOCAL)
    _handles.append(blas)
    for prefix in ("scipy_", ""):  # NumPy >= 2 / NumPy 1.x names
        missing = lib.metalnn_shim_init_ilp64(blas._handle, prefix.encode())
        if missing == 0:
            _names = (prefix, "64_")
            return ""
        if missing < 0:
            return "the shim has no forwarding trampolines for this CPU architecture"
    return f"{library} lacks ILP64 symbols: {_missing_names(lib)}"


def _bind_openblas32(library: str, lib: ctypes.CDLL) -> str:
    """Point the shim at scipy-openblas32's LP64 OpenBLAS. Returns '' or why not."""
    global _names
    blas = ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    _handles.append(blas)
    missing = lib.metalnn_shim_init(blas._handle)
    if missing < 0:
        return "the shim has no forwarding trampolines for this CPU architecture"
    if missing:
        return f"{library} lacks scipy_-prefixed symbols: {_missing_names(lib)}"
    _names = ("scipy_", "")
    return ""


def _promote(shim: str, lib: ctypes.CDLL) -> str:
    """Put the shim into the global scope (where libmlx.so will find it). Returns '' or an
    error."""
    _handles.append(ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD))
    # Check what a library loaded from now on binds `cblas_sgemm` to.
    provider = lib.metalnn_shim_provider(b"cblas_sgemm")
    provider = provider.decode() if provider else None
    if provider is None or os.path.realpath(provider) != os.path.realpath(shim):
        return f"cblas_sgemm in the global scope comes from {provider}, not the shim"
    return ""


def _preload_hint(openblas: str | None, shim: str | None) -> str:
    if openblas and shim:
        return f"LD_PRELOAD={openblas}:{shim}"
    return "LD_PRELOAD=<path of NumPy's libscipy_openblas64_*.so>:<path of metalnn's _cblas_shim .so>"


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
        if _info["active"]:
            _start_governor()
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
    choice = _choice()
    if choice == "off":
        _info["reason"] = "disabled by METALNN_BLAS=off"
        return
    if _preloaded_shim():
        return
    _sibling("blas_hook").quiet_openblas_threads()  # (before OpenBLAS loads, when it has not yet)
    numpy_lib, numpy_why = _numpy_path() if choice in ("auto", "numpy") else (None, f"METALNN_BLAS={choice}")
    openblas32 = _openblas_path() if choice in ("auto", "scipy-openblas32") else None
    if _mlx_already_loaded():
        # Too late: libmlx.so already bound to its bundled reference BLAS. Report how
        # to fix it, without compiling anything.
        built = sorted(glob.glob(os.path.join(_HERE, _SHIM_EXT_GLOB)))
        built += sorted(glob.glob(os.path.join(_cache_dir(), "cblas_shim-*.so")))
        shim = built[0] if built else None
        library = numpy_lib or openblas32
        _info["library"] = library
        _info["shim"] = shim
        why = _why_hook_did_not_run()
        _info["reason"] = f"mlx.core was imported before metalnn and {why}"
        _warn_once(
            "late",
            f"metalnn: mlx.core was imported before metalnn and {why}; MLX keeps the slow "
            "reference BLAS bundled with mlx[cpu] (matmul/conv ~30x slower). Import metalnn "
            f"before mlx, pip install metalnn, or set {_preload_hint(library, shim)}",
        )
        return
    if numpy_lib is None and openblas32 is None:
        if choice == "numpy":
            _info["reason"] = f"METALNN_BLAS=numpy, but {numpy_why}"
            _warn_once("missing", f"metalnn: METALNN_BLAS=numpy, but {numpy_why}, so MLX uses its slow reference "
                                  "BLAS (matmul/conv ~30x slower)")
            return
        _info["reason"] = f"{numpy_why} and scipy-openblas32 is not installed"
        _warn_once(
            "missing",
            f"metalnn: {numpy_why} and scipy-openblas32 is not installed, so MLX uses its slow reference BLAS "
            "(matmul/conv ~30x slower). Fix: pip install scipy-openblas32",
        )
        return
    shim, shim_err = _shim_path()
    _info["shim"] = shim
    _info["library"] = numpy_lib or openblas32
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
    err = _load(shim, numpy_lib, numpy_why, openblas32)
    if err:
        _info["reason"] = err
        _warn_once("loadfail", f"metalnn: could not give MLX an optimized BLAS: {err}")
        return
    _info["active"] = True
    _info["reason"] = None


def _load(shim: str, numpy_lib: str | None, numpy_why: str, openblas32: str | None) -> str:
    """Load the shim, bind it to NumPy's library (else scipy-openblas32's) and promote it.
    Returns '' or an error."""
    global _shim_lib
    try:
        # Loaded locally first: it only enters the global scope (where libmlx.so will find
        # it) after every forwarding target resolved.
        lib = ctypes.CDLL(shim, mode=ctypes.RTLD_LOCAL)
        _handles.append(lib)
        _declare(lib)
        err = _bind_numpy(numpy_lib, lib) if numpy_lib else numpy_why
        if not err:
            _info.update(library=numpy_lib, interface="ILP64", shared_with_numpy=True, numpy_library_reason=None)
        elif openblas32 is None:
            return err
        else:
            _info["numpy_library_reason"] = err
            err = _bind_openblas32(openblas32, lib)
            if err:
                return err
            _info.update(library=openblas32, interface="LP64", shared_with_numpy=False)
        err = _promote(shim, lib)
    except OSError as exc:
        return f"loading failed: {exc}"
    if not err:
        _shim_lib = lib
    return err


def _preloaded_shim() -> bool:
    """Record a shim that already serves ``cblas_sgemm`` in the global scope (through
    LD_PRELOAD, or an earlier load); False when there is none."""
    global _shim_lib, _names
    try:
        fn = ctypes.CDLL(None).metalnn_shim_provider
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_char_p]
    fn.restype = ctypes.c_char_p
    me, provider = fn(b"metalnn_shim_provider"), fn(b"cblas_sgemm")
    if not (me and provider and os.path.realpath(me) == os.path.realpath(provider)):
        return False
    shim = provider.decode()
    library, interface = _openblas_path(), "LP64"
    try:
        lib = ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD)
        _declare(lib)
        _shim_lib = lib
        if hasattr(lib, "metalnn_shim_library"):
            found = lib.metalnn_shim_library()
            library = found.decode() if found else library
            if lib.metalnn_shim_interface() == 64:
                interface = "ILP64"
    except OSError:
        pass
    libs = _sibling("blas_libs")
    numpy_lib, _ = libs.numpy_openblas()
    shared = bool(library and numpy_lib and os.path.realpath(library) == os.path.realpath(numpy_lib))
    _names = ("scipy_", "64_" if interface == "ILP64" else "")
    _info.update(active=True, shim=shim, reason=None, library=library, loaded_by="LD_PRELOAD", interface=interface,
                 shared_with_numpy=shared)
    return True


def _start_governor() -> None:
    """Turn on the shim's thread governor as METALNN_BLAS_THREADS says."""
    threads = _sibling("blas_threads")
    setting = threads.read_setting()
    if setting.error:
        _warn_once("threads", f"metalnn: {setting.error}; using auto")
    if _shim_lib is None:
        _info["threads_reason"] = "no metalnn shim is loaded"
        return
    _info["threads_reason"] = threads.configure(_shim_lib, _library_int("openblas_get_num_threads"), setting)


def _openblas_fn_in(library: str, base: str):
    """OpenBLAS's function ``base`` (e.g. ``openblas_get_config``) in the already loaded
    ``library``, under the names that library uses, or None."""
    try:
        # RTLD_NOLOAD: only look at the library if it is already loaded (and leave its scope).
        blas = ctypes.CDLL(library, mode=ctypes.RTLD_LOCAL | os.RTLD_NOLOAD)
    except OSError:
        return None
    prefix, suffix = _names
    for name in (f"{prefix}{base}{suffix}", f"scipy_{base}", f"scipy_{base}64_", f"{base}64_"):
        fn = getattr(blas, name, None)
        if fn is not None:
            return fn
    return None


def _library_str(base: str) -> str | None:
    fn = _openblas_fn_in(_info["library"], base) if _info["library"] else None
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    out = fn()
    return out.decode() if out else None


def _library_int(base: str) -> int | None:
    fn = _openblas_fn_in(_info["library"], base) if _info["library"] else None
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    return int(fn())


def blas_info() -> dict:
    """What BLAS MLX uses through metalnn.

    Keys: ``active`` (bool: MLX's cblas/LAPACK calls go to OpenBLAS), ``loaded_by``
    (``"import metalnn"``, ``"startup hook"`` or ``"LD_PRELOAD"`` when active), ``library``
    (path of the OpenBLAS library, or None), ``interface`` (``"ILP64"``: NumPy's library,
    ``"LP64"``: scipy-openblas32's), ``shared_with_numpy`` (bool: NumPy's own library, so one
    thread pool serves both), ``numpy_library_reason`` (why NumPy's library was not used, or
    None), ``shim`` (path of the forwarding shim, or None), ``reason`` (why not active, or
    None), ``config`` (OpenBLAS build string), ``core`` (CPU kernel set OpenBLAS picked, e.g.
    ``Haswell``; honours OPENBLAS_CORETYPE), ``num_threads`` (OpenBLAS threads now) and
    ``threads`` (the thread governor: ``adaptive``, ``cap``, ``cpus``, ``busy_elsewhere``,
    ``chosen``; see `metalnn.cpu.blas_threads`) with ``threads_reason`` (why it is off, or
    None).
    """
    info = dict(_info)
    info["config"] = None
    info["core"] = None
    info["num_threads"] = None
    info["threads"] = _sibling("blas_threads").state(_shim_lib) if info["active"] else None
    if info["active"] and info["library"]:
        info["config"] = _library_str("openblas_get_config")
        info["core"] = _library_str("openblas_get_corename")
        info["num_threads"] = _library_int("openblas_get_num_threads")
    return info

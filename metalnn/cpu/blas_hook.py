"""Startup hook: MLX gets metalnn's optimized BLAS whatever is imported first.

MLX binds its BLAS calls once, when ``libmlx.so`` loads (the first ``import mlx.core``),
so OpenBLAS and metalnn's forwarding shim must be in the process before that moment
(see ``metalnn.cpu.blas``). ``import metalnn`` does it when it comes first; this hook does
it in every other case.

How it is installed: ``pip install`` (wheel and editable alike, see setup.py) copies this
file to the root of site-packages as ``_metalnn_blas_hook.py`` next to
``metalnn-blas-hook.pth``, whose one line runs :func:`install` when the interpreter
starts. :func:`install` only puts :class:`BlasImportHook` first on ``sys.meta_path``;
nothing else is imported at start-up (no numpy, no mlx, no metalnn).

When the ``mlx`` package is looked up for the first time, the finder removes itself,
locates metalnn's ``cpu/blas.py`` without importing the ``metalnn`` package (which would
import mlx), loads it as ``metalnn.cpu.blas`` and calls its ``setup()``; then the import of
mlx proceeds normally and ``libmlx.so`` binds to OpenBLAS. ``import metalnn`` later reuses
that same module. Any failure only warns: the hook never breaks ``import mlx``.

At start-up :func:`install` also sets ``OPENBLAS_THREAD_TIMEOUT`` (see
:func:`quiet_openblas_threads`; OpenBLAS reads it once, when it loads, which may be NumPy's import).

It does nothing off Linux, with ``METALNN_BLAS=off``, or when ``python -S`` disables
site-packages processing (then ``import metalnn`` must come before ``import mlx.core``).
"""

from __future__ import annotations

import os
import sys

__all__ = ["BlasImportHook", "install", "installed"]

_OFF_VALUES = {"off", "0", "false", "no", "none"}
_BLAS_MODULE = "metalnn.cpu.blas"

#: How long OpenBLAS's threads poll for the next product before they sleep: 2**20 cycles (~0.4 ms
#: at 2.5 GHz). OpenBLAS's own default, 2**28 cycles (~0.1 s), keeps them polling all through the
#: native work between two MLX products (the rest of a layer), each taking a core from MLX's and
#: metalnn's threads: a SmolLM2 prompt chunk of 256 tokens after 256 cached ones ran in 1.25-1.34 s
#: against 0.75-0.89 s with 2**20 (its attention is two BLAS products, the rest native). Products
#: that follow each other within the window still find the threads awake.
OPENBLAS_THREAD_TIMEOUT = "20"


def _disabled() -> bool:
    return os.environ.get("METALNN_BLAS", "").strip().lower() in _OFF_VALUES


class BlasImportHook:
    """Meta-path finder that finds nothing: the first lookup of ``mlx`` (or a submodule)
    runs metalnn's BLAS setup, then the finder removes itself from ``sys.meta_path``."""

    triggered = False

    def find_spec(self, fullname, path=None, target=None):
        if BlasImportHook.triggered or not (fullname == "mlx" or fullname.startswith("mlx.")):
            return None
        BlasImportHook.triggered = True
        _remove_hooks()
        try:
            _setup_blas()
        except Exception as exc:  # never break `import mlx`
            import warnings

            warnings.warn(
                f"metalnn: the startup hook could not give MLX an optimized BLAS "
                f"({type(exc).__name__}: {exc}); MLX keeps its bundled reference BLAS",
                RuntimeWarning,
                stacklevel=2,
            )
        return None

    def invalidate_caches(self) -> None:
        pass


def _remove_hooks() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, BlasImportHook)]


def _locate_blas_module() -> str | None:
    """Path of metalnn/cpu/blas.py, found without importing the metalnn package."""
    import importlib.util

    spec = importlib.util.find_spec("metalnn")
    if spec is None:
        return None
    for directory in spec.submodule_search_locations or ():
        path = os.path.join(directory, "cpu", "blas.py")
        if os.path.isfile(path):
            return path
    return None


def _setup_blas() -> None:
    if _disabled():
        return
    blas = sys.modules.get(_BLAS_MODULE)
    if blas is None:
        path = _locate_blas_module()
        if path is None:  # metalnn was uninstalled but this file was left behind
            return
        import importlib.util

        spec = importlib.util.spec_from_file_location(_BLAS_MODULE, path)
        blas = importlib.util.module_from_spec(spec)
        sys.modules[_BLAS_MODULE] = blas
        try:
            spec.loader.exec_module(blas)
        except BaseException:
            sys.modules.pop(_BLAS_MODULE, None)
            raise
    blas.setup(by="startup hook")


def quiet_openblas_threads() -> None:
    """``OPENBLAS_THREAD_TIMEOUT`` = `OPENBLAS_THREAD_TIMEOUT` in the environment, unless it is set
    already (yours is kept) or ``METALNN_BLAS=off``. Effective for an OpenBLAS loaded after it."""
    if not _disabled():
        os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_THREAD_TIMEOUT)


def install() -> None:
    """Register :class:`BlasImportHook` and `quiet_openblas_threads` (Linux only; idempotent; cheap)."""
    try:
        if not sys.platform.startswith("linux"):
            return
        quiet_openblas_threads()
        if "mlx.core" in sys.modules:
            return
        if not any(isinstance(f, BlasImportHook) for f in sys.meta_path):
            sys.meta_path.insert(0, BlasImportHook())
    except Exception:  # a broken hook must not stop the interpreter from starting
        pass


def installed() -> bool:
    """True when the hook is registered and has not run yet."""
    return any(isinstance(f, BlasImportHook) for f in sys.meta_path)

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

It does nothing off Linux, with ``METALNN_BLAS=off``, or when ``python -S`` disables
site-packages processing (then ``import metalnn`` must come before ``import mlx.core``).
"""

from __future__ import annotations

import os
import sys

__all__ = ["BlasImportHook", "install", "installed"]

_OFF_VALUES = {"off", "0", "false", "no", "none"}
_BLAS_MODULE = "metalnn.cpu.blas"


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


def install() -> None:
    """Register :class:`BlasImportHook` (Linux only; idempotent; cheap)."""
    try:
        if not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
            return
        if not any(isinstance(f, BlasImportHook) for f in sys.meta_path):
            sys.meta_path.insert(0, BlasImportHook())
    except Exception:  # a broken hook must not stop the interpreter from starting
        pass


def installed() -> bool:
    """True when the hook is registered and has not run yet."""
    return any(isinstance(f, BlasImportHook) for f in sys.meta_path)

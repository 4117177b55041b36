"""Load metalnn's native CPU extension (``metalnn.cpu._fastmath``) when it is safe to use.

The extension subclasses MLX C++ primitives and shares mlx.core's nanobind domain, so
it only works with the exact libmlx and nanobind ABI it was built against. Before the
module is imported (which would already bind it to the running libmlx), its file is
checked: the mlx version it was built for (a tag compiled into the binary) must be the
installed one, and its nanobind internals key must be mlx.core's. Then a small
computation checks ``mx.array`` crosses the binding.

It is never loaded on macOS (MLX's Metal and Accelerate back ends serve these ops there)
and not with ``METALNN_FASTMATH=0``. Every refusal leaves a reason for
``unavailable_reason()``; the callers (metalnn.cpu.fastmath, metalnn.cpu.im2col) then use MLX ops.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import sys
import warnings

import mlx.core as mx

__all__ = ["extension", "unavailable_reason"]

_BUILD_TAG = re.compile(rb"metalnn_fastmath_mlx_version=([0-9A-Za-z.+_-]+)\x00")
_NANOBIND_KEY = re.compile(rb"nanobind_[A-Za-z0-9_]+_a\d+_v\d+(?:_stable)?")

_state: dict = {}


def _installed_mlx_version(built_for: str | None = None) -> str:
    """The installed mlx's version as its package metadata gives it (what the build tag records).
    ``mlx.core.__version__`` is the same string for released mlx, so when it equals ``built_for`` the
    metadata is not read (importlib.metadata's imports cost every process ~4 MiB resident)."""
    quick = getattr(mx, "__version__", None)
    if quick is not None and quick == built_for:
        return quick
    try:
        from importlib.metadata import version

        return version("mlx")
    except Exception:  # pragma: no cover - metadata missing
        return quick or "unknown"


def _scan(path: str, pattern: re.Pattern) -> bytes | None:
    try:
        with open(path, "rb") as f:
            m = pattern.search(f.read())
    except OSError:
        return None
    return m.group(m.lastindex or 0) if m else None


def _refuse(reason: str, *, warn: bool = False):
    if warn:
        # stacklevel 5: the module that asked for the extension (metalnn.cpu.fastmath, metalnn.cpu.im2col)
        warnings.warn(f"metalnn: {reason}; using MLX ops instead", RuntimeWarning, stacklevel=5)
    return None, reason


def _load():
    if os.environ.get("METALNN_FASTMATH", "1").strip().lower() in ("0", "false", "no", "off"):
        return _refuse("disabled by METALNN_FASTMATH=0")
    if sys.platform == "darwin":
        return _refuse("not used on macOS (MLX's Metal and Accelerate back ends serve these ops)")
    spec = importlib.util.find_spec("metalnn.cpu._fastmath")
    if spec is None or not spec.origin:
        return _refuse(
            "the native extension metalnn.cpu._fastmath is not built (it is built by `pip install` on "
            "Linux when CMake, a C++20 compiler and the pinned nanobind are available; see the "
            "warning printed at install)"
        )
    tag = _scan(spec.origin, _BUILD_TAG)
    if tag is None:
        return _refuse(f"{spec.origin} carries no mlx build tag (an old or foreign build); rebuild metalnn", warn=True)
    built_for = tag.decode()
    runtime = _installed_mlx_version(built_for)
    if built_for != runtime:
        return _refuse(
            f"the native extension was built against mlx {built_for} but mlx {runtime} is "
            "installed, and its primitives are only ABI-compatible with the mlx they were built "
            f"with; install mlx {built_for}, or rebuild metalnn against the installed mlx "
            "(pip install --no-build-isolation --no-cache-dir --force-reinstall --no-deps <metalnn>)",
            warn=True,
        )
    ours, theirs = _scan(spec.origin, _NANOBIND_KEY), _scan(mx.__file__, _NANOBIND_KEY)
    if ours and theirs and ours != theirs:
        return _refuse(
            f"the native extension uses nanobind internals {ours.decode()} but mlx.core uses "
            f"{theirs.decode()}, so mx.array cannot cross between them; rebuild metalnn with the "
            "nanobind version pinned in its build requirements",
            warn=True,
        )
    try:
        from metalnn.cpu import _fastmath as ext  # noqa: PLC0415

        probe = ext.exp(mx.array([0.0, 1.0], dtype=mx.float32), stream=mx.cpu)
        mx.eval(probe)
        ok = abs(probe.tolist()[1] - math.e) < 1e-5
    except Exception as e:
        return _refuse(f"the native extension failed its self-test ({type(e).__name__}: {e})", warn=True)
    if not ok:
        return _refuse("the native extension failed its self-test (wrong value)", warn=True)
    return ext, None


def _get():
    if not _state:
        _state["ext"], _state["reason"] = _load()
    return _state["ext"], _state["reason"]


def extension():
    """The loaded ``metalnn.cpu._fastmath`` module, or None (see :func:`unavailable_reason`)."""
    return _get()[0]


def unavailable_reason() -> str | None:
    """Why :func:`extension` is None (``None`` when it is loaded)."""
    return _get()[1]

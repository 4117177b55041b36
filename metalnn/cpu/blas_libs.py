"""Where the OpenBLAS libraries that can serve MLX are, found without importing them.

* NumPy's own: NumPy's wheels bundle an ILP64 OpenBLAS (64-bit integers) in ``numpy.libs``
  (``libscipy_openblas64_-<hash>.so``, names such as ``scipy_cblas_sgemm64_``; NumPy < 2:
  ``libopenblas64_p-r0-<hash>.so``, names such as ``cblas_sgemm64_``). MLX forwarded to it
  shares NumPy's library and thread pool.
* scipy-openblas32's: an LP64 OpenBLAS (``scipy_cblas_sgemm``), the one used where NumPy's
  cannot be (a NumPy built against another BLAS, or none installed).

Used by `metalnn.cpu.blas` before ``mlx`` (and often before ``numpy``) is imported, so this
module imports neither, nor the ``metalnn`` package: `metalnn.cpu.blas` loads it by file path.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re

__all__ = ["numpy_openblas", "scipy_openblas32", "mapped_openblas"]

# Library file names of NumPy's bundled ILP64 OpenBLAS and of scipy-openblas32's.
_NUMPY_LIB = re.compile(r"^lib(scipy_)?openblas64_.*\.so(\.\d+)*$")
_OPENBLAS_LIB = re.compile(r"^lib(scipy_)?openblas.*\.so(\.\d+)*$")


def mapped_openblas() -> list[str]:
    """Paths of the OpenBLAS libraries mapped into this process (from /proc/self/maps)."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if path.startswith("/") and _OPENBLAS_LIB.match(os.path.basename(path)) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def _numpy_dir() -> str | None:
    """NumPy's package folder, from the import system (NumPy is not imported)."""
    try:
        spec = importlib.util.find_spec("numpy")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _named_by_numpy(numpy_dir: str, candidates: list[str]) -> list[str]:
    """The candidates whose file name NumPy's core extension names (its DT_NEEDED entry)."""
    cores = glob.glob(os.path.join(numpy_dir, "_core", "_multiarray_umath*.so"))
    cores += glob.glob(os.path.join(numpy_dir, "core", "_multiarray_umath*.so"))
    named = []
    for core in cores:
        try:
            with open(core, "rb") as f:
                data = f.read()
        except OSError:
            continue
        named += [c for c in candidates if os.path.basename(c).encode() + b"\0" in data]
    return named


def numpy_openblas() -> tuple[str | None, str]:
    """``(path, "")`` of NumPy's bundled ILP64 OpenBLAS, or ``(None, why not)``.

    The library already mapped into the process wins (NumPy imported first); otherwise the
    one in the ``numpy.libs`` folder next to the NumPy package that ``import numpy`` would
    load (when several are there, the one NumPy's core extension names).
    """
    for path in mapped_openblas():
        if _NUMPY_LIB.match(os.path.basename(path)):
            return path, ""
    numpy_dir = _numpy_dir()
    if numpy_dir is None:
        return None, "NumPy is not installed"
    libs = os.path.join(os.path.dirname(numpy_dir), "numpy.libs")
    candidates = sorted(p for p in glob.glob(os.path.join(libs, "*.so*")) if _NUMPY_LIB.match(os.path.basename(p)))
    if len(candidates) > 1:
        candidates = _named_by_numpy(numpy_dir, candidates) or candidates[:0]
    if len(candidates) != 1:
        return None, f"NumPy at {numpy_dir} bundles no ILP64 OpenBLAS (no single lib*openblas64_*.so in {libs})"
    return candidates[0], ""


def scipy_openblas32() -> str | None:
    """Path of scipy-openblas32's shared library, or None if it is not installed.

    Found without importing the package (importing it loads the library)."""
    try:
        spec = importlib.util.find_spec("scipy_openblas32")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    lib_dir = os.path.join(list(spec.submodule_search_locations)[0], "lib")
    for path in sorted(glob.glob(os.path.join(lib_dir, "libscipy_openblas*.so*"))):
        if os.path.isfile(path) and not _NUMPY_LIB.match(os.path.basename(path)):
            return path
    return None

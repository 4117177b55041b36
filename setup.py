"""Build hook for metalnn (project metadata lives in pyproject.toml).

On Linux this builds metalnn/_native/cblas_shim.c into the shared library
``metalnn/_cblas_shim*.so``: it exports the standard ``cblas_*``/LAPACK symbols that
MLX's libmlx.so imports and forwards them to the ``scipy_``-prefixed OpenBLAS of the
scipy-openblas32 wheel (see metalnn/_blas.py). The library is only ever loaded with
ctypes; it is a (trivial) extension module just so setuptools can build and install it,
for `pip install .` and `pip install -e .` alike. The build is optional: if it fails,
metalnn compiles the shim at import time into ~/.cache/metalnn (or warns).
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup


def _load_fastmath_helper():
    # by file path: importing metalnn itself at build time is not possible
    path = Path(__file__).resolve().parent / "metalnn" / "_native" / "fastmath" / "setup_helper.py"
    spec = importlib.util.spec_from_file_location("_metalnn_fastmath_setup_helper", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ext_modules = []
cmdclass = {}
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "metalnn._cblas_shim",
            sources=["metalnn/_native/cblas_shim.c"],
            define_macros=[("METALNN_SHIM_PYMODULE", "1")],
            extra_compile_args=["-O2"],
            libraries=["dl"],
            optional=True,
        )
    )
    # Optional vectorised CPU primitives for MLX (metalnn.fastmath), built with CMake + nanobind
    # against the installed mlx wheel; skipped with a warning if the build fails.
    fastmath = _load_fastmath_helper()
    ext_modules.append(fastmath.FastmathExtension("metalnn._fastmath"))
    cmdclass["build_ext"] = fastmath.BuildExt

setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    # The C source is also needed at run time, for the fallback build into ~/.cache.
    package_data={"metalnn": ["_native/*.c"]},
)

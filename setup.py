"""Build hook for metalnn (project metadata lives in pyproject.toml).

On Linux this builds metalnn/_native/cblas_shim.c into the shared library
``metalnn/_cblas_shim*.so``: it exports the standard ``cblas_*``/LAPACK symbols that
MLX's libmlx.so imports and forwards them to the ``scipy_``-prefixed OpenBLAS of the
scipy-openblas32 wheel (see metalnn/_blas.py). The library is only ever loaded with
ctypes; it is a (trivial) extension module just so setuptools can build and install it,
for `pip install .` and `pip install -e .` alike. The build is optional: if it fails,
metalnn compiles the shim at import time into ~/.cache/metalnn (or warns).
"""

import sys

from setuptools import Extension, setup

ext_modules = []
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

setup(
    ext_modules=ext_modules,
    # The C source is also needed at run time, for the fallback build into ~/.cache.
    package_data={"metalnn": ["_native/*.c"]},
)

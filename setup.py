"""Build hook for metalnn (project metadata lives in pyproject.toml).

On Linux this

* builds metalnn/cpu/native/*.c into the shared library ``metalnn/cpu/_cblas_shim*.so``:
  it exports the standard ``cblas_*``/LAPACK symbols that MLX's libmlx.so imports and
  forwards them to NumPy's bundled OpenBLAS, or to the OpenBLAS of the scipy-openblas32
  wheel (see metalnn/cpu/blas.py). The library is only ever loaded with ctypes; it is a (trivial)
  extension module just so setuptools can build and install it. The build is optional:
  if it fails, metalnn compiles the shim at import time into ~/.cache/metalnn (or warns);
* builds the optional ``metalnn.cpu._fastmath`` extension (CMake + nanobind, against the
  installed mlx; see metalnn/cpu/native/fastmath/setup_helper.py). ``METALNN_BUILD_FASTMATH=0``
  skips it;
* installs the BLAS startup hook at the root of site-packages: ``metalnn-blas-hook.pth``
  and ``_metalnn_blas_hook.py`` (a copy of metalnn/cpu/blas_hook.py), for wheels (``pip
  install .``, sdists) through build_py and for editable installs (``pip install -e .``)
  by adding both files to the editable wheel.

Nothing native is built, and no hook is installed, on macOS (MLX uses Metal and
Accelerate there).
"""

import base64
import hashlib
import importlib.util
import os
import sys
import zipfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
HOOK_MODULE = "_metalnn_blas_hook"
HOOK_PTH = "metalnn-blas-hook.pth"


def _load_fastmath_helper():
    # by file path: importing metalnn itself at build time is not possible
    path = HERE / "metalnn" / "cpu" / "native" / "fastmath" / "setup_helper.py"
    spec = importlib.util.spec_from_file_location("_metalnn_fastmath_setup_helper", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hook_files() -> dict:
    """File name at the root of site-packages -> contents."""
    source = (HERE / "metalnn" / "cpu" / "blas_hook.py").read_bytes()
    pth = f"import {HOOK_MODULE}; {HOOK_MODULE}.install()\n".encode()
    return {f"{HOOK_MODULE}.py": source, HOOK_PTH: pth}


class BuildPyWithHook(build_py):
    """build_py that also writes the startup hook files to the root of build_lib."""

    def run(self):
        super().run()
        if self.editable_mode:  # EditableWheelWithHook adds them to the editable wheel
            return
        for name, data in _hook_files().items():
            target = Path(self.build_lib) / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

    def get_outputs(self, include_bytecode=True):
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs += [str(Path(self.build_lib) / name) for name in _hook_files()]
        return outputs


def _add_to_wheel(wheel: Path, files: dict) -> None:
    """Add ``files`` (name -> bytes) at the root of ``wheel``, with RECORD entries."""
    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        names = src.namelist()
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        for item in src.infolist():
            if item.filename != record and item.filename not in files:
                dst.writestr(item, src.read(item.filename))
        lines = [ln for ln in src.read(record).decode().splitlines() if ln.strip()]
        lines = [ln for ln in lines if ln.split(",")[0] not in files and ln.split(",")[0] != record]
        for name, data in files.items():
            dst.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{name},sha256={digest},{len(data)}")
        lines.append(f"{record},,")
        dst.writestr(record, "\n".join(lines) + "\n")
    os.replace(tmp, wheel)


def _editable_wheel_with_hook():
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithHook(editable_wheel):
        """editable_wheel whose wheel also installs the startup hook into site-packages
        (an editable wheel otherwise only carries the files that point to the sources)."""

        def run(self):
            dist_dir = Path(self.dist_dir)
            before = {p: p.stat().st_mtime_ns for p in dist_dir.glob("*.whl")}
            super().run()
            built = [p for p in dist_dir.glob("*.whl") if before.get(p) != p.stat().st_mtime_ns]
            if not built:
                raise RuntimeError(f"metalnn: no editable wheel was written to {dist_dir}")
            for wheel in built:
                _add_to_wheel(wheel, _hook_files())

    return EditableWheelWithHook


def _build_fastmath() -> bool:
    return os.environ.get("METALNN_BUILD_FASTMATH", "1").strip().lower() not in {"0", "off", "false", "no"}


ext_modules = []
cmdclass = {}
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "metalnn.cpu._cblas_shim",
            sources=[
                "metalnn/cpu/native/cblas_shim.c",
                "metalnn/cpu/native/cblas_typed.c",
                "metalnn/cpu/native/blas_threads.c",
            ],
            depends=["metalnn/cpu/native/cblas_shim.h"],
            define_macros=[("METALNN_SHIM_PYMODULE", "1")],
            extra_compile_args=["-O2"],
            libraries=["dl", "pthread", "m"],
            optional=True,
        )
    )
    cmdclass["build_py"] = BuildPyWithHook
    cmdclass["editable_wheel"] = _editable_wheel_with_hook()
    if _build_fastmath():
        # Optional vectorised CPU primitives for MLX (metalnn.cpu.fastmath), built with CMake +
        # nanobind against the installed mlx wheel; skipped with a warning if the build fails.
        fastmath = _load_fastmath_helper()
        ext_modules.append(fastmath.FastmathExtension("metalnn.cpu._fastmath"))
        cmdclass["build_ext"] = fastmath.BuildExt

setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    # The C sources are also needed at run time, for the fallback build into ~/.cache.
    package_data={"metalnn.cpu": ["native/*.c", "native/*.h"]},
)

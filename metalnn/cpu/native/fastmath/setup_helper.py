"""Build driver for the optional ``metalnn.cpu._fastmath`` extension (CMake + nanobind).

Used from setup.py (loaded by file path, so importing it does not import metalnn)::

    fastmath = _load("metalnn/cpu/native/fastmath/setup_helper.py")
    ext_modules.append(fastmath.FastmathExtension())
    setup(cmdclass={"build_ext": fastmath.BuildExt}, ...)

and stand-alone, to (re)build the module in place for development::

    python metalnn/cpu/native/fastmath/setup_helper.py            # -> metalnn/cpu/_fastmath*.so

Build requirements: Linux (x86_64 gets AVX2+FMA kernels chosen at run time, other
architectures such as aarch64 the portable C++ kernels), a C++20 compiler, CMake >= 3.18
(on PATH or the ``cmake`` PyPI package), ``nanobind`` producing the same internals ABI as
the one mlx.core was built with (MLX 0.32.4: nanobind 3.0.1/3.1, internals key
``..._a1_v22``; checked after the build) and the ``mlx`` wheel (its headers, libmlx.so and
CMake config are used). It is never built on macOS. The build is optional: any failure
prints a warning and the package installs without it (``metalnn.cpu.fastmath`` then falls
back to MLX ops and ``unavailable_reason()`` says why).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
EXT_NAME = "metalnn.cpu._fastmath"


def _cmake_executable() -> str:
    exe = os.environ.get("CMAKE")
    if exe:
        return exe
    try:  # the `cmake` PyPI package
        import cmake  # noqa: PLC0415

        cand = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        if cand.exists():
            return str(cand)
    except Exception:
        pass
    exe = shutil.which("cmake")
    if exe:
        return exe
    raise RuntimeError("cmake not found (pip install cmake)")


def build(output_file: str | os.PathLike, build_temp: str | os.PathLike, *, verbose: bool = False) -> Path:
    """Configure and build the module so that it ends up exactly at ``output_file``."""
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"metalnn.cpu._fastmath is built on Linux only, not on {sys.platform}")
    output_file = Path(output_file).resolve()
    build_temp = Path(build_temp).resolve()
    build_temp.mkdir(parents=True, exist_ok=True)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    name = output_file.name
    if not name.endswith(".so"):
        raise RuntimeError(f"unexpected extension file name {name!r}")
    cmake = _cmake_executable()
    cfg = [
        cmake,
        "-S",
        str(HERE),
        "-B",
        str(build_temp),
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-DMETALNN_FASTMATH_OUTPUT_DIR={output_file.parent}",
        f"-DMETALNN_FASTMATH_OUTPUT_NAME={name[: -len('.so')]}",
    ]
    jobs = str(max(1, min(os.cpu_count() or 1, 8)))
    run = dict(check=True)
    if not verbose:
        run.update(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        subprocess.run(cfg, **run)
        subprocess.run([cmake, "--build", str(build_temp), "--config", "Release", "-j", jobs], **run)
    except subprocess.CalledProcessError as e:
        out = (e.stdout or "")[-4000:] if isinstance(e.stdout, str) else ""
        raise RuntimeError(f"{' '.join(map(str, e.cmd[:2]))} failed:\n{out}") from e
    if not output_file.exists():
        raise RuntimeError(f"build finished but {output_file} is missing")
    try:
        _check_nanobind_abi(output_file)
    except RuntimeError:
        output_file.unlink()
        raise
    return output_file


_NANOBIND_KEY = re.compile(rb"nanobind_[A-Za-z0-9_]+_a\d+_v\d+(?:_stable)?")


def _nanobind_key(path) -> bytes | None:
    m = _NANOBIND_KEY.search(Path(path).read_bytes())
    return m.group(0) if m else None


def _check_nanobind_abi(built: Path) -> None:
    """mx.array only crosses into the module when both use the same nanobind internals."""
    spec = importlib.util.find_spec("mlx.core")
    if spec is None or not spec.origin:
        return
    ours, theirs = _nanobind_key(built), _nanobind_key(spec.origin)
    if ours and theirs and ours != theirs:
        raise RuntimeError(
            f"the module was built with nanobind internals {ours.decode()}, but mlx.core uses "
            f"{theirs.decode()}: install the nanobind version pinned in metalnn's build requirements"
        )


class FastmathExtension(Extension):
    """Placeholder Extension: :class:`BuildExt` builds it with CMake."""

    def __init__(self, name: str = EXT_NAME):
        super().__init__(name, sources=[], optional=True)


class BuildExt(build_ext):
    """build_ext that builds :class:`FastmathExtension` with CMake (optionally)."""

    def build_extension(self, ext):
        if not isinstance(ext, FastmathExtension):
            return super().build_extension(ext)
        target = self.get_ext_fullpath(ext.name)
        temp = Path(self.build_temp) / "fastmath"
        try:
            build(target, temp, verbose=bool(self.verbose and self.verbose > 1))
        except Exception as e:  # optional: never fail the install because of it
            self.warn(
                f"metalnn: building the optional {ext.name} extension failed; "
                f"metalnn.cpu.fastmath will fall back to MLX ops.\n{e}"
            )


def _inplace_target() -> Path:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return HERE.parent.parent / ("_fastmath" + suffix)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build-dir", default=str(HERE.parents[3] / "build" / "fastmath"))
    p.add_argument("--output", default=str(_inplace_target()))
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args()
    print(build(a.output, a.build_dir, verbose=a.verbose))

"""The native extension's C++ builds for Linux aarch64 too (it is tested here only on x86_64).

The x86 kernels sit behind ``METALNN_FM_X86`` / ``METALNN_QMM_X86`` and are chosen at run time;
on aarch64 the portable C++ must stand in for every one of them. Each source of
``metalnn/cpu/native/fastmath`` is compiled for ``aarch64-linux-gnu`` with the clang of the
``ziglang`` wheel (the emulator's compiler), against the installed mlx and nanobind headers, with
the release build's language flags, and with ``-Werror=undefined-internal``: an x86-only function
that the portable path still calls would otherwise compile and fail only when the library is
loaded. Unoptimised (``-O0``): the check is that the code compiles and generates aarch64 code,
which takes two thirds of an optimised build's time (26 against 37 s for two of the sources).
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import mlx
import nanobind
import pytest

SOURCES = Path(__file__).resolve().parents[2] / "metalnn" / "cpu" / "native" / "fastmath"


def _mlx_include() -> Path:
    return Path(list(mlx.__path__)[0]) / "include"


@pytest.mark.slow
@pytest.mark.parametrize("source", sorted(p.name for p in SOURCES.glob("*.cpp")))
def test_native_source_compiles_for_aarch64(source, tmp_path):
    nb = Path(nanobind.include_dir())
    cmd = [sys.executable, "-m", "ziglang", "c++", "-target", "aarch64-linux-gnu", "-std=c++20", "-O0",
           "-fno-math-errno", "-fopenmp-simd", "-Werror=undefined-internal", "-Werror=implicit-function-declaration",
           '-DMETALNN_MLX_VERSION="test"', f"-I{nb}", f"-I{nb.parent / 'ext' / 'robin_map' / 'include'}",
           f"-I{_mlx_include()}", f"-I{sysconfig.get_paths()['include']}",
           "-c", str(SOURCES / source), "-o", str(tmp_path / (source + ".o"))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, f"{source} does not compile for aarch64:\n{done.stderr[-4000:]}"
    obj = (tmp_path / (source + ".o")).read_bytes()
    assert obj[:4] == b"\x7fELF" and int.from_bytes(obj[18:20], "little") == 183  # e_machine EM_AARCH64

"""Find clang, compile translated kernels into shared libraries, cache them on disk."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
CXXFLAGS = ["-std=c++17", "-O1", "-fPIC", "-w", "-fno-strict-aliasing", "-ffp-contract=off"]

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_compiler: list[str] | None = None


class CompilerNotFound(RuntimeError):
    pass


def cache_dir() -> Path:
    d = os.environ.get("METALNN_EMULATOR_CACHE")
    p = Path(d) if d else Path.home() / ".cache" / "metalnn" / "emulator"
    p.mkdir(parents=True, exist_ok=True)
    return p


def find_compiler() -> list[str]:
    """clang++ command: $METALNN_EMULATOR_CXX, the `ziglang` wheel, or clang++ on PATH.

    g++ cannot be used (no ext_vector_type swizzles, no __bf16 arithmetic).
    """
    global _compiler
    if _compiler is not None:
        return _compiler
    env = os.environ.get("METALNN_EMULATOR_CXX")
    if env:
        _compiler = env.split()
        return _compiler
    try:
        import ziglang  # noqa: F401

        _compiler = [sys.executable, "-m", "ziglang", "c++"]
        return _compiler
    except ImportError:
        pass
    for name in ("clang++", "clang++-19", "clang++-18", "clang++-17", "clang++-16", "clang++-15"):
        if shutil.which(name):
            _compiler = [name]
            return _compiler
    raise CompilerNotFound(
        "the Metal emulator needs clang: `pip install ziglang` (or install clang++ and/or set "
        "METALNN_EMULATOR_CXX)"
    )


def _run(cmd, what):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise CompileError(f"{what} failed:\n{r.stderr.strip() or r.stdout.strip()}")


class CompileError(RuntimeError):
    pass


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _support_hash() -> str:
    return _digest(
        *(f.read_text() for f in (HERE / "mtl_abi.h", HERE / "metal_stdlib.hpp", HERE / "runtime.cpp"))
    )


def _runtime_object(cc) -> Path:
    key = _digest(_support_hash(), " ".join(cc), " ".join(CXXFLAGS), "runtime")
    obj = cache_dir() / f"runtime-{key}.o"
    if not obj.exists():
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            out = Path(tmp) / "runtime.o"
            _run([*cc, *CXXFLAGS, "-c", str(HERE / "runtime.cpp"), "-I", str(HERE), "-o", str(out)],
                 "compiling the emulator runtime")
            os.replace(out, obj)
    return obj


def build(cpp_text: str) -> ctypes.CDLL:
    """Compile translated kernel text (cached by its hash) and load it."""
    cc = find_compiler()
    key = _digest(cpp_text, _support_hash(), " ".join(cc), " ".join(CXXFLAGS))
    with _lock:
        lib = _libs.get(key)
        if lib is not None:
            return lib
        so = cache_dir() / f"kernel-{key}.so"
        if not so.exists():
            rt = _runtime_object(cc)
            with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
                src = Path(tmp) / "kernel.cpp"
                src.write_text(cpp_text)
                out = Path(tmp) / "kernel.so"
                _run([*cc, *CXXFLAGS, "-shared", "-I", str(HERE), str(src), str(rt), "-o", str(out)],
                     "compiling the kernel")
                os.replace(out, so)
        lib = ctypes.CDLL(str(so))
        lib.mtl_launch.restype = ctypes.c_char_p
        lib.mtl_launch.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.c_int,
            ctypes.c_char_p,
        ]
        _libs[key] = lib
        return lib


launch_lock = threading.Lock()  # the runtime keeps global state: one launch at a time

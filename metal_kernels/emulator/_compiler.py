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
# Freestanding C++: kernels and runtime include no C++ standard library header and link none, so
# any clang works without a prebuilt libc++ (the `ziglang` wheel would otherwise build one on
# first use, about two minutes). `__truncsfbf2`, the one compiler-runtime helper the kernels can
# need, is defined in metal_stdlib.hpp.
CXXFLAGS = ["-std=c++17", "-O1", "-fPIC", "-w", "-fno-strict-aliasing", "-ffp-contract=off", "-nostdinc++"]
LDFLAGS = ["-shared", "-nostdlib++"]
SUPPORT_FILES = ("mtl_abi.h", "mtl_traits.h", "metal_stdlib.hpp", "runtime.cpp")

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_compiler: list[str] | None = None
_identity: str | None = None


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


def compiler_identity() -> str:
    """The compiler's command and its ``--version`` text (part of every cache key)."""
    global _identity
    if _identity is None:
        cc = find_compiler()
        try:
            r = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=120)
            version = (r.stdout or r.stderr).strip()
        except (OSError, subprocess.SubprocessError) as e:
            raise CompilerNotFound(f"the emulator's compiler {' '.join(cc)!r} does not run: {e}") from None
        if r.returncode != 0 or "clang" not in version:
            raise CompilerNotFound(
                f"the emulator's compiler {' '.join(cc)!r} is not a working clang (`--version` printed "
                f"{version[:200]!r}); install `ziglang` (the test extra pins a verified range) or set "
                "METALNN_EMULATOR_CXX to a clang++")
        _identity = f"{' '.join(cc)}\n{version}"
    return _identity


def _run(cmd, what):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise CompileError(f"{what} failed:\n{r.stderr.strip() or r.stdout.strip()}")


class CompileError(RuntimeError):
    pass


class LoadError(CompileError):
    """A compiled kernel library that the dynamic loader refused (e.g. an undefined symbol)."""


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _support_hash() -> str:
    return _digest(*((HERE / f).read_text() for f in SUPPORT_FILES))


def _runtime_object(cc) -> Path:
    key = _digest(_support_hash(), compiler_identity(), " ".join(CXXFLAGS), "runtime")
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
    key = _digest(cpp_text, _support_hash(), compiler_identity(), " ".join(CXXFLAGS), " ".join(LDFLAGS))
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
                _run([*cc, *CXXFLAGS, *LDFLAGS, "-I", str(HERE), str(src), str(rt), "-o", str(out)],
                     "compiling the kernel")
                os.replace(out, so)
        try:
            lib = ctypes.CDLL(str(so))
        except OSError as e:
            raise LoadError(f"the compiled kernel library could not be loaded ({_loader_problem(e)}); "
                            f"compiler: {compiler_identity().splitlines()[0]}") from None
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


def _loader_problem(e: OSError) -> str:
    text = str(e)
    i = text.find("undefined symbol:")
    return text[i:] if i >= 0 else text


launch_lock = threading.Lock()  # the runtime keeps global state: one launch at a time

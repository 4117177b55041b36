"""Find clang, check and compile translated kernels, cache the results on disk.

Every kernel variant goes through two clang runs, started together:

* the **check pass** (``-fsyntax-only -DMTL_CHECK``): Metal's address spaces and overload sets;
  its diagnostics are the kernel's compile errors. A success is cached as a marker file.
* the **run build**: the kernel with checked pointers, compiled to an object and linked with the
  runtime into a shared library (cached), loaded with ctypes.

The prelude (metal_stdlib.hpp) is precompiled once per mode (a clang PCH, cached), which keeps
both runs at a few tens of milliseconds of parsing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from . import _diagnostics

HERE = Path(__file__).resolve().parent
# Freestanding C++: kernels include no system or C++ library header and link no C++ library, so any
# clang works without a prebuilt libc++ (the `ziglang` wheel would otherwise build one on first use,
# about two minutes). `__truncsfbf2`, the one compiler-runtime helper the kernels can need, is
# defined in mtl_types.h. Half and bfloat arithmetic rounds at every operation, as on a GPU
# (clang would otherwise keep float precision inside an expression).
_LANG = ["-std=c++17", "-nostdinc", "-nostdinc++", "-fno-strict-aliasing", "-ffp-contract=off",
         "-Xclang", "-ffloat16-excess-precision=none", "-Xclang", "-fbfloat16-excess-precision=none"]
CXXFLAGS = [*_LANG, "-O1", "-fPIC", "-w"]
CHECKFLAGS = [*_LANG, "-DMTL_CHECK", "-flax-vector-conversions=none", "-fno-caret-diagnostics",
              "-fno-diagnostics-fixit-info", "-fno-color-diagnostics", "-ferror-limit=30",
              "-Wimplicit-float-conversion"]
RUNTIME_FLAGS = ["-std=c++17", "-O1", "-fPIC", "-w", "-nostdinc++"]
LDFLAGS = ["-shared", "-nostdlib++"]
SUPPORT_FILES = ("mtl_abi.h", "mtl_traits.h", "mtl_types.h", "mtl_core.h", "mtl_math.h", "mtl_sync.h",
                 "mtl_mlx.h", "metal_stdlib.hpp", "runtime.cpp")
PRELUDE_INCLUDE = '#include "metal_stdlib.hpp"\n'

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_toolchain: "Toolchain | None" = None
_identity: str | None = None


class CompilerNotFound(RuntimeError):
    pass


class CompileError(RuntimeError):
    pass


class CheckError(CompileError):
    """The check pass rejected the kernel; ``stderr`` holds clang's diagnostics."""

    def __init__(self, stderr: str):
        super().__init__(stderr)
        self.stderr = stderr


class LoadError(CompileError):
    """A compiled kernel library that the dynamic loader refused (e.g. an undefined symbol)."""


@dataclass(frozen=True)
class Toolchain:
    cc: tuple  # compiles the freestanding kernel text (and runs the check pass)
    cxx: tuple  # compiles the runtime (needs libc headers) and links


def cache_dir() -> Path:
    d = os.environ.get("METALNN_EMULATOR_CACHE")
    p = Path(d) if d else Path.home() / ".cache" / "metalnn" / "emulator"
    p.mkdir(parents=True, exist_ok=True)
    return p


def find_compiler() -> Toolchain:
    """clang commands: $METALNN_EMULATOR_CXX, the `ziglang` wheel, or clang++ on PATH.

    g++ cannot be used (no ext_vector_type swizzles, no __bf16 arithmetic, no address spaces).
    """
    global _toolchain
    if _toolchain is not None:
        return _toolchain
    env = os.environ.get("METALNN_EMULATOR_CXX")
    if env:
        _toolchain = Toolchain(tuple(env.split()), tuple(env.split()))
        return _toolchain
    try:
        import ziglang

        zig = Path(ziglang.__file__).resolve().parent / ("zig.exe" if os.name == "nt" else "zig")
        if zig.exists():
            # `zig clang` is clang itself (no zig cache layer): fast, and it honours -fsyntax-only
            _toolchain = Toolchain((str(zig), "clang"), (str(zig), "c++"))
        else:
            _toolchain = Toolchain((sys.executable, "-m", "ziglang", "clang"), (sys.executable, "-m", "ziglang", "c++"))
        return _toolchain
    except ImportError:
        pass
    for name in ("clang++", "clang++-19", "clang++-18", "clang++-17", "clang++-16"):
        if shutil.which(name):
            _toolchain = Toolchain((name,), (name,))
            return _toolchain
    raise CompilerNotFound(
        "the Metal emulator needs clang: `pip install ziglang` (or install clang++ and/or set "
        "METALNN_EMULATOR_CXX)"
    )


def compiler_identity() -> str:
    """The compiler's command and its ``--version`` text (part of every cache key)."""
    global _identity
    if _identity is None:
        tc = find_compiler()
        try:
            r = subprocess.run([*tc.cc, "--version"], capture_output=True, text=True, timeout=120)
            version = (r.stdout or r.stderr).strip()
        except (OSError, subprocess.SubprocessError) as e:
            raise CompilerNotFound(f"the emulator's compiler {' '.join(tc.cc)!r} does not run: {e}") from None
        if r.returncode != 0 or "clang" not in version:
            raise CompilerNotFound(
                f"the emulator's compiler {' '.join(tc.cc)!r} is not a working clang (`--version` printed "
                f"{version[:200]!r}); install `ziglang` (the test extra pins a verified range) or set "
                "METALNN_EMULATOR_CXX to a clang++")
        _identity = f"{' '.join(tc.cc)}\n{' '.join(tc.cxx)}\n{version}"
    return _identity


def _run(cmd, what):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise CompileError(f"{what} failed:\n{_clean(r.stderr) or r.stdout.strip()}")


# warnings of the check pass that are errors for Metal: implicit conversions to bfloat (MSL §2.1:
# neither float nor half converts implicitly to bfloat)
_METAL_ERRORS_AS_WARNINGS = re.compile(r"warning: implicit conversion [^\n]*to 'bfloat'")


def _clean(stderr: str) -> str:
    """clang's stderr without the driver's notes about unused arguments."""
    return "\n".join(line for line in stderr.strip().splitlines()
                     if "argument unused during compilation" not in line)


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


_support: str | None = None


def _support_hash() -> str:
    global _support
    if _support is None:
        _support = _digest(*((HERE / f).read_text() for f in SUPPORT_FILES))
    return _support


def _atomic_build(path: Path, make) -> Path:
    """Create ``path`` with ``make(tmp_path)`` unless it exists (safe against concurrent builders)."""
    if not path.exists():
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            out = Path(tmp) / path.name
            make(out)
            os.replace(out, path)
    return path


def _pch(flags, mode: str) -> Path:
    tc = find_compiler()
    key = _digest(_support_hash(), compiler_identity(), " ".join(flags), mode, str(HERE))
    return _atomic_build(cache_dir() / f"prelude-{mode}-{key}.pch", lambda out: _run(
        [*tc.cc, *[f for f in flags if f != "-fsyntax-only"], "-x", "c++-header", str(HERE / "metal_stdlib.hpp"),
         "-I", str(HERE), "-o", str(out)], f"precompiling the emulator prelude ({mode})"))


def _runtime_object() -> Path:
    tc = find_compiler()
    key = _digest(_support_hash(), compiler_identity(), " ".join(RUNTIME_FLAGS), "runtime")
    return _atomic_build(cache_dir() / f"runtime-{key}.o", lambda out: _run(
        [*tc.cxx, *RUNTIME_FLAGS, "-c", str(HERE / "runtime.cpp"), "-I", str(HERE), "-o", str(out)],
        "compiling the emulator runtime"))


def _body(text: str) -> str:
    """Kernel text for a compile with the precompiled prelude (its #include line removed)."""
    return text[len(PRELUDE_INCLUDE):] if text.startswith(PRELUDE_INCLUDE) else text


def build(run_text: str, check_text: str | None = None) -> ctypes.CDLL:
    """Check (``check_text``, the MTL_CHECK translation) and compile ``run_text``; both cached by hash.

    Raises CheckError with clang's diagnostics when the check pass rejects the kernel.
    """
    tc = find_compiler()
    ident = compiler_identity()
    key = _digest(run_text, _support_hash(), ident, " ".join(CXXFLAGS), " ".join(LDFLAGS))
    check_key = None if check_text is None else _digest(check_text, _support_hash(), ident, " ".join(CHECKFLAGS),
                                                        _METAL_ERRORS_AS_WARNINGS.pattern,
                                                        _diagnostics._IMPLICIT_MEMBER.pattern)
    with _lock:
        lib = _libs.get(key)
        marker = None if check_key is None else cache_dir() / f"check-{check_key}.ok"
        checked = marker is None or marker.exists()
        if lib is not None and checked:
            return lib
        so = cache_dir() / f"kernel-{key}.so"
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            procs = {}
            if not checked:
                src = Path(tmp) / "check.cpp"
                src.write_text(_body(check_text))
                procs["check"] = subprocess.Popen(
                    [*tc.cc, *CHECKFLAGS, "-fsyntax-only", "-include-pch", str(_pch(CHECKFLAGS, "check")),
                     "-I", str(HERE), str(src)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if not so.exists():
                src = Path(tmp) / "kernel.cpp"
                src.write_text(_body(run_text))
                obj = Path(tmp) / "kernel.o"
                procs["run"] = subprocess.Popen(
                    [*tc.cc, *CXXFLAGS, "-c", "-include-pch", str(_pch(CXXFLAGS, "run")), "-I", str(HERE),
                     str(src), "-o", str(obj)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            results = {name: (p.wait(), p.communicate()) for name, p in procs.items()}
            if "check" in results:
                rc, (_, err) = results["check"]
                if (rc != 0 and _diagnostics.kernel_errors(err)) or _METAL_ERRORS_AS_WARNINGS.search(err):
                    raise CheckError(_clean(err))
                marker.touch()
            if "run" in results:
                rc, (_, err) = results["run"]
                if rc != 0:
                    raise CompileError(f"compiling the kernel failed:\n{_clean(err)}")
                out = Path(tmp) / "kernel.so"
                _run([*tc.cxx, *LDFLAGS, str(obj), str(_runtime_object()), "-o", str(out)], "linking the kernel")
                os.replace(out, so)
        lib = _libs.get(key)
        if lib is not None:
            return lib
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
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_int,
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

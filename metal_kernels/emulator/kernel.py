"""`metal_kernel`: a CPU stand-in for `mx.fast.metal_kernel` that runs the same text."""

from __future__ import annotations

import ctypes
import re

import numpy as np

from . import _compiler, _diagnostics, _signature, _translate
from .lint import lint as _lint


class EmulatorError(RuntimeError):
    """A kernel could not be built, or a check failed while it ran."""


# canonical dtype name -> (Metal type string, numpy storage dtype)
_TYPES = {
    "float32": ("float", np.float32),
    "float16": ("float16_t", np.float16),
    "bfloat16": ("bfloat16_t", np.uint16),  # stored as raw bf16 bits
    "int8": ("int8_t", np.int8),
    "int16": ("int16_t", np.int16),
    "int32": ("int32_t", np.int32),
    "int64": ("int64_t", np.int64),
    "uint8": ("uint8_t", np.uint8),
    "uint16": ("uint16_t", np.uint16),
    "uint32": ("uint32_t", np.uint32),
    "uint64": ("uint64_t", np.uint64),
    "bool": ("bool", np.bool_),
    "float64": ("double", np.float64),
    "complex64": ("complex64_t", np.complex64),
}
_LANE_ORDERS = {"forward": 0, "reversed": 1, "shuffled": 2}
_MATH_MODES = ("safe", "relaxed", "fast")
MAX_THREADS_PER_THREADGROUP = 1024
_POISON_INT = {1: 0xEF, 2: 0xBEEF, 4: 0xDEADBEEF, 8: 0xDEADBEEFDEADBEEF}


def _dtype_name(d) -> str:
    """Canonical name of an mx.Dtype, numpy dtype/type or string."""
    if isinstance(d, str):
        name = d
    elif type(d).__name__ == "Dtype":  # mx.Dtype
        name = str(d).split(".")[-1]
    else:
        name = np.dtype(d).name
    if name not in _TYPES:
        raise EmulatorError(f"unsupported dtype {d!r}")
    return name


def _type_string(d) -> str:
    return _TYPES[_dtype_name(d)][0]


def float32_to_bf16_bits(a) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest even); return the uint16 bit patterns."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    out[np.isnan(a)] = 0x7FC0  # every NaN becomes the quiet NaN 0x7FC0, as MLX converts
    return out


def bf16_bits_to_float32(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def as_mx(out, dtype):
    """Convert an emulator output (numpy; float32 for bfloat16) to an mx.array of `dtype`."""
    import mlx.core as mx

    return mx.array(out).astype(dtype)


def _as_input(x):
    """-> (numpy array in storage dtype, canonical dtype name)."""
    if isinstance(x, (bool, np.bool_)):
        return np.array(bool(x), dtype=np.bool_), "bool"
    if isinstance(x, int):
        return np.array(x, dtype=np.int32), "int32"
    if isinstance(x, float):
        return np.array(x, dtype=np.float32), "float32"
    if type(x).__module__.startswith("mlx"):
        import mlx.core as mx

        # a view of the array's own buffer: strides (and the offset of a sliced array) as MLX passes
        # them, no copy unless ensure_row_contiguous asks for one
        name = _dtype_name(x.dtype)
        if name == "bfloat16":
            return np.asarray(mx.view(x, mx.uint16)), name
        return np.asarray(x), name
    a = np.asarray(x)
    return a, _dtype_name(a.dtype)


def _check_compile_options(options) -> dict:
    """MLX's validation of ``compile_options`` (the math mode has no effect on the emulator)."""
    if options is None:
        return {"math_mode": "safe"}
    if not isinstance(options, dict):
        raise EmulatorError("[metal_kernel] Expected `compile_options` to be a dict.")
    for key, value in options.items():
        if key != "math_mode":
            raise EmulatorError(f"[metal_kernel] Unknown compile option `{key}`.")
        if value not in _MATH_MODES:
            raise EmulatorError("[metal_kernel] Expected math_mode to be 'safe', 'relaxed', or 'fast'.")
    return {"math_mode": "safe", **options}


class MetalKernel:
    """Callable like the object `mx.fast.metal_kernel` returns; runs on the CPU."""

    def __init__(self, name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False, compile_options=None, lint=True):
        if not output_names:
            raise EmulatorError("[metal_kernel] Must specify at least one output.")
        try:
            _signature.check_mlx_version()
        except RuntimeError as e:
            raise EmulatorError(f"kernel '{name}': {e}") from None
        self.compile_options = _check_compile_options(compile_options)
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        if lint:
            problems = _lint(source, header)
            if problems:
                raise EmulatorError(
                    f"kernel '{name}': Metal would reject this text:\n  " + "\n  ".join(problems)
                )
        self._shape_infos = _signature.shape_infos(self.input_names, source)
        self._attrs = _signature.attributes(source)

    # ------------------------------------------------------------ source text
    def _signature(self, infos, output_dtypes, template):
        template = list(template or [])
        out_types = [_type_string(d) for d in output_dtypes]
        fname = _signature.kernel_name(self.name, template, infos, out_types, _type_string)
        text, params = _signature.write_signature(
            fname, self.header, self.source, self.input_names, infos, self.output_names,
            out_types, template, self._attrs, self._shape_infos, self.atomic_outputs)
        targs = ""
        if template:
            text += _signature.instantiation(fname, template, _type_string)
            targs = _signature.template_def(template, _type_string)
        return fname, text, params, targs

    @staticmethod
    def _infos(inputs):
        infos = []
        for x in inputs:
            a, name = _as_input(x)
            infos.append(_signature.ArgInfo(_TYPES[name][0], int(a.size), int(a.ndim)))
        return infos

    def generated_source(self, inputs, output_dtypes, template=None) -> str:
        """The kernel text MLX 0.32 would generate for these arguments."""
        return self._signature(self._infos(inputs), output_dtypes, template)[1]

    def translated_source(self, inputs, output_dtypes, template=None, mode="run") -> str:
        """The C++ the emulator compiles for these arguments (``mode="check"``: the check pass's)."""
        fname, text, params, targs = self._signature(self._infos(inputs), output_dtypes, template)
        return self._cpp(fname, text, params, targs, mode)

    def _cpp(self, fname, text, params, targs, mode="run"):
        start = len(self.header) if text.startswith(self.header) else 0
        # the Metal compiler defines __FAST_MATH__ in the "fast" math mode (the only visible effect of
        # the math mode here: the emulator's functions are the precise ones in every mode)
        fast = "#define __FAST_MATH__ 1\n" if self.compile_options["math_mode"] == "fast" else ""
        cpp = (_compiler.PRELUDE_INCLUDE + fast + f'#line 1 "{self._file}"\n'
               + _translate.translate(text, mode, kernel_start=start,
                                      stores=() if self.atomic_outputs else self.output_names))
        return cpp + _translate.launcher(fname, targs, params) if mode == "run" else cpp

    @property
    def _file(self) -> str:
        return f"{self.name}.metal"

    # ------------------------------------------------------------ running
    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
                 init_value=None, verbose=False, stream=None, lane_order="forward", seed=0,
                 check_races=True, strict_simd=False):
        del stream
        # MLX's order: argument sizes, then the build (compile errors), then the threadgroup size
        if len(inputs) != len(self.input_names):
            raise EmulatorError(f"[metal_kernel] Expected `inputs` to have size "
                                f"{len(self.input_names)} but got size {len(inputs)}.")
        if len(output_shapes) != len(self.output_names):
            raise EmulatorError(f"[metal_kernel] Expected `output_shapes` to have size "
                                f"{len(self.output_names)} but got size {len(output_shapes)}.")
        if len(output_dtypes) != len(self.output_names):
            raise EmulatorError(f"[metal_kernel] Expected `output_dtypes` to have size "
                                f"{len(self.output_names)} but got size {len(output_dtypes)}.")
        if lane_order not in _LANE_ORDERS:
            raise EmulatorError(f"lane_order must be one of {sorted(_LANE_ORDERS)}")
        grid = tuple(int(g) for g in grid)
        tg = tuple(int(t) for t in threadgroup)
        if len(grid) != 3 or len(tg) != 3:
            raise EmulatorError("grid and threadgroup must have 3 entries")

        arrays, names = [], []
        for iname, x in zip(self.input_names, inputs):
            a, n = _as_input(x)
            if n == "float64":
                raise EmulatorError(f"kernel '{self.name}': input '{iname}' is float64; Metal has no double")
            if self.ensure_row_contiguous and not a.flags.c_contiguous:
                a = np.ascontiguousarray(a)  # MLX copies inputs that are not row-contiguous
            arrays.append(a)
            names.append(n)
        out_names = [_dtype_name(d) for d in output_dtypes]
        for oname, n in zip(self.output_names, out_names):
            if n == "float64":
                raise EmulatorError(f"kernel '{self.name}': output '{oname}' is float64; Metal has no double")
        infos = [_signature.ArgInfo(_TYPES[n][0], int(a.size), int(a.ndim))
                 for a, n in zip(arrays, names)]
        fname, text, params, targs = self._signature(infos, output_dtypes, template)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{text}\n```")
        lib = self._build(fname, text, params, targs)

        n_threads = tg[0] * tg[1] * tg[2]
        if n_threads > MAX_THREADS_PER_THREADGROUP:
            raise EmulatorError(
                f"kernel '{self.name}': [metal_kernel] Thread group size ({n_threads}) is greater than the "
                f"maximum allowed threads per threadgroup ({MAX_THREADS_PER_THREADGROUP}).")
        if min(tg) < 1:
            raise EmulatorError(f"kernel '{self.name}': threadgroup {tg} has a dimension below 1")

        outs = []
        for shape, n in zip(output_shapes, out_names):
            store = _TYPES[n][1]
            o = np.empty(tuple(int(s) for s in shape), dtype=store)
            if init_value is not None:
                if n == "bfloat16":
                    o[...] = float32_to_bf16_bits(np.float32(init_value))
                else:
                    o[...] = np.array(init_value).astype(store)
            elif n in ("float32", "float16", "complex64"):
                o[...] = np.nan
            elif n == "bfloat16":
                o[...] = 0x7FC1
            elif n == "bool":
                o[...] = False
            else:
                o.view(f"u{o.itemsize}")[...] = _POISON_INT[o.itemsize]
            outs.append(o)

        keep = []  # keep every buffer alive during the launch
        ptrs, los, his, out_elem, buf_names = [], [], [], [], []

        def add(arr, elem=0, name=""):
            keep.append(arr)
            out_elem.append(elem)
            buf_names.append(name)
            p = arr.ctypes.data
            if arr.flags.c_contiguous or arr.size == 0:
                lo, hi = p, p + arr.nbytes
            else:
                lo, hi = np.lib.array_utils.byte_bounds(arr)
            ptrs.append(p)
            los.append(lo)
            his.append(hi)

        for p in params:
            if p.kind == "attr":
                continue
            what, i = p.source
            a = arrays[i] if what != "output" else outs[i]
            if what == "output":
                add(a, a.itemsize, p.name)
            elif what == "input":
                add(a)
            elif what == "shape":
                add(np.array(a.shape, dtype=np.int32))
            elif what == "strides":
                add(np.array([s // a.itemsize for s in a.strides], dtype=np.int64))
            elif what == "ndim":
                add(np.array(a.ndim, dtype=np.int32))

        before = [a.copy() for a in arrays]  # inputs are const: a kernel must not change them
        n = len(ptrs)
        P = ctypes.c_void_p * max(n, 1)
        I = ctypes.c_int * max(n, 1)
        U3 = ctypes.c_uint32 * 3
        with _compiler.launch_lock:
            err = lib.mtl_launch(P(*ptrs), P(*los), P(*his), I(*out_elem), n, U3(*grid), U3(*tg),
                                 _LANE_ORDERS[lane_order], int(seed) & (2**64 - 1),
                                 (1 if check_races else 0) | (2 if strict_simd else 0),
                                 self.name.encode())
        if err is not None:
            msg = re.sub(r"output buffer (\d+)", lambda m: f"output '{buf_names[int(m.group(1))]}'",
                         err.decode(errors="replace"))
            raise EmulatorError(msg)
        for iname, a, b in zip(self.input_names, arrays, before):
            if not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
                if a.flags.writeable:
                    np.copyto(a, b)
                raise EmulatorError(
                    f"kernel '{self.name}': the kernel wrote to its input '{iname}' (MLX declares inputs "
                    "`const`; writing through a pointer cast to non-const changes the caller's array)")
        return [bf16_bits_to_float32(o) if n == "bfloat16" else o for o, n in zip(outs, out_names)]

    def _build(self, fname, text, params, targs):
        """Check the text as Metal would, then compile it (both cached)."""
        run_cpp = self._cpp(fname, text, params, targs, "run")
        check_cpp = self._cpp(fname, text, params, targs, "check")
        try:
            return _compiler.build(run_cpp, check_cpp)
        except _compiler.CheckError as e:
            raise EmulatorError(
                f"kernel '{self.name}': the Metal compiler would reject the generated source (lines of "
                f"`generated_source(...)`):\n" + _diagnostics.metal_messages(e.stderr, self._file, text)) from None
        except (_compiler.CompileError, _compiler.CompilerNotFound) as e:
            raise EmulatorError(f"kernel '{self.name}': {e}") from None


def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None, lint=True) -> MetalKernel:
    """Same arguments as `mx.fast.metal_kernel`; `lint=False` skips the Metal lint."""
    return MetalKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                       atomic_outputs, compile_options, lint)

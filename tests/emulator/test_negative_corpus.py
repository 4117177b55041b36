"""The negative corpus: minimal kernels that the Metal compiler rejects (or that would misbehave on a
GPU), each with the error the emulator must raise. Every error names the kernel and a line."""

import re

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels.emulator import EmulatorError, metal_kernel

SMALL = np.arange(4, dtype=np.float32)   # fewer than 8 elements: MLX passes it as `const constant float*`
LARGE = np.arange(64, dtype=np.float32)  # `const device float*`

# name -> (header, body, inputs, expected error (regex), extra keyword arguments of the call)
COMPILE_ERRORS = {
    # ---- address spaces (MSL §4)
    "constant_to_device_local": (
        "", "const device float* p = x;\nout[0] = p[0];", [SMALL],
        r"cannot initialize a variable of type 'const device float \*' with an lvalue of type "
        r"'const constant float \*'", {}),
    "constant_to_device_helper": (
        "inline float first(const device float* p) { return p[0]; }\n", "out[0] = first(x);", [SMALL],
        r"no matching function for call to 'first'.*cannot pass pointer to address space 'constant' as a "
        r"pointer to address space 'device'", {}),
    "device_to_thread": (
        "", "float* p = out;\np[0] = x[0];", [LARGE],
        r"cannot initialize a variable of type 'float \*' with an lvalue of type 'device float \*'", {}),
    "threadgroup_to_device": (
        "", "threadgroup float t[32];\nt[0] = x[0];\ndevice float* p = t;\nout[0] = p[0];", [LARGE],
        r"cannot initialize a variable of type 'device float \*' with an lvalue of type 'threadgroup float\[32\]'",
        {}),
    "c_style_cast_between_spaces": (
        "", "const device float* p = (const device float*)x;\nout[0] = p[0];", [SMALL],
        r"C-style cast from .* to 'const device float \*' converts between mismatching address spaces", {}),
    "reinterpret_cast_between_spaces": (
        "", "const device float4* p = reinterpret_cast<const device float4*>(x);\nout[0] = p[0].x;", [SMALL],
        r"reinterpret_cast from 'const constant float \*' to 'const device float4 \*' is not allowed", {}),
    "write_to_const_input": (
        "", "x[0] = 1.0f;\nout[0] = x[0];", [LARGE], r"read-only variable is not assignable", {}),
    "threadgroup_variable_in_helper": (
        "inline float keep(float v) {\n  threadgroup float t[4];\n  t[0] = v;\n  return t[0];\n}\n",
        "out[0] = keep(x[0]);", [LARGE],
        r"threadgroup variables can only be declared in the body of a kernel function", {}),
    "simdgroup_load_from_thread_memory": (
        "", "float local[64];\nsimdgroup_float8x8 m;\nsimdgroup_load(m, local, 8);\nsimdgroup_store(m, out, 8);",
        [LARGE], r"no matching function for call to 'simdgroup_load'", {}),
    "simdgroup_load_element_type": (
        "", "threadgroup half t[64];\nt[thread_index_in_simdgroup] = 0;\n"
        "threadgroup_barrier(mem_flags::mem_threadgroup);\nsimdgroup_float8x8 m;\nsimdgroup_load(m, t, 8);\n"
        "simdgroup_store(m, out, 8);", [LARGE],
        r"no matching function for call to 'simdgroup_load'.*conflicting types for parameter 'T' \('float' vs\. "
        r"'half'\)", {}),
    # ---- MSL's overload sets (§6.2, §6.3, §6.5)
    "exp_of_int": (
        "", "int i = int(x[0]);\nout[0] = metal::exp(i);", [LARGE], r"no matching function for call to 'exp'", {}),
    "max_int_float": (
        "", "int i = 2;\nout[0] = max(i, x[0]);", [LARGE],
        r"no matching function for call to 'max'.*conflicting types for parameter '\w+' \('int' vs\. 'float'\)", {}),
    "max_float_int_literal": (
        "", "out[0] = max(x[0], 0);", [LARGE], r"no matching function for call to 'max'", {}),
    "min_uint_int": (
        "", "uint u = 3;\nint i = 2;\nout[0] = float(min(u, i));", [LARGE],
        r"no matching function for call to 'min'", {}),
    "pow_float_int": ("", "out[0] = pow(x[0], 2);", [LARGE], r"no matching function for call to 'pow'", {}),
    "clamp_float_ints": ("", "out[0] = clamp(x[0], 0, 1);", [LARGE], r"no matching function for call to 'clamp'", {}),
    "mix_float_int": ("", "out[0] = mix(x[0], x[1], 1);", [LARGE], r"no matching function for call to 'mix'", {}),
    "fma_float_int": ("", "out[0] = fma(x[0], x[1], 1);", [LARGE], r"no matching function for call to 'fma'", {}),
    "log1p_in_metal_namespace": (
        "", "out[0] = metal::log1p(x[0]);", [LARGE], r"no (member named 'log1p' in namespace|.*log1p)", {}),
    "implicit_float_to_bfloat": (
        "", "bfloat b = x[0] * 2.0f;\nout[0] = float(b);", [LARGE],
        r"implicit conversion from 'float' to 'bfloat' is not allowed", {}),
    "barrier_without_flags": (
        "", "threadgroup_barrier();\nout[0] = x[0];", [LARGE],
        r"no matching function for call to 'threadgroup_barrier'", {}),
    # ---- atomics (§6.15)
    "atomic_half_output": (
        "", "atomic_fetch_add_explicit(&out[0], half(1), memory_order_relaxed);", [LARGE],
        r"atomic<half>.*Metal's atomic types are atomic_int, atomic_uint, atomic_bool, atomic_float",
        {"dtype": mx.float16, "atomic": True}),
    "atomic_and_on_float": (
        "", "atomic_fetch_and_explicit(&out[0], 1.0f, memory_order_relaxed);", [LARGE],
        r"no matching function for call to 'atomic_fetch_and_explicit'", {"atomic": True}),
    "atomic_without_memory_order": (
        "", "atomic_fetch_add_explicit(&out[0], 1.0f);", [LARGE],
        r"no matching function for call to 'atomic_fetch_add_explicit'", {"atomic": True}),
}

# refused by the lint when the kernel is constructed (what clang accepts but Metal does not)
LINT_ERRORS = {
    "static_local": ("", "static float calls = 0;\ncalls += 1;\nout[0] = calls;",
                     r"source line 1: static local variable `calls` must reside in the constant address space"),
    "program_scope_mutable": ("float counter = 0;\n", "out[0] = counter;",
                              r"header line 1: program scope variable `counter` must reside in the constant"),
    "program_scope_threadgroup": ("threadgroup float shared[4];\n", "out[0] = shared[0];",
                                  r"header line 1: program scope variable `shared` must reside in the constant"),
    "virtual_function": ("struct Op {\n  virtual float apply(float v) { return v; }\n};\n", "out[0] = 1;",
                         r"header line 2: virtual functions are not supported by Metal"),
    "recursion": ("inline int fact(int n) { return n <= 1 ? 1 : n * fact(n - 1); }\n", "out[0] = fact(3);",
                  r"header line 1: function `fact` calls itself; Metal does not support recursion"),
    "mutual_recursion": ("inline int even(int n);\ninline int odd(int n) { return n == 0 ? 0 : even(n - 1); }\n"
                         "inline int even(int n) { return n == 0 ? 1 : odd(n - 1); }\n", "out[0] = even(4);",
                         r"header line 2: function `odd` calls itself \(through even\)"),
    "double": ("", "double d = x[0];\nout[0] = d;", r"source line 1: `double` is not supported by Metal"),
}


def _launch(name, header, body, inputs, dtype=mx.float32, atomic=False, **kw):
    k = metal_kernel(name, ["x"], ["out"], body, header, atomic_outputs=atomic, **kw)
    return k(inputs=inputs, output_shapes=[(64,)], output_dtypes=[dtype], grid=(32, 1, 1), threadgroup=(32, 1, 1),
             init_value=0 if atomic else None)


@pytest.mark.parametrize("name", sorted(COMPILE_ERRORS))
def test_compile_error(name):
    header, body, inputs, expected, kw = COMPILE_ERRORS[name]
    with pytest.raises(EmulatorError) as e:
        _launch(name, header, body, inputs, **kw)
    msg = str(e.value)
    assert f"kernel '{name}'" in msg and "the Metal compiler would reject" in msg, msg
    assert re.search(rf"{name}\.metal:\d+:\d+: error:", msg), msg
    assert re.search(expected, msg, re.S), msg


@pytest.mark.parametrize("name", sorted(LINT_ERRORS))
def test_lint_error(name):
    header, body, expected = LINT_ERRORS[name]
    with pytest.raises(EmulatorError) as e:
        metal_kernel(name, ["x"], ["out"], body, header)
    msg = str(e.value)
    assert f"kernel '{name}'" in msg and "Metal would reject" in msg, msg
    assert re.search(expected, msg), msg


def test_compile_error_points_at_the_generated_line():
    # the message quotes the line of the generated Metal text it names
    k = metal_kernel("where", ["x"], ["out"], "uint i = thread_position_in_grid.x;\nconst device float* p = x;\n"
                     "out[i] = p[i];")
    text = k.generated_source([SMALL], [mx.float32])
    line = next(n for n, t in enumerate(text.splitlines(), 1) if "const device float* p" in t)
    with pytest.raises(EmulatorError, match=rf"where\.metal:{line}:\d+: error:.*\n\s+{line} \| const device float\* p"):
        k(inputs=[SMALL], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(4, 1, 1), threadgroup=(4, 1, 1))


def test_the_same_kernel_passes_with_8_elements_and_fails_with_7():
    # MLX's rule: an input of fewer than 8 elements is `const constant T*`
    k = metal_kernel("sizes", ["x"], ["out"], "uint i = thread_position_in_grid.x;\nconst device float* p = x;\n"
                     "out[i] = p[i] * 2.0f;")
    for n, ok in ((8, True), (7, False), (1, False)):
        x = np.arange(n, dtype=np.float32)

        def call():
            return k(inputs=[x], output_shapes=[(n,)], output_dtypes=[mx.float32], grid=(n, 1, 1),
                     threadgroup=(n, 1, 1))[0]

        if ok:
            np.testing.assert_array_equal(call(), 2 * x)
        else:
            with pytest.raises(EmulatorError, match="'const constant float \\*'"):
                call()


def test_writing_an_input_through_a_cast_is_reported_and_undone():
    k = metal_kernel("cast_away", ["x"], ["out"], "device float* w = (device float*)x;\n"
                     "w[thread_position_in_grid.x] = 0.0f;\nout[thread_position_in_grid.x] = 1.0f;")
    x = LARGE.copy()
    with pytest.raises(EmulatorError, match=r"kernel 'cast_away': the kernel wrote to its input 'x'"):
        k(inputs=[x], output_shapes=[(64,)], output_dtypes=[mx.float32], grid=(64, 1, 1), threadgroup=(32, 1, 1))
    np.testing.assert_array_equal(x, LARGE)  # the caller's array is restored

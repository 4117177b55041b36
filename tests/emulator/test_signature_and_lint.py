"""Generated text (against what MLX 0.32 writes) and the Metal lint. No compiler needed."""

import re

import mlx.core as mx
import numpy as np
import pytest

from metal_kernels.emulator import EmulatorError, lint, metal_kernel

BODY = """
    uint i = thread_position_in_grid.x;
    out[i] = a[i] * s + c[i % 4] + a_shape[0] + thread_index_in_simdgroup;
"""


def test_signature_buffer_order_and_address_spaces():
    k = metal_kernel("sig", ["a", "s", "c"], ["out"], BODY)
    a = np.zeros((4, 4), np.float32)  # 16 elements -> device
    c = np.zeros(4, np.float32)  # < 8 elements -> constant
    text = k.generated_source([a, 2.0, c], [mx.float32])
    assert text.splitlines() == [
        "[[kernel]] void custom_kernel_sig_float_floats_floatc_float(",
        "  const device float* a [[buffer(0)]],",
        "  const constant int* a_shape [[buffer(1)]],",
        "  const constant float& s [[buffer(2)]],",
        "  const constant float* c [[buffer(3)]],",
        "  device float* out [[buffer(4)]],",
        "  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]],",
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {",
        "",
        "    uint i = thread_position_in_grid.x;",
        "    out[i] = a[i] * s + c[i % 4] + a_shape[0] + thread_index_in_simdgroup;",
        "",
        "}",
    ]


def test_signature_strides_ndim_int_scalar_and_atomic_outputs():
    body = "uint i = thread_position_in_grid.x; x_strides[0]; x_ndim; atomic_fetch_add_explicit(&o[i], n, memory_order_relaxed);"
    k = metal_kernel("at", ["x", "n"], ["o"], body, header="// hdr\n", atomic_outputs=True)
    text = k.generated_source([np.zeros(10, np.int32), 3], [mx.int32])
    assert text.startswith("// hdr\n[[kernel]] void custom_kernel_at_int32_t_int32_ts_int32_t(\n")
    assert "  const device int32_t* x [[buffer(0)]],\n" in text
    assert "  const constant int64_t* x_strides [[buffer(1)]],\n" in text
    assert "  const constant int& x_ndim [[buffer(2)]],\n" in text
    assert "  const constant int32_t& n [[buffer(3)]],\n" in text
    assert "  device atomic<int32_t>* o [[buffer(4)]],\n" in text
    assert "x_shape" not in text.split(") {")[0]


def test_signature_templates():
    k = metal_kernel("t", ["a"], ["o"], "o[0] = a[0];")
    text = k.generated_source([np.zeros(8, np.float16)], [mx.bfloat16],
                              template=[("T", mx.float16), ("N", 4), ("B", True)])
    name = "custom_kernel_t__float16_t_4_1_float16_t_bfloat16_t"
    assert text.startswith(f"template <typename T, int N, bool B>\n[[kernel]] void {name}(\n")
    assert "  device bfloat16_t* o [[buffer(1)]]) {\n" in text
    assert text.endswith(
        f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({name}<float16_t, 4, 1>) '
        f"{name}<float16_t, 4, 1>;\n"
    )


def test_attribute_substring_quirk():
    k = metal_kernel("q", ["a"], ["o"], "o[0] = a[0] + dispatch_threads_per_threadgroup.x;")
    text = k.generated_source([np.zeros(8, np.float32)], [mx.float32])
    # `threads_per_threadgroup` is a substring of `dispatch_threads_per_threadgroup`
    assert "uint3 dispatch_threads_per_threadgroup [[dispatch_threads_per_threadgroup]]," in text
    assert "uint3 threads_per_threadgroup [[threads_per_threadgroup]]) {" in text


@pytest.mark.parametrize(
    "src,needle",
    [
        ("double x = 1.0; out[0] = x;", "double"),
        ("out[0] = std::max(1.0f, 2.0f);", "std::"),
        ("try { out[0] = 1; } catch (...) {}", "exceptions"),
        ("throw 1;", "exceptions"),
        ("float* p = new float[4];", "new"),
        ("delete p;", "delete"),
        ("float* p = (float*)malloc(16);", "malloc"),
        ('printf("%d", 1);', "printf"),
        ("again: goto again;", "goto"),
        ("auto f = [&](int i) { return out[i]; };", "capturing by reference"),
        ("auto f = [x, &y](int i) { return y; };", "capturing by reference"),
    ],
)
def test_lint_rejects(src, needle):
    problems = lint(src)
    assert problems and any(needle in p for p in problems), problems
    with pytest.raises(EmulatorError, match="Metal would reject"):
        metal_kernel("bad", ["a"], ["out"], src)


def test_lint_recursion_in_header():
    header = "int fact(int n) {\n  return n <= 1 ? 1 : n * fact(n - 1);\n}\n"
    problems = lint("out[0] = fact(3);", header)
    assert any("fact" in p and "recursion" in p for p in problems), problems


def test_lint_accepts_clean_metal():
    src = """
    // comments may say double, std::vector, new or goto
    const char* s = "printf";
    float x = metal::max(a[0], 0.0f);
    auto f = [=](float v) { return v * 2; };
    out[0] = f(x) + renew + new_value;
    """
    header = "inline float twice(float v) { return 2 * v; }\ninline float four(float v) { return twice(twice(v)); }\n"
    assert lint(src, header) == []


def test_mlx_outside_the_supported_range_is_refused_with_a_clear_message():
    from metal_kernels.emulator import _signature

    _signature.check_mlx_version("0.32.4")  # the range the signatures are written for
    for other in ("0.31.2", "0.33.0", "1.0.0"):
        with pytest.raises(RuntimeError, match=rf"mlx {re.escape(other)} is installed"):
            _signature.check_mlx_version(other)

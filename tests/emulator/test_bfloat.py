"""bfloat16 conversions in the emulator's prelude, bit for bit against MLX's CPU conversion.

The emulator defines float -> bfloat itself (round to nearest even, every NaN to the quiet NaN
0x7FC0) instead of relying on a compiler-runtime helper that some clang distributions lack.
"""

import mlx.core as mx
import numpy as np

from metal_kernels.emulator import bf16_bits_to_float32, float32_to_bf16_bits, metal_kernel

# bit patterns of float32 edge values: zeros, subnormals (smallest, largest, ties), normals at
# rounding ties (even and odd), the largest finite values (one rounds to inf), infinities, NaNs
EDGE_BITS = np.array([
    0x00000000, 0x80000000,              # +-0
    0x00000001, 0x80000001,              # smallest subnormals (round to +-0)
    0x00008000, 0x00018000,              # subnormal ties: to even (0) and to even (2)
    0x007FFFFF, 0x00800000,              # largest subnormal, smallest normal
    0x3F808000, 0x3F818000,              # 1 + tie: down to even, up to even
    0x3F808001, 0x3F807FFF,              # just above / below a tie
    0x3F800000, 0xBF800000,              # +-1
    0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,  # below the top tie, the tie (-> inf), FLT_MAX (-> inf)
    0x7F800000, 0xFF800000,              # +-inf
    0x7FC00000, 0xFFC00000,              # quiet NaNs
    0x7F800001, 0xFFA12345, 0x7FFFFFFF,  # signalling / payload NaNs
], dtype=np.uint32)


def mlx_bits(values_f32):
    return np.array(mx.array(values_f32).astype(mx.bfloat16).view(mx.uint16))


def test_float_to_bfloat_in_a_kernel_is_bit_exact_with_mlx():
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, size=4000, dtype=np.uint64).astype(np.uint32)
    bits = np.concatenate([EDGE_BITS, random_bits])
    x = bits.view(np.float32)
    k = metal_kernel("to_bf16", ["x"], ["y", "y_bits"], """
        uint i = thread_position_in_grid.x;
        bfloat16_t b = static_cast<bfloat16_t>(x[i]);
        y[i] = b;
        y_bits[i] = as_type<ushort>(b);
    """)
    y, y_bits = k(inputs=[x], output_shapes=[x.shape, x.shape], output_dtypes=[mx.bfloat16, mx.uint16],
                  grid=(x.size, 1, 1), threadgroup=(256, 1, 1))
    want = mlx_bits(x)
    bad = np.nonzero(y_bits != want)[0]
    assert bad.size == 0, [(hex(bits[i]), hex(y_bits[i]), hex(want[i])) for i in bad[:10]]
    # the bf16 output buffer holds the same bits (returned widened to float32)
    np.testing.assert_array_equal(float32_to_bf16_bits(y), want)


def test_bfloat_to_float_and_arithmetic_round_like_mlx():
    rng = np.random.default_rng(1)
    a = mx.array(rng.standard_normal(300).astype(np.float32) * 50).astype(mx.bfloat16)
    b = mx.array(rng.standard_normal(300).astype(np.float32)).astype(mx.bfloat16)
    k = metal_kernel("bf16_math", ["a", "b"], ["widened", "prod"], """
        uint i = thread_position_in_grid.x;
        widened[i] = float(a[i]);
        prod[i] = a[i] * b[i];
    """)
    widened, prod = k(inputs=[a, b], output_shapes=[(300,), (300,)], output_dtypes=[mx.float32, mx.bfloat16],
                      grid=(300, 1, 1), threadgroup=(64, 1, 1))
    np.testing.assert_array_equal(widened, np.array(a.astype(mx.float32)))
    # one bf16 multiplication: the exact float product rounded once, as MLX rounds it
    np.testing.assert_array_equal(float32_to_bf16_bits(prod), np.array((a * b).view(mx.uint16)))


def test_host_side_conversion_helpers_match_mlx():
    x = EDGE_BITS.view(np.float32)
    np.testing.assert_array_equal(float32_to_bf16_bits(x), mlx_bits(x))
    back = bf16_bits_to_float32(mlx_bits(x))
    np.testing.assert_array_equal(back.view(np.uint32), np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32)).view(np.uint32))

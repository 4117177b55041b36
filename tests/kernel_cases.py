"""Helpers shared by the kernel tests: devices and per-dtype tolerances."""

import mlx.core as mx
import numpy as np

import metalnn as mn

# Tolerances (absolute and relative, on values of order 1):
# - float32: the kernels accumulate in a different order than MLX and use rsqrt/sin/cos of the
#   emulator's libm, so results differ by a few ulps times the row length: 1e-4.
# - float16: 10 mantissa bits -> ~1e-3 relative per rounding, a few roundings: 1e-2.
# - bfloat16: 7 mantissa bits -> ~8e-3 per rounding: 5e-2.
TOL = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 5e-2}


def emulate(lane_order="forward", seed=0):
    return mn.Device(kernels="emulate", emulator_options={"lane_order": lane_order, "seed": seed})


def reference():
    return mn.Device(kernels="reference")


def f32(a):
    return np.array(a.astype(mx.float32))


def close(a, b, dtype, scale=1.0):
    tol = TOL[dtype] * scale
    np.testing.assert_allclose(f32(a), f32(b), atol=tol, rtol=tol)


def random(shape, dtype, seed=0):
    return mx.array(np.random.default_rng(seed).normal(size=shape).astype(np.float32)).astype(dtype)

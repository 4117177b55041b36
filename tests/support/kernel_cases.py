"""Helpers shared by the kernel tests (and scripts/validate_metal.py): the test shapes, devices,
per-dtype tolerances and a spy on kernel launches. Imports nothing but mlx, numpy and metalnn."""

from typing import NamedTuple

import mlx.core as mx
import numpy as np

import metalnn as mn
from metalnn.kernels import launch

# Tolerances (absolute and relative, on values of order 1):
# - float32: the kernels accumulate in a different order than MLX and use rsqrt/sin/cos of the
#   emulator's libm, so results differ by a few ulps times the row length: 1e-4.
# - float16: 10 mantissa bits -> ~1e-3 relative per rounding, a few roundings: 1e-2.
# - bfloat16: 7 mantissa bits -> ~8e-3 per rounding: 5e-2.
TOL = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 5e-2}
DTYPES = [mx.float32, mx.float16, mx.bfloat16]

# --- the shapes each kernel family is tested on ------------------------------------------------
#: rms_norm: x shapes [..., D]
RMS_NORM_SHAPES = [(3, 1), (2, 31), (3, 33), (1, 4096), (3, 2, 5, 64), (7, 130)]
#: rope: (x shape [..., T, D], dims)
ROPE_CASES = [((1, 1, 8), 8), ((3, 5, 31), 30), ((2, 2, 7, 33), 32), ((1, 3, 64), 48), ((1, 1, 4096), 4096),
              ((2, 4, 1, 128), 128)]
#: attention: (name, B, Hq, Hkv, Tq, Tk, head_dim, causal, offset); offset None = Tk - Tq
ATTENTION_CASES = [
    ("decode_gqa4", 1, 4, 1, 1, 7, 64, True, None),
    ("t7_d80_causal", 1, 2, 2, 7, 7, 80, True, None),
    ("t64_d32_gqa4_full", 1, 4, 1, 64, 64, 32, False, None),
    ("t130_d64_causal", 1, 1, 1, 130, 130, 64, True, None),
    ("t130_d32_full_b2", 2, 2, 1, 7, 130, 32, False, None),
    ("kvcache_d128_gqa2", 1, 2, 1, 7, 64, 128, True, None),
    ("kvcache_offset_d64", 1, 4, 1, 7, 64, 64, True, 20),
    ("t1_d128_full", 1, 2, 2, 1, 1, 128, False, None),
    ("cross_q130_k7_d80", 1, 2, 1, 130, 7, 80, False, None),
    ("d256_b2_causal", 2, 2, 1, 13, 30, 256, True, None),
]
#: conv: (op, x shape, w shape, keyword arguments); the op's rank follows from the shapes
CONV_CASES = [
    ("conv", (2, 3, 7, 6), (5, 3, 3, 2), dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2))),
    ("conv", (1, 4, 5, 9), (6, 2, 3, 3), dict(padding=1, groups=2)),
    ("conv", (2, 2, 8, 7), (3, 2, 2, 2), dict(stride=3)),                        # stride > kernel: dx holes
    ("conv", (1, 6, 6, 5), (6, 1, 3, 3), dict(padding=2, dilation=2, groups=6)),  # depthwise
    ("conv", (1, 37, 4, 3), (35, 37, 1, 2), dict(padding=(0, 1))),              # 2 tiles in M, 3 K chunks
    ("conv_transpose", (2, 3, 4, 5), (3, 4, 3, 2), dict(stride=2, padding=1, output_padding=1)),
    ("conv_transpose", (1, 4, 3, 3), (4, 3, 2, 3), dict(stride=(1, 3), padding=(0, 1), output_padding=(0, 2),
                                                        dilation=(2, 1), groups=2)),
    ("conv_transpose", (1, 2, 5, 4), (2, 3, 3, 3), dict(dilation=2, output_padding=1)),  # output_padding < dilation
    ("conv", (2, 3, 11), (4, 3, 3), dict(stride=2, padding=1, dilation=2)),
    ("conv", (1, 1, 5), (1, 1, 3), dict(padding=1)),  # < 8 elements: MLX passes `constant` buffers
    ("conv_transpose", (2, 4, 5), (4, 2, 3), dict(stride=3, output_padding=2, groups=2)),
    ("conv", (1, 2, 4, 3, 5), (3, 2, 2, 2, 3), dict(stride=(1, 2, 1), padding=(1, 0, 1), dilation=(1, 1, 2))),
    ("conv_transpose", (1, 2, 3, 2, 3), (2, 2, 2, 2, 2), dict(stride=2, padding=1, output_padding=1)),
]
#: gated delta rule: (B, T, Hk, Hv, K, V): plain heads; grouped heads with T not a multiple of the
#: chunk / checkpoint; wide heads over several checkpoints
GATED_DELTA_SHAPES = [(2, 12, 2, 2, 16, 8), (1, 37, 1, 2, 8, 4), (1, 35, 1, 1, 40, 6)]
#: SSD scans (B, T, H, P, G, N): one token, an odd length across several state checkpoints (every 16
#: tokens), groups of B/C, and a state width that is not a multiple of a SIMD group
SSD_SHAPES = [(1, 1, 2, 4, 1, 8), (2, 37, 4, 8, 2, 16), (1, 20, 3, 5, 1, 33)]


def emulate(lane_order="forward", seed=0):
    """A Device on the emulated kernels (whatever METALNN_KERNELS says)."""
    device = mn.Device(kernels="emulate", emulator_options={"lane_order": lane_order, "seed": seed})
    assert device.kernels == "emulate", device
    return device


def reference():
    """A Device on the plain-MLX reference ops (whatever METALNN_KERNELS says)."""
    device = mn.Device(kernels="reference")
    assert device.kernels == "reference", device
    return device


def f32(a):
    return np.array(a.astype(mx.float32))


def close(a, b, dtype, scale=1.0):
    tol = TOL[dtype] * scale
    np.testing.assert_allclose(f32(a), f32(b), atol=tol, rtol=tol)


def random(shape, dtype, seed=0):
    return mx.array(np.random.default_rng(seed).normal(size=shape).astype(np.float32)).astype(dtype)


class Launch(NamedTuple):
    family: str
    name: str
    options: dict       # the emulator's lane_order and seed
    template: dict      # template values, e.g. {"T": mx.float32, "FORWARD": True}
    threadgroup: tuple


class Launches(list):
    """Kernels the emulator ran (`Launch` records), in launch order."""

    def names(self):
        return {launch.name for launch in self}


def spy_launches(monkeypatch) -> Launches:
    """Record every kernel launch (emulated or on Metal) from now on, after it returned, with the
    options the emulator received. Use with pytest's ``monkeypatch``."""
    seen = Launches()

    def spying(real):
        def spy(family, name, atomic_outputs=False):
            kernel = real(family, name, atomic_outputs)

            def call(**kwargs):
                outs = kernel(**kwargs)
                options = {k: kwargs[k] for k in ("lane_order", "seed") if k in kwargs}
                seen.append(Launch(family, name, options, dict(kwargs.get("template") or ()),
                                   tuple(kwargs["threadgroup"])))
                return outs

            return call
        return spy

    monkeypatch.setattr(launch, "emulated_kernel", spying(launch.emulated_kernel))
    monkeypatch.setattr(launch, "metal_kernel", spying(launch.metal_kernel))
    return seen


def vjp(fn, x, cot):
    """The vector-Jacobian product of a one-input ``fn`` at ``x``."""
    return mx.vjp(fn, [x], [cot])[1][0]


def mlx_rope(x, dims, traditional=False, base=10000.0, scale=1.0, offset=0, freqs=None):
    """MLX's own ``mx.fast.rope`` with `metalnn.functional.rope`'s arguments (the oracle)."""
    return mx.fast.rope(x, dims, traditional=traditional, base=None if freqs is not None else base, scale=scale,
                        offset=offset, freqs=freqs)

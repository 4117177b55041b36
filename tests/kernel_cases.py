"""Helpers shared by the kernel tests: devices, per-dtype tolerances and a spy on kernel launches."""

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
    """Record every emulated kernel launch from now on (after it returned, with the options the
    emulator received). Use with pytest's ``monkeypatch``."""
    seen = Launches()
    real = launch.emulated_kernel

    def spy(family, name, atomic_outputs=False):
        kernel = real(family, name, atomic_outputs)

        def call(**kwargs):
            outs = kernel(**kwargs)
            options = {k: kwargs[k] for k in ("lane_order", "seed") if k in kwargs}
            seen.append(Launch(family, name, options, dict(kwargs.get("template") or ()), tuple(kwargs["threadgroup"])))
            return outs

        return call

    monkeypatch.setattr(launch, "emulated_kernel", spy)
    return seen

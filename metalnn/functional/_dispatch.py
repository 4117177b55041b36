"""How the ops of `metalnn.functional` read a `Device`'s kernel choice.

``device.kernels`` names the implementation (see `metalnn.Device`):

* ``"reference"``: the op spelled out in plain MLX ops, differentiated by MLX (the oracle of the
  kernel tests);
* ``"auto"``: MLX's own fused op where MLX has one (``mx.fast.*``, ``mx.conv_general``), else plain
  MLX ops; on the CPU backend a metalnn CPU path stands in where it was measured faster (each op's
  docstring names the substitution and its benchmark);
* ``"metal"`` / ``"emulate"``: metalnn's custom kernels (`metalnn.kernels`) through
  ``mx.fast.metal_kernel`` / the CPU emulator, for the calls their ``supports`` accepts; other
  calls run the ``"auto"`` implementation.
"""

from __future__ import annotations

import mlx.core as mx

from ..cpu import fused
from ..cpu.device import on_cpu

KERNEL_BACKENDS = ("metal", "emulate")


def kernel_backend(device) -> str | None:
    """``"metal"`` or ``"emulate"`` when the device asks for the custom kernels, else None."""
    return device.kernels if device.kernels in KERNEL_BACKENDS else None


def emulator_options(device) -> dict:
    return dict(getattr(device, "emulator_options", None) or {}) if device.kernels == "emulate" else {}



def native_cpu(*arrays) -> bool:
    """Whether these arrays run on the CPU backend and are all float32 (None entries ignored)."""
    return on_cpu() and all(a is None or a.dtype == mx.float32 for a in arrays)


def fused_cpu(*arrays) -> bool:
    """Whether `metalnn.cpu.fused`'s native primitives run these arrays: the CPU backend, the extension
    loaded and every array (None entries ignored) float32."""
    return on_cpu() and fused.available() and all(a is None or a.dtype == mx.float32 for a in arrays)

"""CPU emulator and checker for `mx.fast.metal_kernel` kernels (see README.md)."""

from .kernel import (
    EmulatorError,
    MetalKernel,
    as_mx,
    bf16_bits_to_float32,
    float32_to_bf16_bits,
    metal_kernel,
)
from .lint import lint

__all__ = [
    "EmulatorError",
    "MetalKernel",
    "as_mx",
    "bf16_bits_to_float32",
    "float32_to_bf16_bits",
    "lint",
    "metal_kernel",
]

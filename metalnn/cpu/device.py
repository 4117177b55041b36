"""Which MLX device the current ops run on."""

import mlx.core as mx


def on_cpu() -> bool:
    """Whether MLX's default device (the one ops run on now) is the CPU."""
    return mx.default_device().type == mx.DeviceType.cpu

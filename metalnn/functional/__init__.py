"""Differentiable operations with selectable implementations.

Each op takes ``device=`` (default: the default `Device`) and runs the implementation named by
``device.kernels``: ``"reference"`` (plain MLX ops), ``"metal"`` (custom Metal kernels through
``mx.fast.metal_kernel``, with backward kernels registered through ``mx.custom_function``) or
``"emulate"`` (the same Metal source run by the CPU emulator in ``metal_kernels.emulator``).
"""

from .attention import attention, attention_naive, attention_reference, causal_mask
from .conv import (conv1d, conv2d, conv3d, conv_transpose1d, conv_transpose2d,  # noqa: E402
                   conv_transpose3d)
from .norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from .rope import rope, rope_reference

__all__ = ["attention", "attention_naive", "attention_reference", "causal_mask",
           "layer_norm", "layer_norm_reference", "rms_norm", "rms_norm_reference", "rope", "rope_reference"]
__all__ += ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"]
from .gated_delta import gated_delta_rule  # noqa: E402

__all__ += ["gated_delta_rule"]

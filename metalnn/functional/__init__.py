"""Differentiable operations with selectable implementations.

Each op takes ``device=`` (default: the default `Device`) and runs the implementation named by
``device.kernels`` (see `metalnn.functional._dispatch` and each op's docstring): ``"reference"``
(the op spelled out in plain MLX ops), ``"auto"`` (MLX's own fused ops; measured CPU stand-ins on
the CPU backend), ``"metal"`` (metalnn's custom Metal kernels through ``mx.fast.metal_kernel``,
with backward kernels registered through ``mx.custom_function``) or ``"emulate"`` (the same
Metal source run by the CPU emulator in ``metal_kernels.emulator``).

This package owns the choice and the fallbacks; `metalnn.kernels` only launches kernels.
"""

from .activations import activation, check_activation, gated_activation
from .attention import attention, attention_reference, causal_mask
from .decode_step import BlockStep, StackCache, StackEmbedding, StackHead, decoder_block_step, decoder_stack_step
from .conv import conv1d, conv2d, conv3d, conv_transpose1d, conv_transpose2d, conv_transpose3d
from .gated_delta import gated_delta_rule
from .gather import gather_matmul
from .ggml import ggml_dequantize, ggml_exact_inputs, ggml_int8_inputs, ggml_matmul
from .losses import cross_entropy_rows
from .optim import adamw_update
from .norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from .quantized import dequantize_weight, quantize_weight, quantized_matmul
from .rope import rope, rope_reference
from .ssd import ssd_scan

__all__ = ["activation", "check_activation", "gated_activation", "attention", "attention_reference", "causal_mask",
           "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
           "BlockStep", "StackCache", "StackEmbedding", "StackHead", "decoder_block_step", "decoder_stack_step",
           "gated_delta_rule", "gather_matmul", "ggml_matmul", "ggml_dequantize", "ggml_int8_inputs", "ggml_exact_inputs", "cross_entropy_rows", "adamw_update", "quantize_weight", "dequantize_weight",
           "quantized_matmul", "layer_norm", "layer_norm_reference", "rms_norm", "rms_norm_reference",
           "rope", "rope_reference", "ssd_scan"]

"""Optimizer updates: which implementation runs."""

from __future__ import annotations

from ..cpu import fused
from ._dispatch import fused_cpu


def adamw_update(parameter, gradient, m, v, learning_rate, step, *, betas, eps, weight_decay, bias_correction):
    """AdamW's update of one parameter as one multi-threaded pass (`metalnn.cpu.fused.adamw_update`)
    when it applies: the CPU backend with the native extension, every array float32 and the gradient
    shaped as the parameter. Returns ``(parameter, m, v)``, or None when it does not apply (the caller
    then runs ``mlx.optimizers.AdamW``'s own update, which gives the same result)."""
    if not fused_cpu(gradient, parameter, m, v) or parameter.shape != gradient.shape:
        return None
    return fused.adamw_update(parameter, gradient, m, v, learning_rate, step, betas=betas, eps=eps,
                              weight_decay=weight_decay, bias_correction=bias_correction)

"""Optimizers: `AdamW`, ``mlx.optimizers.AdamW`` with a fused update on the CPU backend."""

from __future__ import annotations

import mlx.optimizers as optim

from . import functional as F

__all__ = ["AdamW"]


class AdamW(optim.AdamW):
    """``mlx.optimizers.AdamW``: the same arguments, state, checkpoints and results, with the
    per-parameter update of float32 parameters on the CPU backend computed by
    `metalnn.functional.adamw_update` (one multi-threaded pass over parameter, gradient and moments
    instead of MLX's chain of single-threaded element-wise ops; ``scripts/bench_train.py``
    trains with it). Elsewhere, and for other dtypes, it is mlx's own update.

    Args: as ``mlx.optimizers.AdamW`` (``learning_rate``, ``betas``, ``eps``, ``weight_decay``,
    ``bias_correction``).
    """

    def apply_single(self, gradient, parameter, state):
        updated = F.adamw_update(parameter, gradient, state["m"], state["v"], self.learning_rate, self.step,
                                 betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                                 bias_correction=self.bias_correction)
        if updated is None:
            return super().apply_single(gradient, parameter, state)
        parameter, state["m"], state["v"] = updated
        return parameter

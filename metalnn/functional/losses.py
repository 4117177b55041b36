"""Per-row softmax cross-entropy: which implementation runs."""

from __future__ import annotations

import mlx.core as mx

from ..cpu import fused
from ..device import resolve
from ._dispatch import fused_cpu


def cross_entropy_rows(logits, targets, label_smoothing: float = 0.0, device=None):
    """``logsumexp(logits) - logits[target]`` per row (with label smoothing mixed in).

    Args:
        logits: ``[..., C]`` float32 scores.
        targets: ``[...]`` integer class ids in ``[0, C)``.
        label_smoothing: weight of the uniform distribution mixed into the one-hot target.
        device: ``"reference"`` kernels run the formula in plain MLX ops (``logsumexp`` and a gather);
            any other choice, on the CPU backend with float32 logits, `metalnn.cpu.fused.cross_entropy`
            (one multi-threaded pass forward and one backward: ``scripts/bench_kernels.py --ops
            cross_entropy``).

    Returns: ``[...]`` float32 losses.
    """
    if resolve(device).kernels != "reference" and fused_cpu(logits):
        return fused.cross_entropy(logits, targets, label_smoothing)
    # differences with each row's max first, as torch's log_softmax: lse - x[t] formed as
    # lse(x - m) - (x[t] - m) stays exact to float32 rounding for large logits
    m = mx.stop_gradient(mx.max(logits, axis=-1, keepdims=True))
    shifted = logits - mx.where(mx.isinf(m), 0, m)
    lse = mx.logsumexp(shifted, axis=-1)
    picked = mx.take_along_axis(shifted, targets[..., None].astype(mx.int32), axis=-1)[..., 0]
    loss = lse - picked
    if label_smoothing:
        loss = (1 - label_smoothing) * loss + label_smoothing * (lse - mx.mean(shifted, axis=-1))
    return loss

"""Grouped matrix products over stacked weights (mixture-of-experts layers)."""

from __future__ import annotations

import mlx.core as mx

from ._dispatch import on_cpu


def gather_matmul(x, w, idx, sorted_indices=False):
    """``x @ w[idx].T`` for stacked weights ``w`` ``[E, out, in]`` (``mx.gather_mm``).

    MLX's CPU ``gather_mm`` takes float32 only: on the CPU, other dtypes are computed in float32
    (gathering just the selected matrices when there are no more (token, expert) pairs than
    experts, as in decoding) and cast back.
    """
    wt = mx.swapaxes(w, -1, -2)
    if (x.dtype == mx.float32 and w.dtype == mx.float32) or not on_cpu():
        return mx.gather_mm(x, wt, rhs_indices=idx, sorted_indices=sorted_indices)
    f32 = mx.float32
    if idx.size <= w.shape[0]:
        y = x.astype(f32) @ wt[idx].astype(f32)
    else:
        y = mx.gather_mm(x.astype(f32), wt.astype(f32), rhs_indices=idx, sorted_indices=sorted_indices)
    return y.astype(x.dtype)

"""The gated delta rule's per-token recurrence as a native, multi-threaded CPU primitive.

``metalnn.cpu._fastmath.gated_delta`` (built from ``metalnn/cpu/native/fastmath/gated_delta.cpp``)
runs, for every (batch, head) pair on one thread of metalnn's pool (the pairs in parallel), the
recurrence of `metalnn.functional.gated_delta_recurrent` on prepared float32 inputs::

    S = exp(g_t) S;   S = S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

The state (``K x V``, 16 KiB at 64x64) stays in the core's cache, so one token costs three
sweeps over it forward; the forward pass keeps the state before every 64 tokens and the backward
pass (a second primitive) recomputes each block of 64 states from there and walks the tokens
backwards, so memory grows by ``B * H * ceil(T / 64) * K * V`` floats, not ``T * K * V``.

Differentiable once (``mx.grad``, ``mx.vjp``, ``mx.value_and_grad``, also inside ``mx.compile``)
in q, k, v, g, beta and h0; JVPs, vmap and second derivatives raise. `available` is False where
the extension is missing (macOS, a failed build); `metalnn.functional.gated_delta_rule` then
runs its MLX forms.
"""

from __future__ import annotations

import mlx.core as mx

from . import native_ext as _native_ext

__all__ = ["available", "gated_delta", "MAX_V"]

#: largest value head dimension the native kernels take
MAX_V = 1024

_ext = _native_ext.extension()


def available() -> bool:
    """True when the native primitive is loaded."""
    return _ext is not None and hasattr(_ext, "gated_delta")


def gated_delta(q, k, v, g, beta, h0, *, stream=None):
    """The recurrence over prepared float32 inputs; returns ``(o, state)``.

    Args:
        q, k: ``[B, T, H, K]`` (q already scaled; q, k already normalised if wanted).
        v: ``[B, T, H, V]`` with ``V <= MAX_V``.
        g, beta: ``[B, T, H]`` (log-decay and write strength).
        h0: ``[B, H, K, V]`` initial state.
    Returns:
        ``o`` ``[B, T, H, V]`` and the final state ``[B, H, K, V]``, float32.
    """
    if not available():
        raise RuntimeError(f"metalnn.cpu.gated_delta: the native extension is unavailable "
                           f"({_native_ext.unavailable_reason() or 'it has no gated_delta'})")
    arrays = (q, k, v, g, beta, h0)
    if any(a.dtype != mx.float32 for a in arrays):
        raise ValueError(f"metalnn.cpu.gated_delta: inputs must be float32, got {[str(a.dtype) for a in arrays]}")
    o, state = _ext.gated_delta(q, k, v, g, beta, h0, stream=stream)
    return o, state

"""Causal self-attention as a native, multi-threaded CPU primitive (forward and backward).

``metalnn.cpu._fastmath.causal_attention`` (built from
``metalnn/cpu/native/fastmath/causal_attention.cpp``) computes ``softmax(q k^T * scale) v`` with the
causal mask for queries and keys at the same positions (training, prefill without a cache),
without forming the attention matrix: a block of 4 query rows at a time forms its scores for the
keys it sees only (half the products of the full matrix), and the forward pass keeps each row's
logsumexp, from which the backward pass recomputes the probabilities. The tasks of metalnn's
thread pool are the (batch, query head) pairs; grouped-query attention reads the key/value heads
in place, with no copies, and the backward pass sums the key/value gradients of a group's query
heads at the end.

Differentiable once (``mx.grad``, ``mx.vjp``, inside ``mx.compile``); JVPs, vmap and second
derivatives raise. Float32, CPU streams, head_dim 32, 64 or 128 (`supports`).
"""

from __future__ import annotations

import mlx.core as mx

from . import native_ext as _native_ext

__all__ = ["available", "supports", "causal_attention", "HEAD_DIMS"]

#: head dimensions the native kernels are compiled for
HEAD_DIMS = (32, 64, 128)

_ext = _native_ext.extension()


def available() -> bool:
    """True when the native primitive is loaded."""
    return _ext is not None and hasattr(_ext, "causal_attention")


def supports(q, k, v) -> bool:
    """Whether `causal_attention` takes these arrays: float32, ``[B, H, T, D]`` with q and k/v of one
    length, a head_dim in `HEAD_DIMS`, query heads a multiple of key/value heads, T > 0."""
    if not available() or q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    if any(a.dtype != mx.float32 for a in (q, k, v)) or k.shape != v.shape:
        return False
    B, Hq, T, D = q.shape
    return (T > 0 and D in HEAD_DIMS and k.shape[0] == B and k.shape[2] == T and k.shape[3] == D
            and k.shape[1] > 0 and Hq % k.shape[1] == 0)


def causal_attention(q, k, v, scale: float, *, stream=None):
    """Causal attention of q ``[B, Hq, T, D]`` over k, v ``[B, Hkv, T, D]``; returns ``[B, Hq, T, D]``.

    The result is stored position-major (``[B, T, Hq, D]`` in memory; the returned array is its
    transposed view), so merging the heads after it needs no copy.
    """
    if not supports(q, k, v):
        raise ValueError(f"metalnn.cpu.attention.causal_attention: needs the native extension and float32 "
                         f"[B, H, T, D] arrays with q and k/v of one length and head_dim in {HEAD_DIMS}; got q "
                         f"{tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         f"(extension loaded: {available()})")
    return _ext.causal_attention(q, k, v, float(scale), stream=stream).transpose(0, 2, 1, 3)

"""Scaled dot-product attention."""

from __future__ import annotations

import math

import mlx.core as mx

from ..cpu import attention as native
from ..cpu import fused
from ..device import resolve
from ..kernels import attention as kernels
from ._dispatch import emulator_options, fused_cpu, kernel_backend

__all__ = ["attention", "attention_reference", "causal_mask"]


def _check(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention: q, k, v must be [B, heads, T, head_dim], got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, _, D = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"attention: k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, heads and "
                         f"length")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"attention: k {tuple(k.shape)} must match q {tuple(q.shape)} in batch and head_dim")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"attention: query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")


def causal_mask(t_q: int, t_k: int, offset: int | None = None):
    """Boolean ``[t_q, t_k]`` mask, True where query ``i`` (at position ``offset + i``) may see key ``j``.

    ``offset=None`` places the queries at the last ``t_q`` positions (``offset = t_k - t_q``).
    """
    if offset is None:
        offset = t_k - t_q
    q_pos = mx.arange(t_q)[:, None] + offset
    return mx.arange(t_k)[None, :] <= q_pos


def attention_reference(q, k, v, scale: float | None = None, causal: bool = True, mask=None, offset=None,
                        softcap: float | None = None, sinks=None):
    """`attention` spelled out in plain MLX ops: ``softmax(q k^T * scale + mask) v`` in float32.

    k and v are repeated for grouped-query attention; the result is cast to ``q.dtype``. A query
    row that sees no key gives NaN (softmax over an empty set). ``softcap``: the scaled scores
    become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2's logit soft-capping).
    ``sinks`` ``[Hq]``: one more logit per query head in each row's softmax, whose probability is
    dropped (attention sinks: they take mass and add no value; a row that sees no key gives zeros).
    """
    _check(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = mx.repeat(k, rep, axis=1)
        v = mx.repeat(v, rep, axis=1)
    s = (q.astype(mx.float32) * scale) @ k.astype(mx.float32).swapaxes(-1, -2)
    if softcap is not None:
        s = mx.tanh(s / softcap) * softcap
    if mask is not None:
        s = mx.where(mask, s, -mx.inf) if mask.dtype == mx.bool_ else s + mask.astype(mx.float32)
    if causal:
        s = mx.where(causal_mask(q.shape[2], k.shape[2], offset), s, -mx.inf)
    if sinks is not None:
        if sinks.shape != (q.shape[1],):
            raise ValueError(f"attention: sinks must be [query heads] = [{q.shape[1]}], got {tuple(sinks.shape)}")
        column = mx.broadcast_to(sinks.astype(mx.float32)[:, None, None], s.shape[:-1] + (1,))
        p = mx.softmax(mx.concatenate([s, column], axis=-1), axis=-1)[..., :-1]
    else:
        p = mx.softmax(s, axis=-1)
    return (p @ v.astype(mx.float32)).astype(q.dtype)


def _combined_mask(q, k, causal, mask, offset):
    """The mask argument for ``mx.fast.scaled_dot_product_attention``: None, "causal" or an array."""
    t_q, t_k = q.shape[2], k.shape[2]
    if offset is not None and offset == t_k - t_q:
        offset = None
    if not causal:
        return mask
    if mask is None and offset is None:
        return "causal" if t_q > 1 else None
    cm = causal_mask(t_q, t_k, offset)
    if mask is None:
        return cm
    if mask.dtype == mx.bool_:
        return mx.logical_and(mask, cm)
    return mx.where(cm, mask.astype(q.dtype), mx.array(-mx.inf, q.dtype))


def _attention_fused(q, k, v, scale, causal):
    """Attention on the CPU as two matrix products around `metalnn.cpu.fused.scaled_softmax` (float32,
    no mask array).

    MLX's CPU attention evaluates ``exp`` one element at a time; here the scale, the causal mask
    and the softmax are one multi-threaded pass (and one backward pass) over the scores. GQA
    without copies: query heads are grouped as ``[B, Hkv, rep*Tq, D]`` against ``[B, Hkv, Tk, D]``.

    Layouts: ``v`` (typically the transposed view of split heads) is made row-contiguous by
    `metalnn.cpu.fused.contiguous`, whose gradient comes back in ``v``'s own memory order; the
    output is stored position-major (``[B, Tq, Hq, D]`` in memory, returned as the
    ``[B, Hq, Tq, D]`` view), so merging the heads back is free and the gradient of the output
    reaches the two matrix products row-contiguous.
    """
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    s = q.reshape(B, Hkv, rep * Tq, D) @ k.swapaxes(-1, -2)
    p = fused.scaled_softmax(s, scale, causal=causal, q_len=Tq, offset=Tk - Tq)
    o = (p @ fused.contiguous(v)).reshape(B, Hq, Tq, v.shape[-1])
    return fused.contiguous(o.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def _attention_mlx(q, k, v, scale, causal, mask, offset):
    """The ``"auto"`` implementation: MLX's fused attention, or the fused-softmax form on the CPU."""
    m = _combined_mask(q, k, causal, mask, offset)
    same_positions = isinstance(m, str) and m == "causal" and q.shape[2] == k.shape[2]
    if same_positions and fused_cpu(q, k, v) and native.supports(q, k, v):
        return native.causal_attention(q, k, v, scale)
    if fused_cpu(q, k, v) and not isinstance(m, mx.array):
        return _attention_fused(q, k, v, scale, m == "causal")
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m)


def attention(q, k, v, scale: float | None = None, causal: bool = True, mask=None, offset=None, softcap=None,
              sinks=None, device=None):
    """Multi-head scaled dot-product attention ``softmax(q k^T * scale [+ mask]) v``.

    Args:
        q: queries ``[B, Hq, Tq, head_dim]``.
        k, v: keys and values ``[B, Hkv, Tk, head_dim]``; ``Hq`` must be a multiple of ``Hkv``
            (grouped-query attention: query head ``h`` reads key/value head ``h // (Hq // Hkv)``).
        scale: multiplies the scores (default ``head_dim ** -0.5``).
        causal: query ``i`` sees only keys at positions ``<= offset + i``.
        mask: optional boolean (True = keep) or additive array broadcastable to ``[B, Hq, Tq, Tk]``;
            combined with the causal mask.
        offset: position of the first query among the keys. ``None`` (default) means ``Tk - Tq``:
            the queries are the last ``Tq`` positions, as in KV-cache decoding. A smaller offset also
            hides the keys after each query (e.g. unused slots of a preallocated cache).
        softcap: soft-cap of the scaled scores (see `attention_reference`); runs the reference.
        sinks: ``[Hq]`` attention-sink logits (see `attention_reference`) or None; runs the reference.
        device: the `Device` whose ``kernels`` selects the implementation.
    Returns:
        ``[B, Hq, Tq, head_dim]`` in ``q.dtype``. Differentiable in ``q``, ``k`` and ``v``.

    Implementation by ``device.kernels``:

    * ``"reference"``: `attention_reference`.
    * ``"auto"``: ``mx.fast.scaled_dot_product_attention``. On the CPU backend, causal attention of
      queries and keys at the same positions (training) runs `metalnn.cpu.attention` where it
      takes the shapes (float32, head_dim 32/64/128): one thread, q ``[6, 6, 192, 32]``, 2 kv
      heads, forward+backward took 0.55-0.7x the CPU time of the form below. Other float32 inputs
      without a mask array, while the native extension is available, take the form of
      `_attention_fused` (two matrix products around `metalnn.cpu.fused.scaled_softmax`) instead:
      ``python scripts/bench_kernels.py --ops attention --cpu-time`` (q ``[2, 8, 256, 64]``, 2 kv
      heads, causal, one thread) measured about 7x less CPU time forward and 3.5x less
      forward+backward than MLX's CPU attention (2-core x86_64, shared machine).
    * ``"metal"``/``"emulate"``: the fused kernels of `metalnn.kernels.attention` for the calls its
      ``supports`` accepts (no mask array, ``head_dim <= 256``, non-empty); otherwise ``"auto"``.
    """
    device = resolve(device)
    if softcap is not None:
        if not softcap > 0:
            raise ValueError(f"attention: softcap must be positive or None, got {softcap!r}")
        return attention_reference(q, k, v, scale, causal, mask, offset, float(softcap), sinks)
    if sinks is not None or device.kernels == "reference":
        return attention_reference(q, k, v, scale, causal, mask, offset, sinks=sinks)
    _check(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    backend = kernel_backend(device)
    if backend and kernels.supports(q, k, v, mask):
        offset = k.shape[2] - q.shape[2] if offset is None else offset
        return kernels.attention(q, k, v, scale, causal, offset, backend, emulator_options(device))
    return _attention_mlx(q, k, v, scale, causal, mask, offset)

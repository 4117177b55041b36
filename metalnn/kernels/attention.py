"""Fused scaled-dot-product attention on custom kernels (``metal_kernels/attention.metal``).

The forward kernel is flash-attention style (online softmax over K/V tiles staged in threadgroup
memory) and also writes the per-row log-sum-exp; the backward recomputes the probabilities from
it: ``attention_backward_dq`` (per query row; also writes ``delta = rowsum(dO * O)``) and then
``attention_backward_dkv`` (per key row, summing over every query head of its kv group). No
``Tq x Tk`` matrix is materialised and K/V are never repeated for grouped-query attention.

Not handled by the kernels (these run through ``mx.fast.scaled_dot_product_attention`` via
`metalnn.functional.attention_reference`, which is differentiable, so results and gradients stay
correct): an explicit ``mask`` array, ``head_dim > MAX_HEAD_DIM``, and empty inputs.
"""

from __future__ import annotations

import mlx.core as mx

from .launch import run

FAMILY = "attention"

SIMD = 32
ROWS_PER_THREADGROUP = 4          # SIMD groups (rows) per threadgroup
MAX_HEAD_DIM = 256                # 8 registers per lane
TILE_FLOATS = 3072                # floats per threadgroup tile: two tiles use 24 KiB of the 32 KiB


def tiling(head_dim: int):
    """Template values ``(DL, BK)`` for a head dimension: registers per lane and tile rows."""
    dl = -(-head_dim // SIMD)
    bk = max(1, min(32, TILE_FLOATS // (SIMD * dl)))
    return dl, bk


def _grid(rows: int, heads: int, batch: int):
    tg = SIMD * ROWS_PER_THREADGROUP
    blocks = -(-rows // ROWS_PER_THREADGROUP)
    return (blocks * tg, heads, batch), (tg, 1, 1)


def _fallback(q, k, v, scale, causal, mask, offset):
    from ..functional.attention import attention_reference

    return attention_reference(q, k, v, scale, causal, mask, offset)


def attention(q, k, v, scale: float, causal: bool, mask, offset: int, device):
    """Kernel-backed ``F.attention``: q ``[B, Hq, Tq, D]``, k/v ``[B, Hkv, Tk, D]``.

    ``offset`` is the position of query 0 among the keys (query ``i`` sees keys ``j <= offset + i``
    when ``causal``). With a ``mask`` the computation falls back to the reference path (see the
    module docstring).
    """
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if mask is not None or D > MAX_HEAD_DIM or min(B, Hq, Tq, Tk, D) == 0:
        return _fallback(q, k, v, scale, causal, mask, offset)

    backend = device.kernels
    opts = getattr(device, "emulator_options", None)
    dtype = q.dtype
    k = k.astype(dtype)
    v = v.astype(dtype)
    scale = float(scale)
    dl, bk = tiling(D)
    template = [("T", dtype), ("DL", dl), ("BK", bk)]
    sizes = [scale, int(bool(causal)), int(offset), Tq, Tk, D, Hq, Hkv]

    @mx.custom_function
    def fn(q, k, v):
        grid, tg = _grid(Tq, Hq, B)
        o, lse = run(FAMILY, "attention_forward", backend, [q, k, v, *sizes], [q.shape, (B, Hq, Tq)],
                     [dtype, mx.float32], grid=grid, threadgroup=tg, template=template, emulator_options=opts)
        return o, lse

    @fn.vjp
    def fn_vjp(primals, cotangents, outputs):
        q, k, v = primals
        do = cotangents[0].astype(dtype)
        o, lse = outputs
        grid, tg = _grid(Tq, Hq, B)
        dq, delta = run(FAMILY, "attention_backward_dq", backend, [q, k, v, o, do, lse, *sizes],
                        [q.shape, (B, Hq, Tq)], [dtype, mx.float32], grid=grid, threadgroup=tg,
                        template=template, emulator_options=opts)
        grid, tg = _grid(Tk, Hkv, B)
        dk, dv = run(FAMILY, "attention_backward_dkv", backend, [q, k, v, do, lse, delta, *sizes],
                     [k.shape, v.shape], [dtype, dtype], grid=grid, threadgroup=tg, template=template,
                     emulator_options=opts)
        return dq, dk, dv

    return fn(q, k, v)[0]

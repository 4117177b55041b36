"""Fused scaled-dot-product attention on custom kernels (``metal_kernels/attention.metal``).

The forward kernel is flash-attention style (online softmax over K/V tiles staged in threadgroup
memory) and also writes the per-row log-sum-exp; the backward recomputes the probabilities from
it: ``attention_backward_dq`` (per query row; also writes ``delta = rowsum(dO * O)``) and then
``attention_backward_dkv`` (per key row, summing over every query head of its kv group). No
``Tq x Tk`` matrix is materialised and K/V are never repeated for grouped-query attention.

`supports` says which calls the kernels take: no explicit ``mask`` array, ``head_dim <=
MAX_HEAD_DIM``, non-empty float inputs. `metalnn.functional.attention` runs the others on MLX's
own attention.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from . import launch

FAMILY = "attention"
DTYPES = (mx.float32, mx.float16, mx.bfloat16)

SIMD = 32
ROWS_PER_THREADGROUP = 4          # SIMD groups (rows) per threadgroup
MAX_HEAD_DIM = 256                # 8 registers per lane
TILE_FLOATS = 3072                # floats per threadgroup tile: two tiles use 24 KiB of the 32 KiB


def supports(q, k, v, mask) -> bool:
    """Whether the kernels take q ``[B, Hq, Tq, D]``, k/v ``[B, Hkv, Tk, D]`` and ``mask``."""
    return (mask is None and q.shape[-1] <= MAX_HEAD_DIM and min(*q.shape, k.shape[2]) > 0
            and q.dtype in DTYPES)


def tiling(head_dim: int):
    """Template values ``(DL, BK)`` for a head dimension: registers per lane and tile rows."""
    dl = -(-head_dim // SIMD)
    bk = max(1, min(32, TILE_FLOATS // (SIMD * dl)))
    return dl, bk


def _grid(rows: int, heads: int, batch: int):
    tg = SIMD * ROWS_PER_THREADGROUP
    blocks = -(-rows // ROWS_PER_THREADGROUP)
    return (blocks * tg, heads, batch), (tg, 1, 1)


def _sizes(q, k, scale, causal, offset):
    B, Hq, Tq, D = q.shape
    return [scale, int(causal), offset, Tq, k.shape[2], D, Hq, k.shape[1]]


@lru_cache(maxsize=None)
def _function(backend: str, scale: float, causal: bool, options: tuple):
    def launch_kernel(name, inputs, shapes, dtypes, rows, heads, batch, head_dim, dtype):
        grid, tg = _grid(rows, heads, batch)
        dl, bk = tiling(head_dim)
        return launch.run(FAMILY, name, backend, inputs, shapes, dtypes, grid=grid, threadgroup=tg,
                          template=[("T", dtype), ("DL", dl), ("BK", bk)], emulator_options=options)

    @mx.custom_function
    def fn(q, k, v, offset):
        B, Hq, Tq, D = q.shape
        sizes = _sizes(q, k, scale, causal, offset)
        return launch_kernel("attention_forward", [q, k, v, *sizes], [q.shape, (B, Hq, Tq)], [q.dtype, mx.float32],
                             Tq, Hq, B, D, q.dtype)

    @fn.vjp
    def fn_vjp(primals, cotangents, outputs):
        q, k, v, offset = primals
        B, Hq, Tq, D = q.shape
        sizes = _sizes(q, k, scale, causal, offset)
        do = cotangents[0].astype(q.dtype)
        o, lse = outputs
        dq, delta = launch_kernel("attention_backward_dq", [q, k, v, o, do, lse, *sizes], [q.shape, (B, Hq, Tq)],
                                  [q.dtype, mx.float32], Tq, Hq, B, D, q.dtype)
        dk, dv = launch_kernel("attention_backward_dkv", [q, k, v, do, lse, delta, *sizes], [k.shape, v.shape],
                               [q.dtype, q.dtype], k.shape[2], k.shape[1], B, D, q.dtype)
        return dq, dk, dv, mx.zeros_like(offset)

    return fn


def attention(q, k, v, scale: float, causal: bool, offset, backend: str, emulator_options=()):
    """``softmax(q k^T * scale) v`` on the kernels: q ``[B, Hq, Tq, D]``, k/v ``[B, Hkv, Tk, D]``.

    Check `supports` first. ``offset`` (an int or 0-d int array) is the position of query 0 among
    the keys: with ``causal`` query ``i`` sees keys ``j <= offset + i``; a row that sees no key
    gives zeros. k and v are cast to ``q.dtype``. Returns ``[B, Hq, Tq, D]``; differentiable in
    q, k and v.
    """
    offset = mx.array(offset).astype(mx.int32).reshape(())
    fn = _function(backend, float(scale), bool(causal), launch.options_key(emulator_options))
    return fn(q, k.astype(q.dtype), v.astype(q.dtype), offset)[0]

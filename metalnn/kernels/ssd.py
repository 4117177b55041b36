"""The SSD scan of Mamba2 on custom kernels (``metal_kernels/ssd.metal``), forward and backward.

`ssd` takes the *prepared* float32 tensors of `metalnn.functional.ssd_scan` (``xd = dt * x``, the
log-decay ``g = dt * A``, B and C repeated from their groups to the heads) and returns
``(y, final_state)`` without the D skip. It is an ``mx.custom_function`` (built once per backend
and emulator options): the forward kernel also stores the state every `CHECKPOINT` tokens, and the
VJP runs the backward kernel, which recomputes the states inside each checkpoint interval and
walks the tokens in reverse. The backward kernel accumulates dB, dC and dg with atomic adds into
zero-initialised outputs.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from . import launch

FAMILY = "ssd"

#: Tokens between the state checkpoints that the forward kernel stores for the backward.
CHECKPOINT = 16
#: Most SIMD groups (state rows) per threadgroup.
MAX_SIMDGROUPS = 8
#: Largest state size N: each lane keeps NK = ceil(N / 32) state columns in registers (and
#: CHECKPOINT times that in the backward kernel's history); the backward kernel's threadgroup
#: arrays take (2 * NK * 32 + 1) * SG floats, under 32 KiB for NK <= 8 and SG <= MAX_SIMDGROUPS.
MAX_N = 256


def supports(xd, b) -> bool:
    """Whether the kernels take prepared xd ``[B, T, H, P]`` and B ``[B, T, H, N]``: ``N <= MAX_N``,
    no empty axis except T."""
    batch, _, heads, width = xd.shape
    n = b.shape[-1]
    return 0 < n <= MAX_N and min(batch, heads, width) > 0


def _registers(n: int) -> int:
    return -(-n // 32)


def _simdgroups(p: int) -> int:
    """The largest divisor of P that is at most MAX_SIMDGROUPS."""
    return max(d for d in range(1, min(p, MAX_SIMDGROUPS) + 1) if p % d == 0)


@lru_cache(maxsize=None)
def _function(backend: str, options: tuple):
    def dims(xd, b):
        B, T, H, P = xd.shape
        N = b.shape[-1]
        sg = _simdgroups(P)
        return B, T, H, P, N, sg, (32, P, B * H), (32, sg, 1)

    @mx.custom_function
    def fn(xd, g, b, c, h0):
        B, T, H, P, N, sg, grid, tg = dims(xd, b)
        nc = -(-T // CHECKPOINT)
        return launch.run(FAMILY, "ssd_forward", backend, [xd, g, b, c, h0, T, H, P, N],
                          [(B, T, H, P), (B, H, P, N), (B, H, nc, P, N)], [mx.float32] * 3, grid=grid,
                          threadgroup=tg, template=[("NK", _registers(N)), ("CK", CHECKPOINT)],
                          emulator_options=options)

    @fn.vjp
    def fn_vjp(primals, cotangents, outputs):
        xd, g, b, c, _ = primals
        B, T, H, P, N, sg, grid, tg = dims(xd, b)
        d_y, d_ht = (mx.contiguous(a.astype(mx.float32)) for a in cotangents[:2])
        shapes = [(B, T, H, P), (B, T, H), (B, T, H, N), (B, T, H, N), (B, H, P, N)]
        return tuple(launch.run(FAMILY, "ssd_backward", backend, [xd, g, b, c, outputs[2], d_y, d_ht, T, H, P, N],
                                shapes, [mx.float32] * len(shapes), grid=grid, threadgroup=tg,
                                template=[("NK", _registers(N)), ("CK", CHECKPOINT), ("SG", sg)],
                                init_value=0, atomic_outputs=True, emulator_options=options))

    return fn


def ssd(xd, g, b, c, h0, backend: str, emulator_options=()):
    """The scan on prepared float32 inputs: xd ``[B, T, H, P]``, g ``[B, T, H]``, b, c ``[B, T, H, N]``,
    h0 ``[B, H, P, N]``. Check `supports` first.

    Returns ``(y [B, T, H, P], state [B, H, P, N])`` (no D skip), differentiable in every input.
    """
    if xd.shape[1] == 0:
        return mx.zeros(xd.shape, mx.float32), h0
    args = [mx.contiguous(a.astype(mx.float32)) for a in (xd, g, b, c, h0)]
    y, ht, _ = _function(backend, launch.options_key(emulator_options))(*args)
    return y, ht

"""The gated delta rule on custom kernels (``metal_kernels/gated_delta.metal``), forward and backward.

`gated_delta` takes the *prepared* float32 tensors of `metalnn.functional.gated_delta_rule` (q
scaled, q/k heads already repeated to the value heads) and returns ``(o, final_state)``. It is an
``mx.custom_function`` (built once per backend and emulator options): the forward kernel also
stores the state every `CHECKPOINT` tokens, and the VJP runs the backward kernel, which recomputes
the states inside each checkpoint interval and walks the tokens in reverse. The backward kernel
accumulates dq, dk, dg and dbeta with atomic adds into zero-initialised outputs.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from . import launch

FAMILY = "gated_delta"

#: Tokens between the state checkpoints that the forward kernel stores for the backward.
CHECKPOINT = 16
#: Most SIMD groups (value columns) per threadgroup.
MAX_SIMDGROUPS = 8
#: Largest key head dimension: each lane keeps NK = ceil(K / 32) state rows in registers (and
#: CHECKPOINT times that in the backward kernel's history); the backward kernel's threadgroup
#: arrays take (2 * NK * 32 + 2) * SG floats, under 32 KiB for NK <= 8 and SG <= MAX_SIMDGROUPS.
MAX_K = 256
#: Threadgroup memory of a Metal threadgroup, in bytes.
THREADGROUP_MEMORY = 32768


def supports(q, v) -> bool:
    """Whether the kernels take prepared q ``[B, T, H, K]`` and v ``[B, T, H, V]``: ``K <= MAX_K``,
    no empty axis except T."""
    B, T, H, K = q.shape
    return 0 < K <= MAX_K and min(B, H, v.shape[-1]) > 0


def _registers(K: int) -> int:
    return -(-K // 32)


def _simdgroups(V: int) -> int:
    """The largest divisor of V that is at most MAX_SIMDGROUPS."""
    return max(d for d in range(1, min(V, MAX_SIMDGROUPS) + 1) if V % d == 0)


def _backward_simdgroups(K: int, V: int) -> int:
    """SIMD groups per threadgroup of the backward kernel: the largest divisor of V, at most
    MAX_SIMDGROUPS, whose threadgroup memory (``red_q``, ``red_k``: SG x 32 * ceil(K / 32) floats
    each, ``red_s``: SG x 2 floats) fits in THREADGROUP_MEMORY. Raises ValueError before any launch
    when not even one SIMD group fits (K > 4064; `supports` already routes K > MAX_K elsewhere)."""
    per_group = 4 * (2 * 32 * -(-K // 32) + 2)
    fits = [d for d in range(1, min(V, MAX_SIMDGROUPS) + 1) if V % d == 0 and d * per_group <= THREADGROUP_MEMORY]
    if not fits:
        raise ValueError(
            f"gated_delta_rule backward kernel: a key head dimension of {K} needs {per_group} bytes of threadgroup "
            f"memory per SIMD group, more than the {THREADGROUP_MEMORY} bytes of a Metal threadgroup (the kernel "
            "handles K <= 4064); use Device(kernels='reference') or 'auto' for this size")
    return max(fits)


@lru_cache(maxsize=None)
def _function(backend: str, options: tuple):
    def dims(q, v):
        B, T, H, K = q.shape
        V = v.shape[-1]
        sg = _simdgroups(V)
        return B, T, H, K, V, sg, (32, V, B * H), (32, sg, 1)

    @mx.custom_function
    def fn(q, k, v, g, beta, h0):
        B, T, H, K, V, sg, grid, tg = dims(q, v)
        nc = -(-T // CHECKPOINT)
        return launch.run(FAMILY, "gated_delta_forward", backend, [q, k, v, g, beta, h0, T, H, K, V],
                          [(B, T, H, V), (B, H, K, V), (B, H, nc, K, V)], [mx.float32] * 3, grid=grid,
                          threadgroup=tg, template=[("NK", _registers(K)), ("CK", CHECKPOINT)],
                          emulator_options=options)

    @fn.vjp
    def fn_vjp(primals, cotangents, outputs):
        q, k, v, g, beta, _ = primals
        B, T, H, K, V, _, grid, _ = dims(q, v)
        sg_b = _backward_simdgroups(K, V)  # the backward's threadgroup arrays must fit in 32 KiB
        d_o, d_ht = (c.astype(mx.float32) for c in cotangents[:2])
        shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H), (B, T, H), (B, H, K, V)]
        return tuple(launch.run(FAMILY, "gated_delta_backward", backend,
                                [q, k, v, g, beta, outputs[2], d_o, d_ht, T, H, K, V], shapes,
                                [mx.float32] * len(shapes), grid=grid, threadgroup=(32, sg_b, 1),
                                template=[("NK", _registers(K)), ("CK", CHECKPOINT), ("SG", sg_b)],
                                init_value=0, atomic_outputs=True, emulator_options=options))

    return fn


def gated_delta(q, k, v, g, beta, h0, backend: str, emulator_options=()):
    """The recurrence on prepared float32 inputs: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g, beta
    ``[B, T, H]``, h0 ``[B, H, K, V]``. Check `supports` first.

    Returns ``(o [B, T, H, V], state [B, H, K, V])``, differentiable in every input.
    """
    if q.shape[1] == 0:
        return mx.zeros(v.shape, mx.float32), h0
    args = [mx.contiguous(a.astype(mx.float32)) for a in (q, k, v, g, beta, h0)]
    o, ht, _ = _function(backend, launch.options_key(emulator_options))(*args)
    return o, ht

"""The gated delta rule on custom kernels (``metal_kernels/gated_delta.metal``), forward and backward.

`gated_delta` takes the *prepared* float32 tensors of `metalnn.functional.gated_delta_rule` (q
scaled, q/k heads already repeated to the value heads) and returns ``(o, final_state)``. It is an
``mx.custom_function``: the forward kernel also stores the state every `CHECKPOINT` tokens, and the
VJP runs the backward kernel, which recomputes the states inside each checkpoint interval and walks
the tokens in reverse.

The backward kernel accumulates dq, dk, dg and dbeta with atomic adds, so it is launched with
``atomic_outputs=True`` (launch.run builds plain kernels only; the two kernels here are built the
same way with that flag and recorded in ``launch.EMULATED``).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

import metal_kernels

from . import launch

FAMILY = "gated_delta"

#: Tokens between the state checkpoints that the forward kernel stores for the backward.
CHECKPOINT = 16
#: Most SIMD groups (value columns) per threadgroup.
MAX_SIMDGROUPS = 8
#: Threadgroup memory of a Metal threadgroup, in bytes.
THREADGROUP_MEMORY = 32768


@lru_cache(maxsize=None)
def _kernel(name: str, backend: str, atomic: bool):
    src = metal_kernels.load(FAMILY)[name]
    kwargs = dict(name=f"{FAMILY}_{name}", input_names=list(src.inputs), output_names=list(src.outputs),
                  source=src.body, header=src.header, atomic_outputs=atomic)
    if backend == "metal":
        return mx.fast.metal_kernel(**kwargs)
    from metal_kernels.emulator import metal_kernel

    return metal_kernel(**kwargs)


def _run(name, backend, inputs, output_shapes, grid, threadgroup, template, atomic=False, opts=None):
    kwargs = dict(output_shapes=[tuple(int(d) for d in s) for s in output_shapes],
                  output_dtypes=[mx.float32] * len(output_shapes), grid=tuple(int(d) for d in grid),
                  threadgroup=tuple(int(d) for d in threadgroup), template=list(template))
    if atomic:
        kwargs["init_value"] = 0
    if backend == "metal":
        return list(_kernel(name, backend, atomic)(inputs=list(inputs), **kwargs))
    if backend == "emulate":
        launch.EMULATED.add((FAMILY, name))
        ins = [np.array(a) if isinstance(a, mx.array) else a for a in inputs]
        outs = _kernel(name, backend, atomic)(inputs=ins, **kwargs, **(opts or {}))
        return [mx.array(np.asarray(o, dtype=np.float32)) for o in outs]
    raise ValueError(f"kernel backend must be 'metal' or 'emulate', got {backend!r}")


def _simdgroups(V: int) -> int:
    """The largest divisor of V that is at most MAX_SIMDGROUPS."""
    return max(d for d in range(1, min(V, MAX_SIMDGROUPS) + 1) if V % d == 0)


def _backward_simdgroups(K: int, V: int) -> int:
    """SIMD groups per threadgroup of the backward kernel: the largest divisor of V, at most
    MAX_SIMDGROUPS, whose threadgroup memory (``red_q``, ``red_k``: SG x 32 * ceil(K / 32) floats
    each, ``red_s``: SG x 2 floats) fits in THREADGROUP_MEMORY. Raises ValueError before any launch
    when not even one SIMD group fits (K > 4064)."""
    per_group = 4 * (2 * 32 * -(-K // 32) + 2)
    fits = [d for d in range(1, min(V, MAX_SIMDGROUPS) + 1) if V % d == 0 and d * per_group <= THREADGROUP_MEMORY]
    if not fits:
        raise ValueError(
            f"gated_delta_rule backward kernel: a key head dimension of {K} needs {per_group} bytes of threadgroup "
            f"memory per SIMD group, more than the {THREADGROUP_MEMORY} bytes of a Metal threadgroup (the kernel "
            "handles K <= 4064); use Device(kernels='reference') or 'auto' for this size")
    return max(fits)


def gated_delta(q, k, v, g, beta, h0, device):
    """Kernel-backed recurrence on prepared float32 inputs: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``,
    g, beta ``[B, T, H]``, h0 ``[B, H, K, V]``. Returns ``(o [B, T, H, V], state [B, H, K, V])``."""
    backend = device.kernels
    opts = getattr(device, "emulator_options", None)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T == 0:
        return mx.zeros(v.shape, mx.float32), h0
    nk = -(-K // 32)
    ck = CHECKPOINT  # fixed, so that T does not change the compiled variant
    nc = -(-T // ck)
    sg = _simdgroups(V)
    dims = [T, H, K, V]
    grid = (32, V, B * H)
    tg = (32, sg, 1)

    @mx.custom_function
    def fn(q, k, v, g, beta, h0):
        return _run("gated_delta_forward", backend, [q, k, v, g, beta, h0] + dims,
                    [(B, T, H, V), (B, H, K, V), (B, H, nc, K, V)], grid, tg,
                    [("NK", nk), ("CK", ck)], opts=opts)

    @fn.vjp
    def fn_vjp(primals, cotangents, outputs):
        q, k, v, g, beta, _ = primals
        d_o, d_ht = cotangents[0], cotangents[1]
        ckpt = outputs[2]
        sg_b = _backward_simdgroups(K, V)
        return tuple(_run("gated_delta_backward", backend,
                          [q, k, v, g, beta, ckpt, d_o.astype(mx.float32), d_ht.astype(mx.float32)] + dims,
                          [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H), (B, T, H), (B, H, K, V)],
                          grid, (32, sg_b, 1), [("NK", nk), ("CK", ck), ("SG", sg_b)], atomic=True, opts=opts))

    args = [mx.contiguous(a.astype(mx.float32)) for a in (q, k, v, g, beta, h0)]
    o, ht, _ = fn(*args)
    return o, ht

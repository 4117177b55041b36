"""RMSNorm on custom kernels (``metal_kernels/rms_norm.metal``), forward and backward."""

from __future__ import annotations

import mlx.core as mx

from .launch import run, threads_for_row

FAMILY = "rms_norm"


def rms_norm(x, weight, eps, device):
    """Kernel-backed ``F.rms_norm``: x ``[..., D]``, weight ``[D]`` or None."""
    backend = device.kernels
    opts = getattr(device, "emulator_options", None)
    D = x.shape[-1]
    has_weight = weight is not None
    w = weight if has_weight else mx.ones((D,), dtype=x.dtype)
    eps = float(eps)

    def flat(a):
        return a.reshape(-1, D)

    @mx.custom_function
    def fn(x, w):
        x2 = flat(x)
        rows = x2.shape[0]
        tg = threads_for_row(D)
        (y,) = run(FAMILY, "rms_norm_forward", backend, [x2, w, eps, D], [x2.shape], [x.dtype],
                   grid=(rows * tg, 1, 1), threadgroup=(tg, 1, 1),
                   template=[("T", x.dtype), ("WT", w.dtype)], emulator_options=opts)
        return y.reshape(x.shape)

    @fn.vjp
    def fn_vjp(primals, cotangent, output):
        x, w = primals
        x2, dy = flat(x), flat(cotangent).astype(x.dtype)
        rows = x2.shape[0]
        tg = threads_for_row(D)
        dx, rstd = run(FAMILY, "rms_norm_backward_dx", backend, [x2, w, dy, eps, D],
                       [x2.shape, (rows,)], [x.dtype, mx.float32], grid=(rows * tg, 1, 1), threadgroup=(tg, 1, 1),
                       template=[("T", x.dtype), ("WT", w.dtype)], emulator_options=opts)
        (dw,) = run(FAMILY, "rms_norm_backward_dw", backend, [x2, dy, rstd, rows, D], [(D,)], [w.dtype],
                    grid=(D, 1, 1), threadgroup=(tg, 1, 1), template=[("T", x.dtype), ("WT", w.dtype)],
                    emulator_options=opts)
        return dx.reshape(x.shape), dw

    return fn(x, w)

"""RMSNorm on custom kernels (``metal_kernels/rms_norm.metal``), forward and backward.

`rms_norm` is an ``mx.custom_function`` (built once per backend, ``eps`` and emulator options):
``rms_norm_forward`` writes ``y``; the VJP runs ``rms_norm_backward_dx`` (``dx`` and the per-row
``rstd``) and then ``rms_norm_backward_dw`` (``dw``, summed over the rows).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from . import launch

FAMILY = "rms_norm"
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def supports(x, weight) -> bool:
    """Whether the kernels take ``x [..., D]`` and ``weight [D]`` (or None): float dtypes, not empty."""
    return (x.ndim >= 1 and x.size > 0 and x.dtype in DTYPES
            and (weight is None or weight.dtype in DTYPES))


@lru_cache(maxsize=None)
def _function(backend: str, eps: float, options: tuple):
    def launch_kernel(name, inputs, shapes, dtypes, rows, width, x_dtype, w_dtype, grid_x):
        return launch.run(FAMILY, name, backend, inputs, shapes, dtypes, grid=(grid_x, 1, 1),
                          threadgroup=(width, 1, 1), template=[("T", x_dtype), ("WT", w_dtype)],
                          emulator_options=options)

    @mx.custom_function
    def fn(x, w):
        D = x.shape[-1]
        x2 = x.reshape(-1, D)
        rows, tg = x2.shape[0], launch.threads_for_row(D)
        (y,) = launch_kernel("rms_norm_forward", [x2, w, eps, D], [x2.shape], [x.dtype], rows, tg, x.dtype,
                             w.dtype, rows * tg)
        return y.reshape(x.shape)

    @fn.vjp
    def fn_vjp(primals, cotangent, output):
        x, w = primals
        D = x.shape[-1]
        x2, dy = x.reshape(-1, D), cotangent.reshape(-1, D).astype(x.dtype)
        rows, tg = x2.shape[0], launch.threads_for_row(D)
        dx, rstd = launch_kernel("rms_norm_backward_dx", [x2, w, dy, eps, D], [x2.shape, (rows,)],
                                 [x.dtype, mx.float32], rows, tg, x.dtype, w.dtype, rows * tg)
        (dw,) = launch_kernel("rms_norm_backward_dw", [x2, dy, rstd, rows, D], [(D,)], [w.dtype], rows, tg,
                              x.dtype, w.dtype, D)
        return dx.reshape(x.shape), dw

    return fn


def rms_norm(x, weight, eps: float, backend: str, emulator_options=()):
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` on the kernels: x ``[..., D]``, weight ``[D]`` or None.

    Check `supports` first. Returns ``[..., D]`` in ``x.dtype``; differentiable in x and weight.
    """
    w = weight if weight is not None else mx.ones((x.shape[-1],), dtype=x.dtype)
    return _function(backend, float(eps), launch.options_key(emulator_options))(x, w)

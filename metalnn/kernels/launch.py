"""Run a kernel from ``metal_kernels`` on Metal or on the CPU emulator, from the same source text."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

import metal_kernels


#: (family, kernel) pairs run through the emulator in this process (the test suite checks that
#: every kernel in ``metal_kernels`` is among them).
EMULATED = set()


@lru_cache(maxsize=None)
def _metal_kernel(family: str, name: str):
    src = metal_kernels.load(family)[name]
    return mx.fast.metal_kernel(name=f"{family}_{name}", input_names=list(src.inputs),
                                output_names=list(src.outputs), source=src.body, header=src.header)


@lru_cache(maxsize=None)
def _emulated_kernel(family: str, name: str):
    from metal_kernels.emulator import metal_kernel

    src = metal_kernels.load(family)[name]
    return metal_kernel(name=f"{family}_{name}", input_names=list(src.inputs), output_names=list(src.outputs),
                        source=src.body, header=src.header)


def _to_emulator(a):
    if isinstance(a, mx.array):
        if a.dtype == mx.bfloat16:
            return a  # the emulator converts bfloat16 MLX arrays itself
        return np.array(a)
    return a


def run(family: str, name: str, backend: str, inputs, output_shapes, output_dtypes, grid, threadgroup,
        template=(), init_value=None, emulator_options=None):
    """Launch kernel ``name`` of ``family``; returns a list of ``mx.array`` outputs.

    ``backend`` is ``"metal"`` (``mx.fast.metal_kernel``) or ``"emulate"`` (CPU emulator; the inputs
    are evaluated, so this path is eager and cannot run inside ``mx.compile``).
    """
    kwargs = dict(output_shapes=[tuple(int(v) for v in s) for s in output_shapes],
                  output_dtypes=list(output_dtypes), grid=tuple(int(v) for v in grid),
                  threadgroup=tuple(int(v) for v in threadgroup), template=list(template))
    if init_value is not None:
        kwargs["init_value"] = init_value
    if backend == "metal":
        return list(_metal_kernel(family, name)(inputs=list(inputs), **kwargs))
    if backend == "emulate":
        kernel = _emulated_kernel(family, name)
        EMULATED.add((family, name))
        outs = kernel(inputs=[_to_emulator(a) for a in inputs], **kwargs, **(emulator_options or {}))
        return [mx.array(np.asarray(o)).astype(dt) for o, dt in zip(outs, output_dtypes)]
    raise ValueError(f"kernel backend must be 'metal' or 'emulate', got {backend!r}")


def threads_for_row(n: int, limit: int = 256) -> int:
    """Threadgroup width for a row of ``n`` elements: a multiple of 32, at most ``limit``."""
    return int(min(limit, max(32, -(-n // 32) * 32)))

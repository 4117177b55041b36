"""The one launcher of metalnn's custom kernels: Metal or the CPU emulator, from the same source text.

`run` launches kernel ``name`` of ``metal_kernels/<family>.metal`` on backend ``"metal"``
(``mx.fast.metal_kernel``) or ``"emulate"`` (`metal_kernels.emulator`). Kernel objects are built
once per ``(family, name, atomic_outputs)`` and reused.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

import metal_kernels

BACKENDS = ("metal", "emulate")


def _source(family: str, name: str, atomic_outputs: bool) -> dict:
    src = metal_kernels.load(family)[name]
    return dict(name=f"{family}_{name}", input_names=list(src.inputs), output_names=list(src.outputs),
                source=src.body, header=src.header, atomic_outputs=atomic_outputs)


@lru_cache(maxsize=None)
def metal_kernel(family: str, name: str, atomic_outputs: bool = False):
    """The ``mx.fast.metal_kernel`` object of one kernel."""
    return mx.fast.metal_kernel(**_source(family, name, atomic_outputs))


@lru_cache(maxsize=None)
def emulated_kernel(family: str, name: str, atomic_outputs: bool = False):
    """The emulator's stand-in for one kernel (same text, same call)."""
    from metal_kernels.emulator import metal_kernel as emulator_kernel

    return emulator_kernel(**_source(family, name, atomic_outputs))


def _to_emulator(a):
    if isinstance(a, mx.array):
        if a.dtype == mx.bfloat16:
            return a  # the emulator converts bfloat16 MLX arrays itself
        return np.array(a)
    return a


def options_key(options) -> tuple:
    """Emulator options (a dict or pairs) as a sorted tuple: hashable, for caches keyed by them."""
    return tuple(sorted(dict(options or {}).items()))


def run(family: str, name: str, backend: str, inputs, output_shapes, output_dtypes, grid, threadgroup,
        template=(), init_value=None, atomic_outputs: bool = False, emulator_options=()):
    """Launch kernel ``name`` of ``family``; returns the outputs as a list of ``mx.array``.

    Args:
        backend: ``"metal"`` (``mx.fast.metal_kernel``; needs Metal) or ``"emulate"`` (the CPU
            emulator; evaluates the inputs, so this path is eager and cannot run inside
            ``mx.compile``).
        inputs: arrays and Python scalars, in the order of the kernel's ``@inputs`` line.
        output_shapes, output_dtypes: one per ``@outputs`` name.
        grid, threadgroup: threads in the grid and per threadgroup, ``(x, y, z)``.
        template: ``[(name, dtype | int | bool), ...]``.
        init_value: fill value of the outputs before the launch (default: uninitialised).
        atomic_outputs: the outputs are ``device atomic<T>*`` (give ``init_value`` too).
        emulator_options: extra keywords of the emulator (``lane_order``, ``seed``, ...).
    """
    kwargs = dict(output_shapes=[tuple(int(v) for v in s) for s in output_shapes],
                  output_dtypes=list(output_dtypes), grid=tuple(int(v) for v in grid),
                  threadgroup=tuple(int(v) for v in threadgroup), template=list(template))
    if init_value is not None:
        kwargs["init_value"] = init_value
    if backend == "metal":
        if not mx.metal.is_available():
            raise RuntimeError(f"kernel {family}.{name}: backend 'metal' needs Metal (macOS on Apple Silicon); "
                               f"use kernels='emulate' to run the kernel text on the CPU emulator")
        return list(metal_kernel(family, name, bool(atomic_outputs))(inputs=list(inputs), **kwargs))
    if backend == "emulate":
        kernel = emulated_kernel(family, name, bool(atomic_outputs))
        outs = kernel(inputs=[_to_emulator(a) for a in inputs], **kwargs, **dict(emulator_options or {}))
        return [mx.array(np.asarray(o)).astype(dt) for o, dt in zip(outs, output_dtypes)]
    raise ValueError(f"kernel {family}.{name}: backend must be one of {BACKENDS}, got {backend!r}")


def threads_for_row(n: int, limit: int = 256) -> int:
    """Threadgroup width for a row of ``n`` elements: a multiple of 32, at most ``limit``."""
    return int(min(limit, max(32, -(-n // 32) * 32)))

"""Rotary position embeddings."""

from __future__ import annotations

import mlx.core as mx

from ..cpu import fused
from ..device import resolve
from ..kernels import rope as kernels
from ..kernels.op_math import rope_frequencies
from ._dispatch import emulator_options, fused_cpu, kernel_backend, on_cpu
from .rope_table import rope_cached

__all__ = ["rope", "rope_reference", "rope_frequencies"]


def rope_reference(x, dims: int, traditional: bool = False, base: float = 10000.0, scale: float = 1.0,
                   offset=0, freqs=None):
    """RoPE in plain MLX ops; same semantics as ``mx.fast.rope``.

    Args:
        x: ``[..., T, D]``; the first ``dims`` features of each position are rotated.
        traditional: rotate interleaved pairs ``(0,1), (2,3)...`` instead of halves ``(i, i + dims/2)``.
        offset: position of the first row (an int or a 0-d int array; KV-cache decoding), or one
            position per sequence: an int array ``[B]`` for ``x`` ``[B, ..., T, D]`` (a batch of
            sequences of different lengths).
        freqs: optional custom frequencies (as ``mx.fast.rope``'s ``freqs``: periods, inverted here).
    """
    T = x.shape[-2]
    inv = rope_frequencies(dims, base, freqs)
    offset = mx.array(offset).astype(mx.float32)
    pos = (mx.arange(T, dtype=mx.float32) + offset[..., None]) * scale  # [T], or [B, T] per sequence
    theta = pos[..., None] * inv
    if offset.ndim == 1:  # [B, T, dims/2] -> [B, 1..., T, dims/2]
        theta = theta.reshape(theta.shape[0], *([1] * (x.ndim - 3)), T, -1)
    cos, sin = mx.cos(theta), mx.sin(theta)
    xf = x.astype(mx.float32)
    rot, rest = xf[..., :dims], xf[..., dims:]
    if traditional:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        r1 = x1 * cos - x2 * sin
        r2 = x1 * sin + x2 * cos
        rot = mx.stack([r1, r2], axis=-1).reshape(rot.shape)
    else:
        half = dims // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        rot = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    out = mx.concatenate([rot, rest], axis=-1) if dims < x.shape[-1] else rot
    return out.astype(x.dtype)


def _rope_mlx(x, dims, traditional, base, scale, offset, freqs):
    """``mx.fast.rope`` (which wants at least 3 axes) on ``x [..., T, D]``."""
    x3 = x.reshape(-1, *x.shape[-2:]) if x.ndim != 3 else x
    if freqs is not None:
        freqs, base = mx.array(freqs, dtype=mx.float32), None
    y = mx.fast.rope(x3, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
    return y.reshape(x.shape)


def rope(x, dims: int, traditional: bool = False, base: float = 10000.0, scale: float = 1.0, offset=0,
         freqs=None, device=None):
    """Rotary position embedding of ``x`` ``[..., T, D]``; same semantics as ``mx.fast.rope``.

    Differentiable in ``x``. Implementation by ``device.kernels``: ``"reference"`` `rope_reference`;
    ``"auto"`` ``mx.fast.rope``, on the CPU backend for float32 with an int offset
    `metalnn.cpu.fused.rope` (one multi-threaded pass that also makes the result row-contiguous, e.g.
    for the transposed view of split heads, and stores the gradient in the input's memory order;
    ``scripts/bench_kernels.py --ops rope --cpu-time``, one thread, ``[4, 16, 512, 128]``: about 4x
    less CPU time forward+backward than ``mx.fast.rope``), and for other float dtypes with an int
    ``offset >= 0`` `metalnn.functional.rope_table.rope_cached` (cached sine/cosine tables; one
    ``[D, D]`` product per call when decoding: MLX's CPU ``mx.fast.rope`` rebuilds a ~30-op graph per
    call); ``"metal"``/``"emulate"`` the kernel of
    `metalnn.kernels.rope` (float32/float16/bfloat16, non-empty), else ``"auto"``.
    """
    device = resolve(device)
    if x.ndim < 2:
        raise ValueError(f"rope: x must be [..., T, D], got shape {tuple(x.shape)}")
    if dims % 2 or dims <= 0 or dims > x.shape[-1]:
        raise ValueError(f"rope: dims must be even and in (0, {x.shape[-1]}], got {dims}")
    if isinstance(offset, mx.array) and offset.ndim == 1:  # one position per sequence
        if x.ndim < 3 or offset.shape[0] != x.shape[0]:
            raise ValueError(f"rope: per-sequence offsets {tuple(offset.shape)} need x [B, ..., T, D] with the same "
                             f"B, got shape {tuple(x.shape)}")
        if device.kernels == "reference":
            return rope_reference(x, dims, traditional, base, scale, offset, freqs)
        if freqs is not None:
            freqs, base = mx.array(freqs, dtype=mx.float32), None
        return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
    if device.kernels == "reference":
        return rope_reference(x, dims, traditional, base, scale, offset, freqs)
    backend = kernel_backend(device)
    if backend and kernels.supports(x, dims):
        return kernels.rope(x, dims, traditional, base, scale, offset, freqs, backend, emulator_options(device))
    if fused_cpu(x) and isinstance(offset, int) and x.size:
        return fused.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
    if (on_cpu() and isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0
            and mx.issubdtype(x.dtype, mx.floating)):
        return rope_cached(x, dims, traditional, base, scale, offset, freqs)
    return _rope_mlx(x, dims, traditional, base, scale, offset, freqs)

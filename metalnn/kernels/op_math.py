"""Arithmetic shared by the ops (`metalnn.functional`) and their custom kernels (`metalnn.kernels`).

A leaf module: it imports nothing from metalnn, so both packages can use it without importing each
other.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["rope_frequencies", "conv_output_size", "conv_transpose_output_size"]


def rope_frequencies(dims: int, base: float = 10000.0, freqs=None):
    """Inverse frequencies ``base^(-2i/dims)`` for ``i < dims/2``, float32 ``[dims/2]``.

    ``freqs`` (as ``mx.fast.rope``'s argument: periods, one per rotated pair) replaces the
    geometric series; its inverse is returned.
    """
    if freqs is not None:
        return 1.0 / mx.array(freqs, dtype=mx.float32)
    return mx.power(mx.array(base, mx.float32), -mx.arange(0, dims, 2, dtype=mx.float32) / dims)


def conv_output_size(size: int, kernel: int, stride: int = 1, padding: int = 0, dilation: int = 1) -> int:
    """Output length of a convolution along one axis: ``(in + 2p - d(k-1) - 1) // s + 1``."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def conv_transpose_output_size(size: int, kernel: int, stride: int = 1, padding: int = 0, output_padding: int = 0,
                               dilation: int = 1) -> int:
    """Output length of a transposed convolution: ``(in-1)s - 2p + d(k-1) + output_padding + 1``."""
    return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1

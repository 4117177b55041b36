"""What every GGML tensor type shares: its block layout, its registration and the byte readers its
decoder is written with.

A GGML tensor is stored row by row; a row of ``cols`` values is ``cols / block_size`` blocks of
``type_size`` bytes each. A type's `GGMLType.decode` turns blocks into floats with MLX ops (so it runs
on every MLX device, lazily, inside the graph): ``uint8 [..., type_size] -> float32 [..., block_size]``,
bit-exact with ggml's reference dequantization (``ggml-quants.c``), which the tests check against
gguf-py's NumPy version.

The other direction, `GGMLType.encode`, is NumPy (it runs once, when a model is written): float rows ->
packed blocks, byte for byte as ggml's reference quantizers (``quantize_row_*_ref``) write them, which
is what ``llama-quantize`` writes when it is given no importance matrix. Encoders keep ggml's float32
operations in ggml's order (sums accumulated element by element, no fused multiply-adds) so that the
bytes are identical, and are vectorised over blocks.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import mlx.core as mx
import numpy as np

#: type name ("Q4_K") -> class, and GGUF type id -> class, filled by `GGMLType.__init_subclass__`
TYPES: dict = {}
BY_ID: dict = {}


class GGMLType:
    """One GGML tensor type: block layout and decoder. Subclasses are declared with
    ``class Q8_0(GGMLType, type_id=8, block_size=32, type_size=34)`` and implement `decode_blocks`."""

    name: ClassVar[str]
    type_id: ClassVar[int]
    block_size: ClassVar[int]
    type_size: ClassVar[int]

    def __init_subclass__(cls, *, type_id: int, block_size: int, type_size: int, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.name, cls.type_id, cls.block_size, cls.type_size = cls.__name__, type_id, block_size, type_size
        if cls.name in TYPES or type_id in BY_ID:
            raise TypeError(f"GGML type {cls.name} (id {type_id}) is declared twice")
        TYPES[cls.name] = cls
        BY_ID[type_id] = cls

    def __init__(self):
        raise TypeError(f"{type(self).__name__} is a description of a GGML type: use its class methods")

    @classmethod
    def decode_blocks(cls, blocks: mx.array) -> mx.array:
        """``uint8 [n, type_size] -> float32 [n, block_size]`` (implemented by each type)."""
        raise NotImplementedError

    @classmethod
    def encode_blocks(cls, values: np.ndarray) -> np.ndarray:
        """``float32 [n, block_size] -> uint8 [n, type_size]`` with NumPy, as ggml's reference quantizer
        (implemented by the types that can be written)."""
        raise NotImplementedError(f"{cls.name}: no encoder (types that can be written: "
                                  f"{', '.join(encodable_types())})")

    @classmethod
    def can_encode(cls) -> bool:
        """Whether this type has an encoder."""
        return cls.encode_blocks.__func__ is not GGMLType.encode_blocks.__func__

    @classmethod
    def row_bytes(cls, cols: int) -> int:
        """Bytes of one row of ``cols`` values; raises ValueError when ``cols`` is not whole blocks."""
        if cols % cls.block_size:
            raise ValueError(f"{cls.name}: a row of {cols} values is not a whole number of "
                             f"{cls.block_size}-value blocks")
        return cols // cls.block_size * cls.type_size

    @classmethod
    def decode(cls, data: mx.array) -> mx.array:
        """``uint8 [..., k * type_size] -> float32 [..., k * block_size]``: the values of packed rows."""
        if data.dtype != mx.uint8:
            raise TypeError(f"{cls.name}.decode: packed data must be uint8, got {data.dtype}")
        if data.shape[-1] % cls.type_size:
            raise ValueError(f"{cls.name}.decode: {data.shape[-1]} bytes per row is not a whole number of "
                             f"{cls.type_size}-byte blocks")
        lead = data.shape[:-1]
        blocks = data.reshape(-1, cls.type_size)
        out = cls.decode_blocks(blocks)
        return out.reshape(*lead, data.shape[-1] // cls.type_size * cls.block_size)

    #: values encoded per `encode_blocks` call: small enough for the working arrays to stay in cache
    encode_chunk: ClassVar[int] = 1 << 16

    @classmethod
    def encode(cls, rows, threads: int | None = None) -> np.ndarray:
        """``float [..., k * block_size] -> uint8 [..., k * type_size]``: rows packed as ggml's reference
        quantizer packs them (NumPy in, NumPy out; an `mx.array` is accepted too). The values are taken
        as float32, as ggml quantizes them. Quantized types refuse non-finite values (ggml's quantizers
        would write meaningless blocks for them); the float types store them.

        Blocks are encoded in chunks of `encode_chunk` values, on up to ``threads`` threads (NumPy
        releases the GIL in its loops; default: the machine's cores, at most 8). Blocks are independent,
        so the bytes do not depend on the number of threads."""
        if not cls.can_encode():
            cls.encode_blocks(None)  # raises, naming the types that can be written
        if isinstance(rows, mx.array):
            if not mx.issubdtype(rows.dtype, mx.floating):
                raise TypeError(f"{cls.name}.encode: values must be floating point, got {rows.dtype}")
            rows = np.array(rows.astype(mx.float32))
        rows = np.asarray(rows)
        if rows.dtype.kind != "f":
            raise TypeError(f"{cls.name}.encode: values must be floating point, got {rows.dtype}")
        if rows.ndim == 0:
            raise ValueError(f"{cls.name}.encode: a scalar is not a row")
        if rows.shape[-1] % cls.block_size:
            raise ValueError(f"{cls.name}.encode: {rows.shape[-1]} values per row is not a whole number of "
                             f"{cls.block_size}-value blocks")
        values = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, cls.block_size)
        if cls.block_size > 1 and not np.isfinite(values).all():
            raise ValueError(f"{cls.name}.encode: the values hold NaN or infinity, which {cls.name} "
                             f"cannot represent")
        out = np.empty((values.shape[0], cls.type_size), dtype=np.uint8)
        step = max(1, cls.encode_chunk // cls.block_size)
        starts = range(0, len(values), step)

        def run(start):
            with np.errstate(all="ignore"):  # ggml divides by zero and discards the result in places
                out[start:start + step] = cls.encode_blocks(values[start:start + step])

        threads = min(8, os.cpu_count() or 1) if threads is None else threads
        if threads > 1 and len(starts) > 1:
            with ThreadPoolExecutor(min(threads, len(starts))) as pool:
                list(pool.map(run, starts))
        else:
            for start in starts:
                run(start)
        return out.reshape(*rows.shape[:-1], rows.shape[-1] // cls.block_size * cls.type_size)


def encodable_types() -> list:
    """Names of the types `GGMLType.encode` can write."""
    return sorted(name for name, cls in TYPES.items() if cls.can_encode())


def get_type(name_or_id) -> type:
    """The `GGMLType` class for a name (``"Q4_K"``) or a GGUF type id; KeyError names the known ones."""
    table = BY_ID if isinstance(name_or_id, int) else TYPES
    try:
        return table[name_or_id]
    except KeyError:
        raise KeyError(f"unknown GGML type {name_or_id!r}; known: {', '.join(sorted(TYPES))}") from None


# -- byte readers for decoders: blocks is uint8 [n, type_size] ------------------------------------------

def f16(blocks: mx.array, offset: int) -> mx.array:
    """The little-endian float16 at ``offset`` of each block, as float32 ``[n, 1]``."""
    return mx.view(mx.contiguous(blocks[:, offset:offset + 2]), mx.float16).astype(mx.float32)


def f16s(blocks: mx.array, offset: int, count: int) -> mx.array:
    """``count`` float16 values from ``offset``, as float32 ``[n, count]``."""
    return mx.view(mx.contiguous(blocks[:, offset:offset + 2 * count]), mx.float16).astype(mx.float32)


def u16s(blocks: mx.array, offset: int, count: int) -> mx.array:
    """``count`` little-endian uint16 values from ``offset``, as uint32 ``[n, count]``."""
    return mx.view(mx.contiguous(blocks[:, offset:offset + 2 * count]), mx.uint16).astype(mx.uint32)


def u32s(blocks: mx.array, offset: int, count: int) -> mx.array:
    """``count`` little-endian uint32 values from ``offset``: ``[n, count]``."""
    return mx.view(mx.contiguous(blocks[:, offset:offset + 4 * count]), mx.uint32)


def i8s(blocks: mx.array, offset: int, count: int) -> mx.array:
    """``count`` int8 values from ``offset``, as float32 ``[n, count]``."""
    return mx.view(mx.contiguous(blocks[:, offset:offset + count]), mx.int8).astype(mx.float32)


def u8s(blocks: mx.array, offset: int, count: int) -> mx.array:
    """``count`` bytes from ``offset``, as uint32 ``[n, count]`` (room for shifts)."""
    return blocks[:, offset:offset + count].astype(mx.uint32)


def nibbles(packed: mx.array) -> mx.array:
    """``[n, m]`` bytes -> ``[n, 2m]``: the low nibbles of all bytes, then the high nibbles (ggml's order
    for 4-bit values: value ``j`` in the low nibble of byte ``j``, value ``j + m`` in its high one)."""
    return mx.concatenate([packed & 0xF, packed >> 4], axis=-1)


# -- NumPy helpers for encoders: ggml's float32 arithmetic, operation for operation ---------------------

F32 = np.float32


def nearest_int(values: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: add 1.5 * 2**23 in float32 and read the low mantissa bits, which rounds
    half to even for ``|x| <= 2**22 - 1`` (and is reproduced bit for bit beyond that, where ggml
    assumes it is not called): int32 array."""
    bits = (np.asarray(values, dtype=F32) + F32(12582912.0)).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def seq_sum(terms: np.ndarray, start=None) -> np.ndarray:
    """``terms [m, n] -> [n]``: the sum over the first axis accumulated one term after another in
    float32, as ggml's loops ``s += t`` do. ``start=None`` begins from ``terms[0]`` (ggml's
    ``s = t[0]`` followed by a loop from 1), a number begins from that value (``s = 0``).

    NumPy sums pairwise (a different rounding) only along a contiguous axis; reducing over the first
    axis of a C-contiguous array adds row after row into the running totals, in order, which the
    tests check against an explicit loop. Other layouts take the explicit loop."""
    if terms.ndim == 2 and terms.flags.c_contiguous:
        if start is None:
            return np.add.reduce(terms, axis=0)
        return np.add.reduce(terms, axis=0, initial=F32(start))
    if start is None:
        total = terms[0].copy()
        rest = terms[1:]
    else:
        total = np.full(terms.shape[1:], start, dtype=F32)
        rest = terms
    for term in rest:
        total += term
    return total


def first_abs_max(values: np.ndarray, axis: int = -1):
    """ggml's ``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }`` from ``amax = max = 0``: the
    largest magnitude and the first value of that magnitude (0 where all are zero), as two arrays with
    ``axis`` removed."""
    mags = np.abs(values)
    where = np.argmax(mags, axis=axis)
    pick = np.take_along_axis(values, np.expand_dims(where, axis), axis=axis).squeeze(axis)
    amax = np.take_along_axis(mags, np.expand_dims(where, axis), axis=axis).squeeze(axis)
    return amax, np.where(amax > 0, pick, F32(0.0)).astype(F32)


def to_f16(values: np.ndarray) -> np.ndarray:
    """float32 -> the float16 ggml's ``GGML_FP32_TO_FP16`` stores (round to nearest even; NaN as a
    quiet NaN of the same sign), as ``uint16``."""
    values = np.asarray(values, dtype=F32)
    half = values.astype(np.float16).view(np.uint16)
    if np.isnan(values).any():
        sign = (values.view(np.uint32) >> 16).astype(np.uint16) & np.uint16(0x8000)
        half = np.where(np.isnan(values), sign | np.uint16(0x7E00), half)
    return half


def f16_bytes(values: np.ndarray) -> np.ndarray:
    """``float32 [n] -> uint8 [n, 2]``: the little-endian float16 field of each block."""
    return to_f16(values).astype("<u2").view(np.uint8).reshape(-1, 2)


def f16_round(values: np.ndarray) -> np.ndarray:
    """float32 values rounded through float16 and back (``GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(x))``)."""
    return to_f16(values).view(np.float16).astype(F32)


def u32_bytes(values: np.ndarray) -> np.ndarray:
    """``uint32 [n] -> uint8 [n, 4]`` little-endian."""
    return np.asarray(values, dtype="<u4").view(np.uint8).reshape(-1, 4)


def pack_nibbles(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Two arrays of 4-bit values -> bytes ``low | high << 4``."""
    return (low.astype(np.uint8) & 0xF) | ((high.astype(np.uint8) & 0xF) << 4)

"""What every GGML tensor type shares: its block layout, its registration and the byte readers its
decoder is written with.

A GGML tensor is stored row by row; a row of ``cols`` values is ``cols / block_size`` blocks of
``type_size`` bytes each. A type's `GGMLType.decode` turns blocks into floats with MLX ops (so it runs
on every MLX device, lazily, inside the graph): ``uint8 [..., type_size] -> float32 [..., block_size]``,
bit-exact with ggml's reference dequantization (``ggml-quants.c``), which the tests check against
gguf-py's NumPy version.
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx

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

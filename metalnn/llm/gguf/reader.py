"""Reading GGUF files (llama.cpp's model format): header, metadata and tensors.

`read_header(path)` parses the header without loading tensor data: the metadata (``{key: value}``
with Python ints, floats, bools, strings and lists; arrays of strings as `StringArray`s) and every
tensor's type, shape and byte range,
checked against the file size. `metalnn.llm.gguf.tensors.read_tensors` then reads the tensors
themselves, kept packed.

Layout (GGUF v2/v3, little endian): ``"GGUF"``, version u32, tensor count u64, metadata count
u64, the metadata key/value pairs, the tensor infos (name, dims, type, offset), then the tensor data
from the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from array import array
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from ...errors import WeightLoadError

#: ggml tensor type id -> (name, elements per block, bytes per block)
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass
class TensorInfo:
    """One tensor of a GGUF file: type name, shape in row-major order (``[rows, cols]``, llama.cpp
    lists dims fastest first), and its byte range in the file."""

    name: str
    type: str
    shape: tuple
    offset: int
    nbytes: int


_decode_utf8 = partial(str, encoding="utf-8", errors="replace")


class StringArray(Sequence):
    """A GGUF array of strings, kept as its bytes and each item's byte range; items decode (UTF-8,
    invalid bytes replaced) when read. SmolLM2's 49,152 tokens take 1.5 MiB this way, 4.0 MiB as a
    list of ``str`` (whose freed memory the process often keeps). It compares equal to a list of
    the same strings.
    """

    __slots__ = ("_blob", "_starts", "_ends")
    __hash__ = None

    def __init__(self, blob: bytes, starts: array, ends: array):
        self._blob, self._starts, self._ends = blob, starts, ends

    @classmethod
    def of(cls, strings) -> "StringArray":
        """A `StringArray` of Python strings."""
        parts = [s.encode("utf-8") for s in strings]
        starts, ends, at = array("q"), array("q"), 0
        for b in parts:
            starts.append(at)
            at += len(b)
            ends.append(at)
        return cls(b"".join(parts), starts, ends)

    def __len__(self) -> int:
        return len(self._starts)

    def _item(self, i: int) -> str:
        return _decode_utf8(self._blob[self._starts[i]:self._ends[i]])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._item(k) for k in range(*i.indices(len(self)))]
        n = len(self)
        k = i + n if i < 0 else i
        if not 0 <= k < n:
            raise IndexError(f"StringArray index {i} out of range ({n} items)")
        return self._item(k)

    def __iter__(self):
        # in C throughout (no Python frame per item): slice, cut, decode
        return map(_decode_utf8, map(self._blob.__getitem__, map(slice, self._starts, self._ends)))

    def index(self, value, start: int = 0, stop: int | None = None) -> int:
        """The first position of ``value`` in ``[start, stop)`` (a byte search, no item decoded);
        ValueError when absent."""
        n = len(self)
        stop = n if stop is None else min(stop, n)
        if isinstance(value, str) and value:
            needle = value.encode("utf-8")
            at = self._blob.find(needle)
            while at >= 0:
                k = bisect_left(self._starts, at)
                while k < n and self._starts[k] == at:  # empty items share a start
                    if self._ends[k] - at == len(needle) and start <= k < stop:
                        return k
                    k += 1
                at = self._blob.find(needle, at + 1)
        for k in range(max(start, 0), stop):  # the empty string, or bytes that are not UTF-8
            if self._item(k) == value:
                return k
        raise ValueError(f"{value!r} is not in the array")

    def __contains__(self, value) -> bool:
        try:
            self.index(value)
        except ValueError:
            return False
        return True

    def __eq__(self, other):
        if isinstance(other, (StringArray, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"StringArray([{head}{', ...' if len(self) > 3 else ''}], {len(self)} strings)"


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict
    tensors: dict  # name -> TensorInfo
    data_offset: int

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


class _Reader:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what):
        raise WeightLoadError(source=str(self.path), message=(
            f"{self.path}: corrupt or truncated GGUF file ({what} at byte {self.pos}, file size {len(self.buf)})"))

    def unpack(self, fmt):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            self.fail("unexpected end of file")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self):
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            self.fail(f"string of {n} bytes runs past the end")
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return s.decode("utf-8")
        except UnicodeDecodeError:
            return s.decode("utf-8", errors="replace")

    def strings(self, n) -> StringArray:
        """``n`` strings (each a u64 length and its bytes) as one `StringArray`."""
        buf, pos, size = self.buf, self.pos, len(self.buf)
        first = pos
        starts, ends = array("q"), array("q")
        unpack, add_start, add_end = struct.Struct("<Q").unpack_from, starts.append, ends.append
        try:
            for _ in range(n):
                (k,) = unpack(buf, pos)
                pos += 8
                if pos + k > size:
                    self.pos = pos
                    self.fail(f"string of {k} bytes runs past the end")
                add_start(pos - first)
                pos += k
                add_end(pos - first)
        except struct.error:  # a length past the end
            self.pos = pos
            self.fail("unexpected end of file")
        self.pos = pos
        return StringArray(bytes(buf[first:pos]), starts, ends)

    def value(self, vtype):
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, n = self.unpack("<I"), self.unpack("<Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
                end = self.pos + n * dt.itemsize
                if end > len(self.buf):
                    self.fail(f"array of {n} values runs past the end")
                arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
                self.pos = end
                return arr.tolist()
            if etype == 8:
                return self.strings(n)
            if etype == 9:
                return [self.value(9) for _ in range(n)]
            self.fail(f"unknown array element type {etype}")
        self.fail(f"unknown metadata value type {vtype}")


def read_header(path) -> GGUFHeader:
    """Parse and validate a GGUF file's header; no tensor data is read.

    Raises `WeightLoadError` for a file that is not GGUF, is truncated (a metadata value or a
    tensor's bytes run past the end) or has tensor types unknown to ggml.
    """
    path = Path(path)
    if not path.is_file():
        raise WeightLoadError(source=str(path), message=f"{path}: no such file")
    with open(path, "rb") as f:
        size = path.stat().st_size
        if size < 24:
            raise WeightLoadError(source=str(path), message=f"{path}: not a GGUF file (only {size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            buf = memoryview(mm)
            try:
                return _parse(buf, path, size)
            finally:
                buf.release()


def _parse(buf, path, size):
    r = _Reader(buf, path)
    if bytes(buf[:4]) != b"GGUF":
        raise WeightLoadError(source=str(path), message=f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
    r.pos = 4
    version = r.unpack("<I")
    if version not in (2, 3):
        raise WeightLoadError(source=str(path), message=f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
    if n_tensors > 10_000_000 or n_kv > 10_000_000:
        r.fail(f"implausible counts ({n_tensors} tensors, {n_kv} metadata entries)")
    metadata = {}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = r.value(r.unpack("<I"))
    infos = []
    unknown = []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.unpack("<I")
        if n_dims > 8:
            r.fail(f"tensor {name!r} has {n_dims} dims")
        dims = [r.unpack("<Q") for _ in range(n_dims)]
        ttype, offset = r.unpack("<I"), r.unpack("<Q")
        infos.append((name, dims, ttype, offset))
        if ttype not in GGML_TYPES:
            unknown.append(f"{name} (type id {ttype})")
    if unknown:
        raise WeightLoadError(source=str(path), message=f"{path}: tensor types unknown to ggml: {', '.join(unknown)}")
    align = int(metadata.get("general.alignment", 32)) or 32
    data_offset = (r.pos + align - 1) // align * align
    tensors, past_end = {}, []
    for name, dims, ttype, offset in infos:
        tname, block, block_bytes = GGML_TYPES[ttype]
        count = int(np.prod(dims, dtype=np.int64)) if dims else 1
        nbytes = count // block * block_bytes
        if data_offset + offset + nbytes > size:
            past_end.append(name)
        tensors[name] = TensorInfo(name, tname, tuple(reversed(dims)), data_offset + offset, nbytes)
    if past_end:
        raise WeightLoadError(source=str(path), message=(
            f"{path}: truncated GGUF file ({size} bytes): the data of {len(past_end)} tensor(s) runs past the end "
            f"({', '.join(past_end[:5])}{' ...' if len(past_end) > 5 else ''}); the download is incomplete?"))
    return GGUFHeader(path, version, metadata, tensors, data_offset)


def find_gguf(path) -> Path | None:
    """``path`` if it is a ``.gguf`` file; the single ``.gguf`` file of a folder; else None.

    A folder with several raises ValueError listing them (pass the file itself)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"{path}: several GGUF files ({', '.join(f.name for f in files)}); pass one of them")
        return files[0] if files else None
    return None

"""gguf-py's parse of a GGUF file, made once a test session.

gguf-py (the independent reader the tests compare with) parses a file's every metadata item into
NumPy views: SmolLM2's 49,152-token vocabulary and its merges take it several seconds, and
transformers' GGUF loading parses the file three times (config, weights, tokenizer) and builds
gguf-py's tensor-name table once per module of the model. The parse and the table depend only on
the file and the architecture, so they are kept and given again: the same reference, read once.

`parse` runs gguf-py's own parser over the file's bytes in memory instead of its ``np.memmap``: the
parse slices the map once per metadata item and every slice of a memmap pays NumPy's memmap
bookkeeping (SmolLM2's file: 4.9 s mapped, 1.9 s in memory; the same fields and tensors)."""

import contextlib
import functools
import os
import threading

import gguf
import gguf.gguf_reader
import numpy as np

_REAL_READER, _REAL_NAME_MAP = gguf.GGUFReader, gguf.get_tensor_name_map
_swap = threading.Lock()


class _NumpyReadingIntoMemory:
    """The ``numpy`` module as gguf-py's reader sees it during `parse`: ``memmap`` reads the file."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def memmap(path, mode="r"):
        if mode != "r":
            raise ValueError(f"parse reads files read-only; mode {mode!r} needs gguf.GGUFReader itself")
        return np.fromfile(path, dtype=np.uint8)


def parse(path) -> "gguf.GGUFReader":
    """gguf-py's ``GGUFReader`` of ``path`` (read-only), parsed from the file's bytes in memory."""
    with _swap:
        gguf.gguf_reader.np = _NumpyReadingIntoMemory()
        try:
            return _REAL_READER(path)
        finally:
            gguf.gguf_reader.np = np


@functools.lru_cache(maxsize=4)
def _read(path: str):
    return parse(path)


def reader(path):
    """gguf-py's read-only ``GGUFReader`` of ``path``, parsed once a session."""
    return _read(os.path.realpath(os.fspath(path)))


def _reader_for(path, mode="r"):
    return reader(path) if mode == "r" else _REAL_READER(path, mode)


_name_map = functools.lru_cache(maxsize=16)(_REAL_NAME_MAP)


@contextlib.contextmanager
def parsed_once():
    """Within it, ``gguf.GGUFReader(path)`` (read-only) gives `reader`'s parse and
    ``gguf.get_tensor_name_map`` a kept table (transformers imports both from gguf when it loads
    a GGUF file)."""
    gguf.GGUFReader, gguf.get_tensor_name_map = _reader_for, _name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = _REAL_READER, _REAL_NAME_MAP

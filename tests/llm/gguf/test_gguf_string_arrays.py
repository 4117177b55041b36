"""GGUF string arrays (a vocabulary, its merges) as `StringArray`: the same strings as gguf-py's own
reader gives, list behaviour (indexing, slices, ``index``, ``in``, equality), and ``index`` found by
a byte search that must not match inside another item or across two items."""

from pathlib import Path

import gguf
import numpy as np
import pytest

from bundled_model import smollm2_gguf_py

from metalnn.llm.bundled import smollm2_path
from metalnn.llm.gguf.reader import StringArray, read_header


def _gguf_py_strings(reader, key) -> list:
    """gguf-py's reading of a string-array field (an independent reader of the same bytes)."""
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
def test_the_real_vocabulary_reads_as_gguf_py_reads_it(key):
    path = Path(smollm2_path())
    got = read_header(path).metadata[key]
    want = _gguf_py_strings(smollm2_gguf_py(), key)
    assert isinstance(got, StringArray) and len(want) > 40_000
    assert got == want and list(got) == want
    for i in (0, 1, 17, 1000, len(want) // 2, len(want) - 1):
        assert got[i] == want[i] and got[i - len(want)] == want[i]
        assert got.index(want[i]) == want.index(want[i])
    assert got[100:105] == want[100:105] and got[-3:] == want[-3:]


def _written(tmp_path, strings, name="strings.gguf") -> Path:
    out = tmp_path / name
    w = gguf.GGUFWriter(out, "llama")
    w.add_array("test.strings", strings)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_index_matches_whole_items_only(tmp_path):
    strings = ["ab", "b", "abc", "", "b", "ü", "Ġthe", "the", "", "c d"]
    arr = read_header(_written(tmp_path, strings)).metadata["test.strings"]
    assert arr == strings and len(arr) == len(strings)
    for s in strings:
        assert arr.index(s) == strings.index(s), s
    assert arr.index("b", 2) == 4 and arr.index("", 4) == 8
    for absent in ("bc", "a", "bab", "c", "the Ġ", "d"):  # inside an item, or across two
        assert absent not in arr
        with pytest.raises(ValueError, match="not in the array"):
            arr.index(absent)
    with pytest.raises(ValueError):
        arr.index("b", 5)
    with pytest.raises(IndexError, match="out of range"):
        arr[len(strings)]
    assert arr != strings[:-1] and arr != [*strings[:-1], "x"] and arr != "abc"


def test_bytes_that_are_not_utf8_read_as_replacement_characters(tmp_path):
    path = _written(tmp_path, ["ok", "XY", "end"])
    data = path.read_bytes()
    assert data.count(b"XY") == 1
    path.write_bytes(data.replace(b"XY", b"\xff\xfe"))
    arr = read_header(path).metadata["test.strings"]
    assert list(arr) == ["ok", "\ufffd\ufffd", "end"]
    assert arr.index("\ufffd\ufffd") == 1 and arr.index("end") == 2


def test_of_and_repr():
    arr = StringArray.of(["x", "yy", "", "zzz"])
    assert arr == ["x", "yy", "", "zzz"] and arr == StringArray.of(["x", "yy", "", "zzz"])
    assert "4 strings" in repr(arr) and "'x'" in repr(arr)
    with pytest.raises(TypeError):
        hash(arr)
    assert np.array_equal(np.array(arr[1:3]), np.array(["yy", ""]))

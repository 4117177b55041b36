"""Reading a GGUF file's tensors kept packed (metalnn.llm.gguf.tensors) against gguf-py: files written
with gguf's GGUFWriter holding every GGML type (random valid blocks), read back and compared with
gguf-py's dequantization of the same bytes. Float tensors are returned as stored and every block type
is kept byte for byte; read for a regrouping converter, the Q4_0 ... Q8_0 blocks become MLX's affine
layout whose values equal gguf-py's exactly (as numbers: a zero may come out +0 where ggml gives -0)
and the other types float32 equal to gguf-py's."""

import struct

import gguf
import mlx.core as mx
import numpy as np
import pytest

from metalnn import ggml
from metalnn.errors import WeightLoadError
from metalnn.llm.gguf.reader import read_header
from metalnn.llm.gguf.tensors import AFFINE, read_tensors
from ggml_blocks import random_blocks

BLOCK_TYPES = sorted(n for n, c in ggml.TYPES.items() if c.block_size > 1)


def write_file(path, tensors):
    """``tensors``: ``{name: (type name, rows, cols, uint8 data or float array)}``."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (qtype, rows, cols, data) in tensors.items():
        if qtype in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape,
                         raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def packed(qtype, rows, blocks_per_row, seed):
    cls = ggml.get_type(qtype)
    data = random_blocks(qtype, rows * blocks_per_row, np.random.default_rng(seed))
    return data.reshape(rows, blocks_per_row * cls.type_size), blocks_per_row * cls.block_size


@pytest.fixture(scope="module")
def every_type_file(tmp_path_factory):
    tensors = {}
    for i, qtype in enumerate(BLOCK_TYPES):
        data, cols = packed(qtype, 3, 2, seed=i)
        tensors[f"blk.{i}.ffn_down.weight"] = (qtype, 3, cols, data)
    rng = np.random.default_rng(99)
    tensors["norm.weight"] = ("F32", 1, 64, rng.normal(size=64).astype(np.float32))
    tensors["half.weight"] = ("F16", 4, 64, rng.normal(size=(4, 64)).astype(np.float16))
    bf = rng.normal(size=(4, 64)).astype(np.float32).view(np.uint32) >> 16
    tensors["brain.weight"] = ("BF16", 4, 64, bf.astype(np.uint16).view(np.uint8).reshape(4, 128))
    path = write_file(tmp_path_factory.mktemp("gguf") / "types.gguf", tensors)
    return path, tensors


@pytest.mark.parametrize("regroupable", [False, True])
def test_every_type_reads_packed_and_decodes_as_gguf_py(every_type_file, regroupable):
    path, tensors = every_type_file
    header = read_header(path)
    arrays, packed_types = read_tensors(header, regroupable=regroupable)
    for name, (qtype, rows, cols, data) in tensors.items():
        stem = name[:-len(".weight")]
        if qtype in ("F32", "F16", "BF16"):
            got = arrays[name]
            assert got.dtype == {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}[qtype], name
            want = data if qtype != "BF16" else (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want.astype(np.float32).reshape(got.shape))
            continue
        want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]).astype(np.float32)
        if not regroupable:
            assert packed_types[name] == qtype
            np.testing.assert_array_equal(np.array(arrays[name]), data)
            got = ggml.get_type(qtype).decode(arrays[name])
            np.testing.assert_array_equal(np.array(got).view(np.uint32), want.view(np.uint32))
        elif qtype in AFFINE:
            assert name not in packed_types
            bits = AFFINE[qtype][0]
            w, s, b = arrays[f"{stem}.weight"], arrays[f"{stem}.scales"], arrays[f"{stem}.biases"]
            assert s.dtype == b.dtype == mx.float16 and w.dtype == mx.uint32
            got = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), 32, bits)
            np.testing.assert_array_equal(np.array(got), want)
        else:
            assert not packed_types and arrays[name].dtype == mx.float32
            np.testing.assert_array_equal(np.array(arrays[name]).view(np.uint32), want.view(np.uint32))


def test_packed_tensors_take_at_most_1_2x_their_bytes_in_the_file(every_type_file):
    path, _ = every_type_file
    header = read_header(path)
    arrays, _ = read_tensors(header)
    for info in header.tensors.values():
        stem = info.name[:-len(".weight")]
        held = sum(a.nbytes for k, a in arrays.items() if k == info.name or k.startswith(stem + "."))
        assert held <= 1.2 * info.nbytes, (info.name, info.type, held, info.nbytes)


def test_a_type_no_model_uses_is_refused_naming_file_and_tensor(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "ints.gguf"), "llama")
    w.add_tensor("token_types.weight", np.arange(8, dtype=np.int32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(WeightLoadError, match=r"ints.gguf: 1 tensor\(s\) cannot be read: token_types.weight \(I32"):
        read_tensors(read_header(tmp_path / "ints.gguf"))


def test_dims_whose_int64_product_overflows_are_refused_naming_the_tensor(tmp_path):
    """Dims of 2**32 x 2**32 make the header's element count wrap to 0, which passes the size check
    against the file; reading refuses the tensor instead of allocating an array of that shape."""
    path = write_file(tmp_path / "huge.gguf", {"huge.weight": ("F32", 4, 4, np.zeros((4, 4), np.float32)),
                                                "norm.weight": ("F32", 1, 4, np.ones(4, np.float32))})
    data = bytearray(path.read_bytes())
    at = data.find(b"huge.weight") + len(b"huge.weight")
    assert struct.unpack_from("<I2Q", data, at) == (2, 4, 4)  # n_dims, dims
    struct.pack_into("<2Q", data, at + 4, 2**32, 2**32)
    path.write_bytes(bytes(data))
    header = read_header(path)
    assert header.tensors["huge.weight"].nbytes == 0
    with pytest.raises(WeightLoadError, match=r"huge.gguf: 1 tensor\(s\) cannot be read: huge.weight \(F32"):
        read_tensors(header)

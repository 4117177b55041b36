"""Malformed GGUF files: corrupted headers, tensor infos and block data of a tiny model file (every
kind of tensor: float, MLX-affine blocks, K-quant and i-quant blocks) and of the real SmolLM2 file's
header. Loading one either succeeds (corrupt block bytes are still numbers) or raises a metalnn error
(`WeightLoadError` / `UnsupportedConfigError`) naming the file; never another exception, a crash or a
hang. metalnn reads every byte itself, in Python, within ranges checked against the file's size, so
nothing native ever reads the mapping (hypothesis, a bounded number of examples per run)."""

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gguf_files as G
import metalnn as mn
from ggml_blocks import random_blocks
from metalnn import ggml
from metalnn.llm.bundled import smollm2_path
from metalnn.llm.gguf.reader import read_header
from metalnn.llm.models import load_pretrained

os.environ.setdefault("HF_HUB_OFFLINE", "1")
EXAMPLES = int(os.environ.get("METALNN_FUZZ_EXAMPLES", "60"))
ERRORS = (mn.WeightLoadError, mn.UnsupportedConfigError)


class TinyFile(tuple):
    """``(bytes, data_offset)`` of the tiny file, shown short in hypothesis's reports."""

    def __new__(cls, data, data_offset):
        return super().__new__(cls, (data, data_offset))

    def __repr__(self):
        return f"<tiny GGUF file of {len(self[0])} bytes, tensor data from byte {self[1]}>"


def _blocks(qtype, rows, cols, seed):
    cls = ggml.get_type(qtype)
    data = random_blocks(qtype, rows * cols // cls.block_size, np.random.default_rng(seed))
    return data.reshape(rows, cols // cls.block_size * cls.type_size), Q[qtype]


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    model = G.hf_model("llama", vocab=400)        # hidden 64, intermediate 128
    extra = {"blk.0.ffn_gate.weight": _blocks("IQ4_NL", 128, 64, 1), "blk.1.ffn_up.weight": _blocks("Q5_1", 128, 64, 2)}
    path = G.write(tmp_path_factory.mktemp("fuzz") / "tiny.gguf", model, skip=set(extra), extra_tensors=extra)
    return TinyFile(path.read_bytes(), read_header(path).data_offset)


def _load(tmp_path, data):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(data))
    try:
        load_pretrained(path)
    except ERRORS as e:
        assert str(path) in str(e), f"the error does not name the file: {e}"


def _corrupt(data, edits):
    out = bytearray(data)
    for pos, value in edits:
        out[pos % len(out)] = value
    return out


def test_the_uncorrupted_file_loads(tiny_file, tmp_path):
    data, _ = tiny_file
    path = tmp_path / "ok.gguf"
    path.write_bytes(data)
    model = load_pretrained(path)
    assert isinstance(model.model.layers[0].mlp.gate_proj, mn.GGMLLinear)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_corrupt_headers_and_tensor_infos(tiny_file, tmp_path, data):
    raw, data_offset = tiny_file
    edits = data.draw(st.lists(st.tuples(st.integers(0, data_offset - 1), st.integers(0, 255)), min_size=1,
                               max_size=8))
    _load(tmp_path, _corrupt(raw, edits))


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_corrupt_block_data(tiny_file, tmp_path, data):
    raw, data_offset = tiny_file
    edits = data.draw(st.lists(st.tuples(st.integers(data_offset, len(raw) - 1), st.integers(0, 255)), min_size=1,
                               max_size=64))
    _load(tmp_path, _corrupt(raw, edits))


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_truncated_and_extended_files(tiny_file, tmp_path, data):
    raw, _ = tiny_file
    cut = data.draw(st.integers(0, len(raw) - 1))
    tail = data.draw(st.binary(max_size=64))
    _load(tmp_path, raw[:cut] + tail)


@settings(max_examples=EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_corrupt_headers_of_the_real_file(tmp_path, data):
    """The SmolLM2 file's header (metadata and 272 tensor infos) with bytes replaced; the header is
    parsed, and every tensor range checked, without reading the 100 MB of blocks."""
    path = Path(smollm2_path())
    with open(path, "rb") as f:
        head = bytearray(f.read(read_header(path).data_offset))
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(head) - 1), st.integers(0, 255)), min_size=1,
                               max_size=8))
    for pos, value in edits:
        head[pos] = value
    out = tmp_path / "real_header.gguf"
    with open(path, "rb") as src, open(out, "wb") as dst:
        dst.write(head)
        src.seek(len(head))
        dst.write(src.read())
    try:
        header = read_header(out)
    except mn.WeightLoadError as e:
        assert str(out) in str(e)
        return
    assert header.tensors


@pytest.mark.parametrize("key, value, message", [
    ("llama.block_count", 1_000_000, "block_count = 1000000, but the file holds tensors of 2 blocks"),
    ("llama.embedding_length", 1 << 30, "embedding_length = 1073741824, but token_embd.weight has rows of 64"),
    ("llama.feed_forward_length", 1 << 30, "feed_forward_length = 1073741824, but blk.0.ffn_up.weight has 128 rows"),
    ("llama.attention.head_count", 0, "head_count = 0; expected a positive integer"),
    ("llama.attention.head_count", 3, "head_count = 3 with heads of 21, but blk.0.attn_q.weight has 64 rows"),
])
def test_sizes_in_the_metadata_are_checked_against_the_tensors_before_building(tmp_path, key, value, message):
    """A corrupt size must fail at once, not build (or allocate) a model of that size."""
    import gguf

    model = G.hf_model("llama", vocab=400)
    path = G.write(tmp_path / "sizes.gguf", model, metadata={key: (value, gguf.GGUFValueType.UINT32)})
    with pytest.raises(mn.UnsupportedConfigError, match=message) as e:
        load_pretrained(path)
    assert str(path) in str(e.value)

"""The memory of loading a GGUF file (metalnn.llm.gguf.tensors, convert, models.loading): the file is not
left mapped, each tensor is read into its array's own buffer (no NumPy copy, no second MLX copy), the
tensors a converter transforms are made one at a time, MLX's cache is emptied after loading, and reading
never writes into arrays that exist already (a load that fails leaves a loaded model as it was).

Measured with this process's own counters (MLX's and tracemalloc's), which other processes cannot
change; resident memory, which they can, is measured by ``scripts/bench_memory.py``."""

import sys
import tracemalloc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

import gguf_files as G
from memory import peak_above_active
from metalnn.errors import WeightLoadError
from metalnn.llm.gguf import convert
from metalnn.llm.gguf.reader import read_header
from metalnn.llm.gguf.tensors import read_tensors
from metalnn.llm.models import load_pretrained, load_tokenizer, read_gguf

LAYERS = 4
#: every matrix Q8_0 (the file's largest tensors are then blocks), norms float32
TYPES = dict.fromkeys(G.TYPES, Q.Q8_0)


def llama(seed: int):
    """A random Llama large enough that its tensors' bytes dominate what loading allocates besides."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=400, hidden_size=512, intermediate_size=1024, num_hidden_layers=LAYERS,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf_memory")
    return {seed: G.write(folder / f"llama{seed}.gguf", llama(seed), types=TYPES) for seed in (0, 1)}


def param_bytes(model) -> int:
    return sum(p.nbytes for p in model.named_parameters().values())


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_loading_leaves_no_mapping_of_the_file(files):
    path = str(files[0].resolve())
    model, tok = load_pretrained(files[0]), load_tokenizer(files[0])
    assert path not in Path("/proc/self/maps").read_text()
    import mmap  # the check sees a mapping when there is one

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
        assert path in Path("/proc/self/maps").read_text()
    assert model.num_layers == LAYERS and tok.encode("In the beginning")


def test_tensors_are_read_without_a_numpy_copy(files):
    header = read_header(files[0])
    largest = max(info.nbytes for info in header.tensors.values())
    assert largest >= 500_000
    tracemalloc.start()
    try:
        arrays, _ = read_tensors(header)
        _, peak = tracemalloc.get_traced_memory()  # Python objects and NumPy buffers
    finally:
        tracemalloc.stop()
    assert len(arrays) == len(header.tensors)
    assert peak < largest / 4, f"{peak} bytes traced while reading; the largest tensor has {largest}"


def test_reading_allocates_each_tensors_bytes_once(files):
    header = read_header(files[0])
    total = sum(info.nbytes for info in header.tensors.values())
    kept = []
    peak = peak_above_active(lambda: kept.append(read_tensors(header)[0]))
    assert sum(a.nbytes for a in kept[0].values()) == total
    assert total <= peak <= total + 4096 * len(header.tensors)


def test_loading_makes_at_most_one_tensor_beyond_the_weights(files):
    """The Llama converter restores the Q/K row order of every layer: each restored tensor is computed
    and the file's version released before the next is made, so the peak is the weights plus one tensor,
    not plus every layer's Q and K. Measured as MLX evaluates normally (not one op at a time): with each
    tensor evaluated on its own, how far MLX's evaluation runs ahead cannot change the peak."""
    header = read_header(files[0])
    largest = max(info.nbytes for info in header.tensors.values())
    qk = sum(info.nbytes for name, info in header.tensors.items() if name.endswith(("attn_q.weight", "attn_k.weight")))
    assert qk > 2 * largest  # what keeping every layer's file version alive would add
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    model = load_pretrained(files[0])
    peak = mx.get_peak_memory() - base
    weights = param_bytes(model)
    assert weights <= peak <= weights + largest + 4096 * len(header.tensors), (peak, weights, largest)
    assert mx.get_cache_memory() == 0  # the released versions are not kept in MLX's cache either


def test_read_gguf_returns_its_tensors_computed(files):
    """The tensors the converter transformed (Q and K of every layer) are computed before `read_gguf`
    returns, each holding only its own buffer: evaluating them afterwards allocates nothing (lazy ones
    would each hold the file's version until then, and MLX would make them all at once)."""
    checkpoint = read_gguf(files[0])
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(list(checkpoint.tensors.values()))
    assert mx.get_peak_memory() <= base  # the peak restarts from zero and grows only by allocations
    assert mx.get_active_memory() == base


def test_reading_writes_only_into_new_arrays(files):
    model = load_pretrained(files[0])
    before = {k: np.array(v) for k, v in model.named_parameters().items()}
    zeros = mx.zeros((512, 544), dtype=mx.uint8)  # the shape of a Q8_0 [512, 512] weight
    mx.eval(zeros)
    other = load_pretrained(files[1])  # the same shapes, other values
    changed = [k for k, v in other.named_parameters().items() if not np.array_equal(np.array(v), before[k])]
    assert len(changed) > LAYERS * 7  # the second file's weights differ from the first's
    for k, v in model.named_parameters().items():
        np.testing.assert_array_equal(np.array(v), before[k], err_msg=k)
    assert not np.array(zeros).any()


def test_a_load_that_fails_midway_leaves_a_loaded_model_as_it_was(files, tmp_path, monkeypatch):
    model = load_pretrained(files[0])
    before = {k: np.array(v) for k, v in model.named_parameters().items()}
    shrinking = tmp_path / "shrinking.gguf"
    shrinking.write_bytes(files[1].read_bytes())
    parse = convert.read_header

    def read_header_then_shrink(path):  # the file shrinks between its header and its tensors
        header = parse(path)
        last = max(header.tensors.values(), key=lambda info: info.offset)
        with open(path, "r+b") as f:
            f.truncate(last.offset + last.nbytes // 2)
        return header

    monkeypatch.setattr(convert, "read_header", read_header_then_shrink)
    with pytest.raises(WeightLoadError, match="ends inside its data") as err:
        load_pretrained(shrinking)
    assert str(shrinking) in str(err.value)
    for k, v in model.named_parameters().items():
        np.testing.assert_array_equal(np.array(v), before[k], err_msg=k)

"""GGMLLinear / GGMLEmbedding and functional.ggml_matmul against NumPy products with gguf-py's
dequantization of the same bytes (float32 throughout: the products differ only by summation order,
so 2e-5 relative to the largest output; the gradient with respect to the input is the same product
with the transposed weight)."""

import gguf
import mlx.core as mx
import numpy as np
import pytest

import metalnn as mn
from metalnn import ggml
from metalnn.layers.ggml import GGMLEmbedding, GGMLLinear
from ggml_blocks import random_blocks

BLOCK_TYPES = sorted(name for name, cls in ggml.TYPES.items() if cls.block_size > 1)


def packed_matrix(qtype, rows, blocks_per_row, seed):
    cls = ggml.get_type(qtype)
    data = random_blocks(qtype, rows * blocks_per_row, np.random.default_rng(seed))
    data = data.reshape(rows, blocks_per_row * cls.type_size)
    return data, gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]).astype(np.float32)


def close(got, want):
    scale = max(float(np.abs(want).max()), 1e-6)
    np.testing.assert_allclose(got, want, atol=2e-5 * scale, rtol=0)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_linear_forward_and_input_gradient_match_the_dequantized_product(qtype):
    data, W = packed_matrix(qtype, 6, 2, seed=1)
    in_features = W.shape[1]
    layer = GGMLLinear.from_packed(mx.array(data), qtype, in_features)
    x = np.random.default_rng(2).normal(size=(3, 4, in_features)).astype(np.float32)
    close(np.array(layer(mx.array(x))), x @ W.T)
    g = np.random.default_rng(3).normal(size=(3, 4, 6)).astype(np.float32)
    _, (dx,) = mx.vjp(lambda v: layer(v), [mx.array(x)], [mx.array(g)])
    close(np.array(dx), g @ W)
    assert layer.trainable_parameters() == {} and layer.dequantized_weight().shape == W.shape


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_embedding_looks_up_and_projects_with_the_packed_table(qtype):
    data, W = packed_matrix(qtype, 10, 2, seed=4)
    table = GGMLEmbedding.from_packed(mx.array(data), qtype, W.shape[1])
    ids = np.array([[1, 7, 7], [0, 9, 3]])
    np.testing.assert_array_equal(np.array(table(mx.array(ids))), W[ids])
    x = np.random.default_rng(5).normal(size=(2, W.shape[1])).astype(np.float32)
    close(np.array(table.as_linear(mx.array(x))), x @ W.T)


def test_half_inputs_give_half_outputs():
    data, W = packed_matrix("Q8_0", 4, 1, seed=6)
    layer = GGMLLinear.from_packed(mx.array(data), "Q8_0", 32)
    y = layer(mx.ones((2, 32), dtype=mx.float16))
    assert y.dtype == mx.float16


def test_bad_packed_data_and_inputs_are_refused_clearly():
    with pytest.raises(ValueError, match="Q8_0: a row of 100 values is not a whole number of 32-value blocks"):
        GGMLLinear(4, in_features=100, ggml_type="Q8_0")
    with pytest.raises(ValueError, match=r"a Q8_0 weight of 4 x 64 values is uint8 \(4, 68\), got uint8 \(4, 34\)"):
        GGMLLinear.from_packed(mx.zeros((4, 34), dtype=mx.uint8), "Q8_0", 64)
    layer = GGMLLinear(4, in_features=64, ggml_type="Q8_0")
    with pytest.raises(mn.ShapeError):
        layer(mx.zeros((2, 32)))
    with pytest.raises(ValueError, match="x has 32 features, the Q8_0 weight"):
        mn.functional.ggml_matmul(mx.zeros((2, 32)), layer.weight, layer.qtype)
    with pytest.raises(KeyError, match="unknown GGML type 'Q3_X'"):
        GGMLLinear(4, in_features=64, ggml_type="Q3_X")

"""`FusedQKVAttention` and `FusedGateUpMLP` against the split layers they fuse (`SelfAttention`, `SwiGLU`) with the
same weights, and `LongRoPE` against a NumPy rotation (transformers' formula: ``inv_freq = 1 / (factor * base **
(2i / dims))``, cos and sin scaled by the attention factor). Float32 throughout: 1e-5 leaves room for summation
order only."""

import mlx.core as mx
import numpy as np
import pytest

import metalnn as mn
from metalnn.data import Data
from metalnn.layers import FusedGateUpMLP, FusedQKVAttention, LongRoPE, SelfAttention, SwiGLU

TOL = 1e-5


def _x(shape, seed=0):
    return mx.array(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


def test_fused_qkv_attention_equals_the_split_projections():
    x = _x((2, 7, 16))
    fused = FusedQKVAttention(4, num_kv_heads=2, rope_dims=2, sliding_window=3)
    split = SelfAttention(4, num_kv_heads=2, rope_dims=2, sliding_window=3)
    want_shape = fused(x).shape
    split(x)
    w = fused.qkv_proj.weight
    split.q_proj.weight, split.k_proj.weight, split.v_proj.weight = w[:16], w[16:24], w[24:]
    split.o_proj.weight = fused.o_proj.weight
    assert fused.qkv_proj.weight.shape == (32, 16) and want_shape == (2, 7, 16)
    np.testing.assert_allclose(np.array(fused(x)), np.array(split(x)), atol=TOL)


def test_fused_gate_up_mlp_equals_swiglu():
    x = _x((2, 5, 8))
    fused, split = FusedGateUpMLP(12), SwiGLU(12)
    fused(x), split(x)
    split.gate_proj.weight, split.up_proj.weight = fused.gate_up_proj.weight[:12], fused.gate_up_proj.weight[12:]
    split.down_proj.weight = fused.down_proj.weight
    np.testing.assert_allclose(np.array(fused(x)), np.array(split(x)), atol=TOL)
    with pytest.raises(ValueError, match="gate activation must be one of"):
        FusedGateUpMLP(12, activation="tanh")


def _numpy_rope(x, dims, base, factors, factor, offset):
    t = x.shape[-2]
    inv = 1.0 / (np.asarray(factors, np.float64) * base ** (np.arange(0, dims, 2) / dims))
    theta = (np.arange(t) + offset)[:, None] * inv
    cos, sin = np.cos(theta) * factor, np.sin(theta) * factor
    rot, rest = x[..., :dims], x[..., dims:]
    h = dims // 2
    out = np.concatenate([rot[..., :h] * cos - rot[..., h:] * sin, rot[..., :h] * sin + rot[..., h:] * cos], -1)
    return np.concatenate([out, rest], -1)


@pytest.mark.parametrize("offset, long", [(0, False), (6, False), (7, True), (20, True)])
def test_long_rope_picks_its_factors_by_the_calls_last_position(offset, long):
    """8 rotated of 12 features, pretraining length 10: a 4-position call from ``offset`` reaches position
    ``offset + 3``; long factors once that is 10 or more (transformers: ``max(position) + 1 > 10``)."""
    short, longf = [1.0, 1.5, 2.0, 4.0], [2.0, 3.0, 9.0, 30.0]
    rope = LongRoPE(8, 100.0, short, longf, original_length=10, attention_factor=1.3)
    x = np.random.default_rng(1).normal(size=(2, 3, 4, 12)).astype(np.float32)
    want = _numpy_rope(x.astype(np.float64), 8, 100.0, longf if long else short, 1.3, offset)
    np.testing.assert_allclose(np.array(rope(mx.array(x), offset)), want, atol=TOL)
    # per-row positions: each row picks its own factors
    rows = mx.array([offset, 0], dtype=mx.int32)
    got = np.array(rope(mx.array(x), rows))
    np.testing.assert_allclose(got[0], want[0], atol=TOL)
    np.testing.assert_allclose(got[1], _numpy_rope(x[1:].astype(np.float64), 8, 100.0, short, 1.3, 0)[0], atol=TOL)


def test_long_rope_names_misfit_factors():
    with pytest.raises(ValueError, match="long_factors must be 2 positive numbers"):
        LongRoPE(4, 100.0, [1.0, 1.0], [1.0], original_length=8)

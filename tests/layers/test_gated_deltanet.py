"""GatedDeltaNet against transformers' Qwen3NextGatedDeltaNet (tiny random config, weights copied by
name): forward and gradients in input and every parameter, on the reference path (chunked and
recurrent forms) and on the emulated kernels; decoding with a GatedDeltaCache equals one full pass.

Tolerance: float32 against a float64 torch module (whose recurrence runs in float32): 1e-4
relative to the largest magnitude.
"""

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten

import metalnn as mn

from kernel_cases import emulate, reference
from layer_checks import assert_layer_matches_torch, rel_close

import transformers.models.qwen3_next.modeling_qwen3_next as hf  # noqa: E402
from transformers import Qwen3NextConfig  # noqa: E402

HIDDEN, HK, HV, DK, DV = 32, 2, 4, 8, 6
TOL = 1e-4


def hf_block(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(hidden_size=HIDDEN, linear_num_key_heads=HK, linear_num_value_heads=HV,
                          linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=4,
                          num_hidden_layers=1, layer_types=["linear_attention"], num_attention_heads=2,
                          num_key_value_heads=1, vocab_size=16)
    block = hf.Qwen3NextGatedDeltaNet(cfg, 0).double()
    with torch.no_grad():  # move the gains off their initial values so they are tested
        block.norm.weight.uniform_(0.5, 1.5)
        block.dt_bias.uniform_(-1.0, 1.0)
    return block


def metalnn_block(block, device, T, B, mode="auto"):
    layer = mn.GatedDeltaNet(HK, num_v_heads=HV, head_k_dim=DK, head_v_dim=DV, conv_kernel=4, eps=1e-6, chunk_size=8,
                             mode=mode)
    layer.build_for((HIDDEN, T, B), device=device)
    weights = {k: mx.array(v.detach().float().numpy()) for k, v in block.state_dict().items()}
    assert set(dict(tree_flatten(layer.parameters()))) == set(weights)
    layer.load_from_provider(weights)
    return layer


@pytest.mark.parametrize("kernels,mode,T", [("reference", "auto", 19), ("reference", "recurrent", 7),
                                            ("emulate", "auto", 11)])
def test_matches_qwen3_next_forward_and_gradients(kernels, mode, T):
    B = 2
    block = hf_block()
    device = reference() if kernels == "reference" else emulate()
    layer = metalnn_block(block, device, T, B, mode)
    assert_layer_matches_torch(layer, block, device, B, T, HIDDEN, TOL)


@pytest.mark.parametrize("kernels", ["reference", "emulate"])
def test_decoding_with_cache_matches_full_pass(kernels):
    B, T, prefix = 2, 9, 5
    device = reference() if kernels == "reference" else emulate()
    layer = metalnn_block(hf_block(1), device, T, B)
    x = mx.array(np.random.default_rng(5).normal(size=(B, T, HIDDEN)).astype(np.float32))
    full = layer.compile(device, mn.Data(x)).array
    cache = mn.GatedDeltaCache()
    parts = [layer.compile(device, mn.Data(x[:, :prefix]), cache=cache).array]
    for t in range(prefix, T):
        parts.append(layer.compile(device, mn.Data(x[:, t:t + 1]), cache=cache).array)
    assert cache.offset == T
    assert cache.recurrent_state.shape == (B, HV, DK, DV) and cache.conv_state.shape == (B, 3, 2 * HK * DK + HV * DV)
    np.testing.assert_allclose(np.array(mx.concatenate(parts, axis=1)), np.array(full), atol=1e-5, rtol=1e-4)


def test_cache_matches_transformers_final_state():
    """The cache's recurrent state after a prefill equals the state transformers' chunk rule returns."""
    B, T = 1, 6
    block = hf_block(2)
    layer = metalnn_block(block, reference(), T, B)
    x = np.random.default_rng(6).normal(size=(B, T, HIDDEN)).astype(np.float32)
    cache = mn.GatedDeltaCache()
    layer.compile(reference(), mn.Data(mx.array(x)), cache=cache)

    captured = {}
    original = hf.torch_chunk_gated_delta_rule

    def spy(*args, **kwargs):
        kwargs["output_final_state"] = True
        o, state = original(*args, **kwargs)
        captured["state"] = state
        return o, state

    block.chunk_gated_delta_rule = spy
    hf.torch_chunk_gated_delta_rule = spy
    try:
        block(torch.tensor(x, dtype=torch.float64))
    finally:
        hf.torch_chunk_gated_delta_rule = original
    assert "state" in captured, "transformers no longer calls torch_chunk_gated_delta_rule by that name"
    rel_close(cache.recurrent_state, captured["state"].detach().numpy(), TOL, name="state")


def test_bad_head_counts_are_reported():
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        mn.GatedDeltaNet(2, num_v_heads=3, head_k_dim=8)

"""Mamba2 against transformers' GraniteMoeHybridMambaLayer (the Mamba2 mixer's torch path; tiny
random configs, weights copied by name): forward and gradients in the input and every parameter,
on the reference path (chunked and recurrent forms) and on the emulated kernels; decoding with a
Mamba2Cache equals one full pass and the cache holds transformers' state.

Tolerance: float32 against a float64 torch module (whose scan runs in float32): 1e-4 relative to
the largest magnitude (sums of a few hundred terms of order 1: rounding ~1e-6).
"""

import math

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten

import metalnn as mn

from kernel_cases import emulate, reference
from layer_checks import assert_layer_matches_torch, rel_close

from transformers import GraniteMoeHybridConfig  # noqa: E402
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf  # noqa: E402

HIDDEN = 16
TOL = 1e-4
#: two configs: groups of B/C, conv bias, no projection bias; one group, projection biases, a dt clamp
CONFIGS = {
    "groups": dict(mamba_n_heads=4, mamba_d_head=8, mamba_d_state=6, mamba_n_groups=2, mamba_d_conv=4,
                   mamba_conv_bias=True, mamba_proj_bias=False),
    "biases": dict(mamba_n_heads=2, mamba_d_head=16, mamba_d_state=5, mamba_n_groups=1, mamba_d_conv=3,
                   mamba_conv_bias=False, mamba_proj_bias=True, time_step_limit=(0.3, 0.9)),
}


def hf_block(name, seed=0):
    torch.manual_seed(seed)
    cfg = GraniteMoeHybridConfig(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["mamba"], mamba_expand=2,
                                 mamba_chunk_size=8, num_attention_heads=2, vocab_size=16, **CONFIGS[name])
    block = hf.GraniteMoeHybridMambaLayer(cfg, 0).double()
    with torch.no_grad():  # move the gains and per-head parameters off their initial values so they are tested
        block.norm.weight.uniform_(0.5, 1.5)
        block.dt_bias.uniform_(-1.0, 1.0)
        block.D.uniform_(-1.0, 1.0)
        block.A_log.uniform_(-0.5, 1.0)
        if block.conv1d.bias is not None:
            block.conv1d.bias.uniform_(-0.5, 0.5)
    return block, cfg


def metalnn_block(name, block, cfg, device, T, B, mode="auto"):
    c = CONFIGS[name]
    layer = mn.Mamba2(c["mamba_n_heads"], head_dim=c["mamba_d_head"], state_size=c["mamba_d_state"],
                      n_groups=c["mamba_n_groups"], conv_kernel=c["mamba_d_conv"], conv_bias=c["mamba_conv_bias"],
                      bias=c["mamba_proj_bias"], time_step_limit=cfg.time_step_limit, eps=cfg.rms_norm_eps,
                      chunk_size=8, mode=mode)
    layer.build_for((HIDDEN, T, B), device=device)
    weights = {k: mx.array(v.detach().float().numpy()) for k, v in block.state_dict().items()}
    assert set(dict(tree_flatten(layer.parameters()))) == set(weights)
    layer.load_from_provider(weights)
    return layer


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("kernels,mode,T", [("reference", "auto", 19), ("reference", "recurrent", 7),
                                            ("emulate", "auto", 11)])
def test_matches_transformers_forward_and_gradients(name, kernels, mode, T):
    B = 2
    block, cfg = hf_block(name)
    device = reference() if kernels == "reference" else emulate()
    layer = metalnn_block(name, block, cfg, device, T, B, mode)
    assert_layer_matches_torch(layer, block, device, B, T, HIDDEN, TOL)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("kernels", ["reference", "emulate"])
def test_decoding_with_cache_matches_full_pass(name, kernels):
    B, T, prefix = 2, 9, 5
    device = reference() if kernels == "reference" else emulate()
    block, cfg = hf_block(name, 1)
    layer = metalnn_block(name, block, cfg, device, T, B)
    x = mx.array(np.random.default_rng(5).normal(size=(B, T, HIDDEN)).astype(np.float32))
    full = layer.compile(device, mn.Data(x)).array
    cache = mn.Mamba2Cache()
    parts = [layer.compile(device, mn.Data(x[:, :prefix]), cache=cache).array]
    for t in range(prefix, T):
        parts.append(layer.compile(device, mn.Data(x[:, t:t + 1]), cache=cache).array)
    assert cache.offset == T
    c = CONFIGS[name]
    H, P, N, G, k = (c[key] for key in ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups",
                                          "mamba_d_conv"))
    assert cache.ssm_state.shape == (B, H, P, N) and cache.conv_state.shape == (B, k - 1, H * P + 2 * G * N)
    # 1e-5 absolute / 1e-4 relative: the same float32 sums in chunks or one step at a time
    np.testing.assert_allclose(np.array(mx.concatenate(parts, axis=1)), np.array(full), atol=1e-5, rtol=1e-4)


def test_cache_matches_transformers_state():
    """The cache's state after a prefill equals the state transformers' chunk scan returns, and a
    decoded token equals transformers' recurrent step with its cache."""
    from transformers import DynamicCache

    B, T = 1, 6
    block, cfg = hf_block("groups", 2)
    layer = metalnn_block("groups", block, cfg, reference(), T, B)
    x = np.random.default_rng(6).normal(size=(B, T + 1, HIDDEN)).astype(np.float32)
    cache = mn.Mamba2Cache()
    layer.compile(reference(), mn.Data(mx.array(x[:, :T])), cache=cache)
    step = layer.compile(reference(), mn.Data(mx.array(x[:, T:])), cache=cache).array

    block = block.float()
    hf_cache = DynamicCache(config=cfg)
    with torch.no_grad():
        block(torch.tensor(x[:, :T]), cache=hf_cache)
        state = hf_cache.layers[0].recurrent_states[0].clone() if hasattr(hf_cache.layers[0], "recurrent_states") \
            else hf_cache.get_recurrent_state(0, state_idx=0).clone()
        y = block(torch.tensor(x[:, T:]), cache=hf_cache)
    assert state.shape == tuple(cache.ssm_state.shape)
    rel_close(step, y.numpy(), TOL, name="step")


def test_bad_sizes_are_reported():
    with pytest.raises(ValueError, match="multiple of n_groups"):
        mn.Mamba2(3, head_dim=4, state_size=4, n_groups=2)
    assert mn.Mamba2(2, head_dim=4, state_size=4, time_step_limit=None).time_step_limit == (0.0, math.inf)

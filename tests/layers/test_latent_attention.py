"""`LatentAttention` (multi-head latent attention) against transformers' ``DeepseekV3Attention``, and
`GroupLimitedMoE` against ``DeepseekV3MoE``, on tiny random modules.

Attention: the whole sequence uncached (latents expanded), then the same sequence through a `KVCache`
(a prompt, then single tokens: the absorbed form; and the expanded form with the cache), and rows of
different lengths through a merged `BatchKVCache` (per-row positions and key masks). Each gives
transformers' outputs of the whole sequence at those positions. The cache holds only the latent and the
rotary key. Experts: the same outputs and the same chosen experts, with correction biases large enough to
change some choices.

Tolerance 1e-5 absolute: float32 outputs of size O(0.1-1) from a few products of width <= 32 agree to
~1e-6 whatever the order of summation (the absorbed form sums in another order than transformers).
"""

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
import transformers.models.deepseek_v3.modeling_deepseek_v3 as hf
from mlx.utils import tree_flatten

import metalnn as mn
from metalnn.layers.attention import KVCache
from metalnn.layers.batch_cache import merge_rows
from metalnn.layers.latent_attention import LatentAttention
from metalnn.layers.sigmoid_moe import GroupLimitedMoE

TOL = 1e-5
W, T = 32, 9
CONFIGS = {
    "q_lora_interleaved": dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                               rope_interleave=True, attention_bias=False),
    "q_proj_half_split": dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=6, qk_rope_head_dim=8,
                              v_head_dim=20, rope_interleave=False, attention_bias=True),
}


def hf_config(**kw):
    base = dict(vocab_size=16, hidden_size=W, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=4, moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    cfg = transformers.DeepseekV3Config(**{**base, **kw})
    cfg._attn_implementation = "eager"
    return cfg


def perturbed(module, seed):
    """Random weights (std 0.2), norm gains in [0.5, 1.5), correction biases in [0, 0.5)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if name.endswith("layernorm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module.eval()


def loaded(layer, module):
    layer.build_for((W, 1, 1))
    weights = {k: mx.array(v.detach().float().numpy()) for k, v in module.state_dict().items()}
    assert set(dict(tree_flatten(layer.parameters()))) == set(weights)
    layer.load_from_provider(weights)
    return layer


def attention_pair(name, seed=0):
    cfg = hf_config(**CONFIGS[name])
    module = perturbed(hf.DeepseekV3Attention(cfg, layer_idx=0), seed)
    c = CONFIGS[name]
    layer = LatentAttention(4, kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
                            qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
                            q_lora_rank=c["q_lora_rank"], bias=c["attention_bias"], rope_base=1000.0,
                            rope_traditional=c["rope_interleave"])
    return cfg, module, loaded(layer, module)


def hf_attention(cfg, module, x):
    """transformers' outputs ``[B, T, W]`` of the whole sequences ``x`` (causal)."""
    xt = torch.tensor(np.asarray(x))
    t = xt.shape[1]
    pos = torch.arange(t)[None]
    cos_sin = hf.DeepseekV3RotaryEmbedding(cfg)(xt, pos)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return module(xt, cos_sin, mask)[0].numpy()


class Expanded(LatentAttention):
    """Expands the cached latents as the uncached pass does (as with an adapted ``kv_b_proj``)."""

    def absorbs(self, cache):
        return False


@pytest.mark.parametrize("name", list(CONFIGS))
def test_uncached_and_cached_outputs_match_transformers(name):
    cfg, module, layer = attention_pair(name)
    x = mx.array(np.random.default_rng(1).standard_normal((2, T, W)).astype(np.float32))
    want = hf_attention(cfg, module, x)
    assert np.abs(want).max() > 0.05
    assert np.abs(np.array(layer(x)) - want).max() < TOL
    for form in (layer, loaded(Expanded(**_kwargs(layer)), module)):
        cache = KVCache()
        assert form.absorbs(cache) is (type(form) is LatentAttention)
        outs = [form(x[:, :5], cache=cache)] + [form(x[:, i:i + 1], cache=cache) for i in range(5, T)]
        got = np.concatenate([np.array(o) for o in outs], axis=1)
        assert np.abs(got - want).max() < TOL, type(form).__name__
        keys, values = cache.state
        assert keys.shape == (2, 1, T, layer.kv_lora_rank) and values.shape == (2, 1, T, layer.qk_rope_head_dim)


def _kwargs(layer):
    return dict(num_heads=layer.num_heads, kv_lora_rank=layer.kv_lora_rank, qk_nope_head_dim=layer.qk_nope_head_dim,
                qk_rope_head_dim=layer.qk_rope_head_dim, v_head_dim=layer.v_head_dim, q_lora_rank=layer.q_lora_rank,
                bias=layer.use_bias, rope_base=layer.rope_base, rope_traditional=layer.rope_traditional)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rows_of_different_lengths_decode_at_their_own_positions(name):
    """Two prompts (3 and 7 positions) cached alone, merged, then two steps together: each row's outputs
    are transformers' for its own sequence."""
    cfg, module, layer = attention_pair(name, seed=3)
    rng = np.random.default_rng(2)
    seqs = [rng.standard_normal((1, n + 2, W)).astype(np.float32) for n in (3, 7)]
    caches = []
    for s, n in zip(seqs, (3, 7)):
        cache = [KVCache()]
        layer(mx.array(s[:, :n]), cache=cache[0])
        caches.append(cache)
    batch = merge_rows(caches)[0]
    for step in range(2):
        x = mx.array(np.concatenate([s[:, n + step:n + step + 1] for s, n in zip(seqs, (3, 7))], axis=0))
        got = np.array(layer(x, cache=batch))
        for row, (s, n) in enumerate(zip(seqs, (3, 7))):
            want = hf_attention(cfg, module, s[:, :n + step + 1])[0, -1]
            assert np.abs(got[row, 0] - want).max() < TOL, (step, row)
    assert batch.lengths == [5, 9]


def test_group_limited_moe_matches_transformers():
    cfg = hf_config()
    module = perturbed(hf.DeepseekV3MoE(cfg), seed=5)
    layer = loaded(GroupLimitedMoE(8, 3, 8, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                   shared_dims=8), module)
    x = np.random.default_rng(4).standard_normal((2, 7, W)).astype(np.float32)
    with torch.no_grad():
        want = module(torch.tensor(x)).numpy()
        _, hf_weights, hf_ids = module.gate(torch.tensor(x))
    assert np.abs(np.array(layer(mx.array(x))) - want).max() < TOL
    logits = layer.gate(mx.array(x.reshape(-1, W))).reshape(-1, 8)
    weights, ids = layer.route(logits)
    order, hf_order = np.argsort(np.array(ids), axis=-1), np.argsort(hf_ids.numpy(), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.array(ids), order, -1),
                                  np.take_along_axis(hf_ids.numpy(), hf_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.array(weights), order, -1),
                               np.take_along_axis(hf_weights.numpy(), hf_order, -1), atol=1e-6)
    # the bias changes choices here (so the comparison covers it); without it other experts win
    unbiased = mx.sigmoid(logits)
    plain = np.sort(np.array(mx.argpartition(-unbiased, kth=2, axis=-1)[:, :3]), -1)
    assert (plain != np.take_along_axis(np.array(ids), order, -1)).any()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        LatentAttention(4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=3, v_head_dim=8)
    with pytest.raises(ValueError, match="n_group"):
        GroupLimitedMoE(8, 2, 8, n_group=3)
    with pytest.raises(ValueError, match="top_k"):
        GroupLimitedMoE(8, 5, 8, n_group=4, topk_group=2)
    assert isinstance(mn.layers.LatentAttention, type) and isinstance(mn.layers.GroupLimitedMoE, type)

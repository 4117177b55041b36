"""`metalnn.llm.embeddings.embed` and `CausalLM.hidden_states` against transformers.

Tiny random transformers models of three families (GPT-2: LayerNorm and learned positions; Qwen3;
Qwen3-Next: linear-attention layers and sparse experts) are saved and loaded with metalnn; the
reference is transformers' base model (``last_hidden_state``, after the final norm) mean-pooled over
each input and divided by its L2 norm, one input at a time. metalnn runs the inputs together,
right-padded, in one or several batches: the padding must change nothing.

Tolerance: 1e-4 absolute on unit vectors (float32 on both sides; the same models' logits agree to
2e-5 in tests/llm/models, and pooling averages rounding out).
"""

import os

import numpy as np
import pytest
import torch
import transformers

from metalnn.llm.embeddings import _batches, embed

from hf_models import hf_model, save_and_load, small_chunks, tokens

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOL = 1e-4
VOCAB = 96
LENGTHS = (3, 11, 20, 1, 7)
FAMILIES = {
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
             dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=24)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                        linear_conv_kernel_dim=4, initializer_range=0.2,
                        layer_types=["linear_attention", "full_attention", "linear_attention"],
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                        shared_expert_intermediate_size=12, norm_topk_prob=True, decoder_sparse_step=1,
                        mlp_only_layers=[2], max_position_embeddings=64)),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, (cfg, cls, kw) in FAMILIES.items():
        hf = hf_model(cfg, cls, **kw)
        model = save_and_load(hf, tmp_path_factory.mktemp(name))
        out[name] = (hf, small_chunks(model) if name == "qwen3_next" else model)  # 20 tokens: three chunks
    return out


def inputs():
    return [tokens(VOCAB, (n,), seed=i).tolist() for i, n in enumerate(LENGTHS)]


def reference(hf, token_lists):
    out = []
    with torch.no_grad():
        for ids in token_lists:
            h = hf.base_model(torch.tensor([ids])).last_hidden_state[0].double().mean(dim=0)
            out.append((h / h.norm()).numpy())
    return np.stack(out)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hidden_states_match_transformers(name, checkpoints):
    hf, model = checkpoints[name]
    ids = inputs()[2]
    with torch.no_grad():
        want = hf.base_model(torch.tensor([ids])).last_hidden_state.numpy()
    got = np.array(model.hidden_states(ids))
    assert got.shape == want.shape[1:]
    np.testing.assert_allclose(got, want[0], atol=2e-4, rtol=1e-4)  # the logits' tolerance of tests/llm/models


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("max_batch_tokens", [8192, 25, 1])
def test_embed_matches_transformers_whatever_the_batching(name, max_batch_tokens, checkpoints):
    hf, model = checkpoints[name]
    lists = inputs()
    got = np.array(embed(model, lists, max_batch_tokens=max_batch_tokens))
    assert got.shape == (len(lists), hf.config.get_text_config().hidden_size) and got.dtype == np.float32
    np.testing.assert_allclose(got, reference(hf, lists), atol=TOL)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


def test_batches_cover_the_inputs_in_order_within_the_budget():
    lengths = [3, 11, 20, 1, 7, 30, 2, 2, 2]
    for budget in (1, 10, 25, 40, 1000):
        runs = list(_batches(lengths, budget))
        assert [i for r in runs for i in r] == list(range(len(lengths)))
        for r in runs:
            assert len(r) == 1 or len(r) * max(lengths[i] for i in r) <= budget, (budget, r)
    assert len(list(_batches(lengths, 1000))) == 1


def test_embed_refuses_what_the_model_cannot_read(checkpoints):
    _, model = checkpoints["gpt2"]  # 24 positions
    with pytest.raises(ValueError, match="no inputs"):
        embed(model, [])
    with pytest.raises(ValueError, match="input 1 has no tokens"):
        embed(model, [[1], []])
    with pytest.raises(ValueError, match=f"input 0 holds the token id {VOCAB}"):
        embed(model, [[1, VOCAB]])
    with pytest.raises(ValueError, match="input 1 has 25 tokens; the model's context length is 24"):
        embed(model, [[1], [2] * 25])

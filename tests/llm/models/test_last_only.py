"""``model(tokens, last_only=True)``: the output head reads the last position alone (what a prompt's
first new token needs), against transformers' logits of that position for the whole sequence.

Families: Llama with its own head and with the tied embedding (the head as the transposed table),
Gemma 2 (final logit soft-capping after the head), Granite 4 hybrid (Mamba2 and attention layers, its
own ``forward`` scaling the logits). Each is called with a cache (the cache must still receive every
position: the next token's logits, computed from it, are checked too) and without one.

Tolerance 2e-4 of the logits' scale, as the other model tests: float32 through three blocks.
"""

import mlx.core as mx
import numpy as np
import pytest
import transformers

from tests.support.hf_models import hf_logits, hf_model, max_error, saved_checkpoints, tokens

TOL = 2e-4
VOCAB = 96
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2)
GRANITE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, initializer_range=0.2,
               intermediate_size=8, shared_intermediate_size=12, mamba_chunk_size=8, mamba_expand=2,
               max_position_embeddings=128, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
               mamba_n_heads=4, mamba_d_head=16, mamba_d_state=6, mamba_n_groups=2, num_local_experts=0,
               position_embedding_type="rope", embedding_multiplier=1.7, logits_scaling=2.5,
               tie_word_embeddings=False)
FAMILIES = {
    "llama": lambda: hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, **LLAMA,
                              tie_word_embeddings=False),
    "llama_tied": lambda: hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, **LLAMA,
                                   tie_word_embeddings=True),
    "gemma2_softcap": lambda: hf_model(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, **LLAMA, head_dim=8,
                                       final_logit_softcapping=3.0, tie_word_embeddings=False),
    "granite_hybrid": lambda: hf_model(transformers.GraniteMoeHybridConfig,
                                       transformers.GraniteMoeHybridForCausalLM, **GRANITE),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (transformers model, metalnn model, folder)}."""
    return saved_checkpoints(tmp_path_factory, {name: build() for name, build in FAMILIES.items()})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_last_only_gives_the_last_positions_logits(checkpoints, family):
    hf, model, _ = checkpoints[family]
    toks = tokens(VOCAB, (2, 11), seed=3)
    want = hf_logits(hf, toks)  # [2, 11, vocab]
    scale = np.abs(want).max()

    got = model(mx.array(toks[:, :10]), last_only=True)
    assert got.shape == (2, 1, VOCAB)
    assert max_error(got[:, 0], want[:, 9]) <= TOL * scale

    # with a cache: every position is cached, so the next token continues from position 10
    cache = model.make_cache()
    first = model(mx.array(toks[:, :10]), cache=cache, last_only=True)
    assert first.shape == (2, 1, VOCAB)
    nxt = model(mx.array(toks[:, 10:11]), cache=cache)
    assert max_error(first[:, 0], want[:, 9]) <= TOL * scale
    assert max_error(nxt[:, 0], want[:, 10]) <= TOL * scale


def test_last_only_of_one_sequence_and_of_one_token(checkpoints):
    hf, model, _ = checkpoints["llama"]
    toks = tokens(VOCAB, (1, 7), seed=4)
    want = hf_logits(hf, toks)[0]
    got = model(mx.array(toks[0]), last_only=True)  # [T] in: [1, vocab] out
    assert got.shape == (1, VOCAB)
    assert max_error(got[0], want[-1]) <= TOL * np.abs(want).max()
    # one token: the same as without the option
    one = mx.array(toks[:, :1])
    assert mx.array_equal(model(one, last_only=True), model(one))

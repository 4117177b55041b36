"""Phi-3 / Phi-4-mini (`Phi3ForCausalLM`) against transformers.

Tiny random models (fixed torch seed, gains moved off 1), saved with save_pretrained and loaded with
metalnn.llm.models.load_pretrained:

* ``longrope``: Phi-4-mini's shape: partial rotary (half of each head), LongRoPE with distinct short and long
  factors switching at 32 positions (``max_position_embeddings`` 128: attention factor sqrt(1 + log 4 / log 32)),
  GQA, tied embeddings;
* ``window``: Phi-3-mini's shape: plain RoPE over the whole head, a 5-token sliding window, untied head.

Tolerances: logits within 2e-4 (absolute; two float32 implementations of a 2-layer model whose logits are O(1)
agree to ~1e-6, 2e-4 leaves room for summation order only); loss and gradients within 1e-3 of torch autograd,
relative to the largest entry (float32 backward through two layers); greedy generation token-identical.
GGUF files are written with gguf-py the way llama.cpp's ``Phi3MiniModel`` converter writes them
(`gguf_phi3_files`); Q8_0 files are compared with a transformers model whose matrices hold the Q8_0 values, so
the same 2e-4 applies (what is left is float32 summation order).
"""

import json
import os

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

import metalnn as mn
from metalnn.errors import UnsupportedConfigError
from metalnn.layers import FusedGateUpMLP, FusedQKVAttention
from metalnn.llm.tuner import lora
from metalnn.llm.models import load_pretrained

from gguf_phi3_files import quantizable, write
from gguf_writing import q8_0_values
from hf_models import hf_greedy, hf_logits, hf_model, max_error, saved_checkpoints, tokens
from model_checks import (LOGITS_TOL, assert_batched_rows_match, assert_greedy_matches, assert_logits_match,
                          assert_loss_and_gradients_match, assert_saved_folder_loads_in_transformers)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
ORIGINAL = 32
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.2)
FAMILIES = {
    "longrope": dict(BASE, tie_word_embeddings=True, max_position_embeddings=4 * ORIGINAL,
                     original_max_position_embeddings=ORIGINAL,
                     rope_parameters={"rope_type": "longrope", "rope_theta": 1000.0, "partial_rotary_factor": 0.5,
                                      "short_factor": [1.0, 1.7], "long_factor": [3.0, 11.0]}),
    "window": dict(BASE, num_key_value_heads=4, tie_word_embeddings=False, sliding_window=5,
                   max_position_embeddings=256, original_max_position_embeddings=256),
}


def _hf(name, **overrides):
    return hf_model(transformers.Phi3Config, transformers.Phi3ForCausalLM, **dict(FAMILIES[name], **overrides))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (transformers model, metalnn model, folder)}."""
    return saved_checkpoints(tmp_path_factory, {name: _hf(name) for name in FAMILIES})


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("length", [13, ORIGINAL + 9])
def test_logits_match_transformers(name, length, checkpoints):
    """13 positions: LongRoPE's short factors; 41 (past the original 32): its long factors."""
    hf, model, _ = checkpoints[name]
    assert type(model) is mn.models.Phi3ForCausalLM
    assert_logits_match(hf, model, VOCAB, shape=(2, length), label=name)


def test_layers_carry_the_configs_options(checkpoints):
    _, model, _ = checkpoints["longrope"]
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert type(attn) is FusedQKVAttention and type(mlp) is FusedGateUpMLP
    assert attn.rope_dims == 4 and attn.head_dim == 8 and attn.sliding_window is None
    lr = attn.long_rope
    assert lr.original_length == ORIGINAL and abs(lr.attention_factor - (1 + np.log(4) / np.log(32)) ** 0.5) < 1e-12
    names = set(model.named_parameters())
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= names
    assert not any(".q_proj." in n or ".up_proj." in n for n in names)
    _, window, _ = checkpoints["window"]
    assert [b.self_attn.sliding_window for b in window.model.layers] == [5, 5]
    assert all(b.self_attn.long_rope is None and b.self_attn.rope_dims == 8 for b in window.model.layers)


def test_long_and_short_factors_both_matter(checkpoints):
    """The factors reach the logits: swapping them changes the short and the long regime."""
    hf, model, folder = checkpoints["longrope"]
    cfg = json.loads((folder / "config.json").read_text())
    rope = dict(cfg["rope_parameters"], short_factor=[1.0, 1.0], long_factor=[1.0, 1.0])
    plain = mn.models.from_config(dict(cfg, rope_parameters=rope))
    plain.load_weights_from(folder)
    for length in (13, ORIGINAL + 9):
        toks = mx.array(tokens(VOCAB, (1, length), seed=6))
        assert max_error(plain(toks), model(toks)) > 1e-3


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_matches_transformers(name, checkpoints):
    """7 + 24 positions: below LongRoPE's switch (transformers' generate recomputes its cache when a sequence
    crosses it; see test_cached_steps_across_the_switch_match_transformers for the crossing)."""
    hf, model, _ = checkpoints[name]
    assert_greedy_matches(hf, model, VOCAB, n=24, label=name)


def test_cached_steps_across_the_switch_match_transformers(checkpoints):
    """Decoding one position a call through the caches from position 28 to 37: the calls past position 31 rotate
    with the long factors, the cached keys keep the factors they were rotated with (transformers' model called
    with its cache the same way); the fused decoding step declines these blocks."""
    hf, model, _ = checkpoints["longrope"]
    assert all(block._step_plan() is None for block in model.model.layers)
    toks = tokens(VOCAB, (1, ORIGINAL + 6), seed=7)
    cache = model.make_cache()
    hf_cache = transformers.DynamicCache(config=hf.config)
    start = ORIGINAL - 4
    with torch.no_grad():
        want = hf(torch.tensor(toks[:, :start]), cache=hf_cache, use_cache=True).logits.numpy()
    got = np.array(model(mx.array(toks[:, :start]), cache=cache))
    assert max_error(got, want) < LOGITS_TOL
    for i in range(start, toks.shape[1]):
        with torch.no_grad():
            want = hf(torch.tensor(toks[:, i:i + 1]), cache=hf_cache, use_cache=True).logits.numpy()
        got = np.array(model(mx.array(toks[:, i:i + 1]), cache=cache))
        assert max_error(got, want) < LOGITS_TOL, f"position {i}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_loss_and_gradients_match_torch(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert_loss_and_gradients_match(hf, model, VOCAB, must_include=["model.layers.1.self_attn.qkv_proj.weight"],
                                    label=name)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_save_pretrained_loads_in_transformers(name, checkpoints, tmp_path):
    hf, model, _ = checkpoints[name]
    assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB, architecture="Phi3ForCausalLM",
                                              model_type="phi3", lengths=(12, ORIGINAL + 3))


def test_lora_on_the_fused_projections_trains(checkpoints):
    _, _, folder = checkpoints["longrope"]
    model = load_pretrained(folder)
    paths = lora.apply(model, rank=4, alpha=8.0, targets=("qkv_proj", "gate_up_proj"))
    assert sorted(paths) == sorted(f"model.layers.{i}.{p}" for i in range(2)
                                   for p in ("self_attn.qkv_proj", "mlp.gate_up_proj"))
    toks = mx.array(tokens(VOCAB, (2, 12), seed=8))

    def loss_fn(m, t):
        return mn.losses.cross_entropy(m(t[:, :-1]), t[:, 1:])

    model.train()
    before = loss_fn(model, toks).item()
    grads = nn.value_and_grad(model, lambda t: loss_fn(model, t))(toks)[1]
    trained = [k for k, _ in tree_flatten(grads)]
    assert len(trained) == 8 and all(".lora_" in k for k in trained), trained  # A and B of 4 adapters
    opt = optim.Adam(learning_rate=1e-2)
    for _ in range(3):
        _, grads = nn.value_and_grad(model, lambda t: loss_fn(model, t))(toks)
        opt.update(model, grads)
        mx.eval(model.parameters())
    assert loss_fn(model, toks).item() < before - 1e-3


def test_info_lists_the_family_features(checkpoints):
    from metalnn.cli.info import describe, format_facts

    _, _, folder = checkpoints["longrope"]
    facts = describe(folder)
    text = " ".join(facts["features"])
    assert "fused qkv_proj and gate_up_proj" in text and "partial rotary (4 of 8 features)" in text
    assert f"LongRoPE (long factors past {ORIGINAL} positions" in text
    assert "features" in format_facts(facts)
    _, _, window = checkpoints["window"]
    assert "sliding window 5" in describe(window)["features"]


def test_bad_factors_are_named(checkpoints):
    _, _, folder = checkpoints["longrope"]
    cfg = json.loads((folder / "config.json").read_text())
    bad = dict(cfg, rope_parameters=dict(cfg["rope_parameters"], long_factor=[1.0, 2.0, 3.0]))
    with pytest.raises(UnsupportedConfigError, match=r"rope_scaling.long_factor: expected 2 numbers"):
        mn.models.from_config(bad)


# -- GGUF ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gguf_file_matches_transformers(name, checkpoints, tmp_path):
    hf, _, _ = checkpoints[name]
    model = load_pretrained(write(tmp_path / "f32.gguf", hf))
    assert type(model) is mn.models.Phi3ForCausalLM
    cfg = model.config
    if name == "longrope":
        assert cfg["rope_scaling"]["long_factor"] == [3.0, 11.0] and cfg["original_max_position_embeddings"] == ORIGINAL
        assert cfg["partial_rotary_factor"] == 0.5 and cfg["sliding_window"] is None
    else:
        assert cfg["sliding_window"] == 5 and cfg["rope_scaling"] is None
    for length in (13, ORIGINAL + 9):
        toks = tokens(VOCAB, (2, length), seed=1)
        err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
        assert err < LOGITS_TOL, f"{name} GGUF ({length} positions): logits differ by {err:.3g}"
    prompt = tokens(VOCAB, (1, 7), seed=2)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()


def test_q8_0_gguf_file_stays_quantized_and_matches_transformers(tmp_path):
    hf = _hf("longrope")
    assert q8_0_values(hf, quantizable) >= 5  # every matrix the file quantizes holds its Q8_0 round trip
    model = load_pretrained(write(tmp_path / "q8.gguf", hf, qtype=Q.Q8_0))
    kinds = {p: type(m).__name__ for p, m in model.named_modules()}
    names = ["model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj"]
    assert all(kinds[n] == "GGMLLinear" for n in names), {n: kinds[n] for n in names}
    for length in (13, ORIGINAL + 9):
        toks = tokens(VOCAB, (2, length), seed=3)
        err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
        assert err < LOGITS_TOL, f"Q8_0 ({length} positions): logits differ by {err:.3g}"
    prompt = tokens(VOCAB, (1, 9), seed=4)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()


# -- batched decoding ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_batch_generator_rows_get_their_lone_greedy_tokens(name, checkpoints):
    """Rows of different lengths decode together (per-row positions through `cache.positions`, each row's mask
    and window through `cache.key_mask`); with LongRoPE the longest rows cross the switch while the others do
    not, each row choosing its own factors, as it does alone."""
    hf, model, _ = checkpoints[name]
    assert_batched_rows_match(hf, model, VOCAB, seed=11, prompt_lengths=(3, 24, 9), limits=(14, 16, 20), first=3,
                              prefill_chunk=8, lone=lambda p, n: mn.generate(model, p, n, eos_token_id=()))

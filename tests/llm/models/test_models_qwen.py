"""Qwen2, Qwen3 and Mistral checkpoints against transformers.

Tiny random models are built from configs with a fixed torch seed and gains moved off 1, saved with
save_pretrained, loaded with metalnn.llm.models.load_pretrained and compared on the same tokens:

* logits within 2e-4 (absolute; two float32 implementations of a 2-layer model whose logits are
  O(1) agree to ~1e-6, so 2e-4 leaves room for summation order only);
* greedy generation token-identical for 24 tokens, batch 1 and 3 (prompts longer than the sliding
  windows, so the windows are exercised in prefill and decoding);
* loss and gradients of every parameter within 1e-3 of torch autograd, relative to the largest
  gradient entry (float32 backward through two layers);
* metalnn's save_pretrained writes a folder transformers loads back to the same logits.
"""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
import transformers

import metalnn as mn
from metalnn.errors import UnsupportedConfigError
from metalnn.llm.models import load_pretrained

from hf_models import hf_model, saved_checkpoints, tokens
from model_checks import (assert_greedy_matches, assert_logits_match, assert_loss_and_gradients_match,
                          assert_saved_folder_loads_in_transformers)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.2)

FAMILIES = {
    # q/k/v biases, tied embeddings, a 4-token window on layer 1 only (max_window_layers=1)
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(BASE, tie_word_embeddings=True, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000.0})),
    # q/k norms, head_dim 16 != hidden / heads, biases on all four projections, untied head
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(BASE, head_dim=16, attention_bias=True, tie_word_embeddings=False)),
    # 5-token sliding window on every layer
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(BASE, sliding_window=5, tie_word_embeddings=False)),
}
CLASSES = {"qwen2": mn.models.Qwen2ForCausalLM, "qwen3": mn.models.Qwen3ForCausalLM,
           "mistral": mn.models.MistralForCausalLM}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (transformers model, metalnn model, folder)}."""
    models = {name: hf_model(cfg, cls, **kw) for name, (cfg, cls, kw) in FAMILIES.items()}
    return saved_checkpoints(tmp_path_factory, models)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert type(model) is CLASSES[name]
    assert_logits_match(hf, model, VOCAB, label=name)


def test_windows_and_options_are_the_configs():
    """The layers carry the options transformers reads from each config."""
    q2 = mn.models.from_config(dict(FAMILIES["qwen2"][2], architectures=["Qwen2ForCausalLM"]))
    attn = [block.self_attn for block in q2.model.layers]
    assert [a.sliding_window for a in attn] == [None, 4]
    assert all(a.use_bias and not a.out_bias for a in attn)
    q3 = mn.models.from_config(dict(FAMILIES["qwen3"][2], architectures=["Qwen3ForCausalLM"]))
    assert all(b.self_attn.qk_norm and b.self_attn.head_dim == 16 for b in q3.model.layers)
    # Without use_sliding_window, Qwen2 attends to everything (as transformers).
    off = mn.models.from_config(dict(FAMILIES["qwen2"][2], use_sliding_window=False,
                                     architectures=["Qwen2ForCausalLM"]))
    assert [b.self_attn.sliding_window for b in off.model.layers] == [None, None]
    m = mn.models.from_config(dict(FAMILIES["mistral"][2], sliding_window=None, architectures=["MistralForCausalLM"]))
    assert [b.self_attn.sliding_window for b in m.model.layers] == [None, None]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_matches_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert_greedy_matches(hf, model, VOCAB, n=24, label=name)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_loss_and_gradients_match_torch(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert_loss_and_gradients_match(hf, model, VOCAB, must_include=["model.embed_tokens.weight"], label=name)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_save_pretrained_loads_in_transformers(name, checkpoints, tmp_path):
    hf, model, _ = checkpoints[name]
    assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB, architecture=CLASSES[name].architecture,
                                              model_type=CLASSES[name].model_type)


def test_unknown_layer_type_and_rope_type_are_named(checkpoints, tmp_path):
    _, _, folder = checkpoints["qwen2"]
    cfg = json.loads((folder / "config.json").read_text())
    bad = dict(cfg, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(UnsupportedConfigError, match=r"layer_types\[1\] = 'chunked_attention'"):
        mn.models.from_config(bad)
    bad = dict(cfg, rope_parameters={"rope_type": "longrope", "rope_theta": 1000.0})
    with pytest.raises(UnsupportedConfigError, match="rope_parameters: rope type 'longrope'"):
        mn.models.from_config(bad)


def test_window_is_honoured_beyond_its_length(checkpoints):
    """With a sliding window, tokens further back than the window do not change the logits."""
    _, model, _ = checkpoints["mistral"]
    toks = tokens(VOCAB, (1, 14), seed=5)
    other = toks.copy()
    other[0, :3] = (other[0, :3] + 1) % VOCAB
    a, b = np.array(model(mx.array(toks))), np.array(model(mx.array(other)))
    # Two layers of a 5-token window: position p sees inputs from p - 8 on.
    np.testing.assert_allclose(a[0, 11:], b[0, 11:], atol=1e-6)
    assert np.abs(a[0, 3:11] - b[0, 3:11]).max() > 1e-3


def test_loads_from_model_type_alone(checkpoints, tmp_path):
    _, model, folder = checkpoints["qwen3"]
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("architectures")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    assert type(load_pretrained(tmp_path)) is mn.models.Qwen3ForCausalLM

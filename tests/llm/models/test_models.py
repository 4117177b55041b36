"""Pretrained-model loading and saving, checked against Hugging Face transformers.

Tiny random LlamaForCausalLM / GPT2LMHeadModel models are built from configs with a fixed torch
seed, saved with save_pretrained (safetensors), loaded with metalnn.llm.models.load_pretrained and run
on the same tokens. Tolerance 1e-4 absolute on fp32 logits (two independent fp32 implementations of
a 2-layer model whose logits are O(1)).
"""

import copy
import json
import os

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import metalnn as mn
from metalnn.llm.models import load_pretrained

transformers.logging.set_verbosity_error()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ATOL = 1e-4

LLAMA_CONFIGS = {
    # GQA 4:1, biases, tied embeddings, Llama 3 rope scaling, head_dim != hidden / heads
    "gqa_llama3": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=16, attention_bias=True,
                       tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=256,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # plain multi-head attention, untied head, linear rope scaling, mlp bias
    "mha_linear": dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False, mlp_bias=True,
                       rms_norm_eps=1e-5, rope_scaling={"rope_type": "linear", "factor": 2.0}),
}
GPT2_CONFIG = dict(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128)


def _tokens(vocab, shape, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def _hf_llama(name):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**LLAMA_CONFIGS[name], initializer_range=0.1, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


def _hf_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(**GPT2_CONFIG, initializer_range=0.1, bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (hf_model, folder)} for every tiny model, saved once per test module."""
    out = {}
    for name in LLAMA_CONFIGS:
        hf = _hf_llama(name)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder, safe_serialization=True)
        out[name] = (hf, folder)
    hf = _hf_gpt2()
    folder = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(folder, safe_serialization=True)
    out["gpt2"] = (hf, folder)
    return out


NAMES = [*LLAMA_CONFIGS, "gpt2"]


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name, checkpoints):
    hf, folder = checkpoints[name]
    model = load_pretrained(folder)
    vocab = hf.config.vocab_size
    tokens = _tokens(vocab, (2, 37))
    logits = model(mx.array(tokens))
    assert logits.shape == (2, 37, vocab) and logits.dtype == mx.float32
    ref = _hf_logits(hf, tokens)
    assert np.abs(ref).max() > 0.05  # the comparison is not trivially between near-zero numbers
    np.testing.assert_allclose(np.array(logits), ref, atol=ATOL, rtol=0)
    # 1-D tokens and the builder API give the same numbers
    np.testing.assert_allclose(np.array(model(tokens[0].tolist())), ref[0], atol=ATOL, rtol=0)
    out = model.compile(mn.Device(kernels="reference"), mn.Data(mx.array(tokens)))
    assert out.dims == mn.MTLSize(vocab, 37, 2)
    np.testing.assert_allclose(np.array(out.array), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_kv_cache_decoding_equals_full_recompute(name, checkpoints):
    _, folder = checkpoints[name]
    model = load_pretrained(folder)
    tokens = mx.array(_tokens(model.vocab_size, (2, 24), seed=1))
    full = np.array(model(tokens))
    cache = model.make_cache()
    steps = [model(tokens[:, :9], cache=cache)]
    steps.append(model(tokens[:, 9:12], cache=cache))
    for i in range(12, 24):
        steps.append(model(tokens[:, i:i + 1], cache=cache))
    assert all(c.offset == 24 for c in cache)
    np.testing.assert_allclose(np.array(mx.concatenate(steps, axis=1)), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_round_trip_through_transformers(name, checkpoints, tmp_path):
    hf, folder = checkpoints[name]
    model = load_pretrained(folder)
    # change the weights so the round trip cannot pass by reading the original files
    from mlx.utils import tree_map

    model.update(tree_map(lambda a: a * 1.25, model.parameters()))
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [type(hf).__name__]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is type(hf)
    tokens = _tokens(model.vocab_size, (1, 20), seed=2)
    np.testing.assert_allclose(_hf_logits(back, tokens), np.array(model(mx.array(tokens))), atol=ATOL, rtol=0)
    # and metalnn reads its own output back identically
    again = load_pretrained(tmp_path)
    np.testing.assert_array_equal(np.array(again(mx.array(tokens))), np.array(model(mx.array(tokens))))


@pytest.mark.parametrize("name", ["gqa_llama3", "gpt2"])
def test_sharded_checkpoint(name, checkpoints, tmp_path):
    hf, _ = checkpoints[name]
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    model = load_pretrained(tmp_path)
    tokens = _tokens(model.vocab_size, (1, 16), seed=3)
    np.testing.assert_allclose(np.array(model(mx.array(tokens))), _hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_bfloat16_load(checkpoints):
    hf, folder = checkpoints["gqa_llama3"]
    model = load_pretrained(folder, dtype="bfloat16")
    assert all(v.dtype == mx.bfloat16 for v in model.named_parameters().values())
    tokens = _tokens(model.vocab_size, (1, 12), seed=4)
    out = np.array(model(mx.array(tokens)).astype(mx.float32))
    # reference: transformers in float32 on the same bfloat16-rounded weights, so only metalnn's
    # bfloat16 activations differ (8-bit mantissa: ~0.4% per rounding, over two blocks; logits ~ +-2)
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    np.testing.assert_allclose(out, _hf_logits(rounded, tokens), atol=3e-2, rtol=0)


def test_unknown_architecture(checkpoints, tmp_path):
    _, folder = checkpoints["gqa_llama3"]
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    cfg["model_type"] = "mamba"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(mn.models.UnsupportedConfigError, match="MambaForCausalLM.*LlamaForCausalLM"):
        load_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path / "nowhere")


def test_unsupported_rope_type(checkpoints, tmp_path):
    _, folder = checkpoints["mha_linear"]
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mn.models.UnsupportedConfigError, match="dynamic"):
        load_pretrained(tmp_path)


def test_missing_and_misshaped_tensors_are_all_reported(checkpoints, tmp_path):
    _, folder = checkpoints["mha_linear"]
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    del weights["model.norm.weight"]
    weights["model.layers.0.self_attn.q_proj.weight"] = weights["model.layers.0.self_attn.q_proj.weight"][:10]
    weights["model.extra.weight"] = np.zeros(3, np.float32)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(mn.WeightLoadError) as err:
        load_pretrained(tmp_path)
    e = err.value
    assert e.missing == ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    assert e.unexpected == ["model.extra.weight"]
    assert list(e.mismatched) == ["model.layers.0.self_attn.q_proj.weight"]
    assert "LlamaForCausalLM" in str(e) and "model.norm.weight" in str(e)


def test_gpt2_checkpoint_without_prefix_and_mask_buffers(checkpoints, tmp_path):
    """Older GPT-2 files: no ``transformer.`` prefix and ``attn.bias`` mask buffers; both are handled."""
    hf, folder = checkpoints["gpt2"]
    weights = {k.removeprefix("transformer."): v for k, v in load_file(folder / "model.safetensors").items()}
    for i in range(GPT2_CONFIG["n_layer"]):
        weights[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 128, 128), np.float32))
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    model = load_pretrained(tmp_path)
    tokens = _tokens(model.vocab_size, (1, 10), seed=5)
    np.testing.assert_allclose(np.array(model(mx.array(tokens))), _hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_gpt2_position_limit(checkpoints):
    model = load_pretrained(checkpoints["gpt2"][1])
    with pytest.raises(ValueError, match="128"):
        model(mx.zeros((1, 129), dtype=mx.int32))


def test_model_from_config_names_match_hf_and_seed_decides_weights():
    cfg = mn.models.llama_config(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2)
    model = mn.models.from_config(cfg, seed=1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in cfg.items()
                                                                  if k not in ("architectures",)}))
    assert set(model.named_parameters()) == set(hf.state_dict())
    # different seeds, different weights; the same seed, the same weights
    a = mn.models.from_config(cfg, seed=1).named_parameters()
    b = mn.models.from_config(cfg, seed=2).named_parameters()
    for name, value in model.named_parameters().items():  # every parameter, the table included
        np.testing.assert_array_equal(np.array(a[name]), np.array(value), err_msg=name)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(np.array(a["model.embed_tokens.weight"]), np.array(b["model.embed_tokens.weight"]))
    assert not np.array_equal(np.array(a[key]), np.array(b[key]))
    assert not np.array_equal(np.array(a[key]), np.array(a["model.layers.1.self_attn.q_proj.weight"]))


def test_model_built_from_scratch_saves_for_transformers(tmp_path):
    """A model made from metalnn.llm.models.llama_config (as examples/char_lm.py does) loads in transformers."""
    cfg = mn.models.llama_config(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2)
    model = mn.models.from_config(cfg, seed=3)
    model.save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = _tokens(40, (2, 11), seed=6)
    np.testing.assert_allclose(_hf_logits(hf, tokens), np.array(model(mx.array(tokens))), atol=ATOL, rtol=0)

"""LFM2 (`Lfm2ForCausalLM`: gated short convolutions and q/k-normed attention) against transformers'
``Lfm2ForCausalLM``.

Tiny random models (RMSNorm gains moved off 1 by `hf_models.perturb`; the convolution layers' biases
and weights moved by `perturb_conv`) are saved with save_pretrained and loaded with metalnn. Two configs:

* ``biased``: 4 layers (conv, attention, conv, attention), convolution width 3 with biases
  (``conv_bias``), two key/value heads, the feed-forward width adjusted by a multiplier and rounded
  (``block_ffn_dim_multiplier`` 1.5, ``block_multiple_of`` 8: 72 -> 48 -> 72), an untied head;
* ``plain``: 3 layers from ``full_attn_idxs`` (conv, attention, conv), convolution width 4 without
  biases, one key/value head, ``intermediate_size`` used as it is (``block_auto_adjust_ff_dim`` off),
  tied embeddings.

Tolerances: logits 2e-4 absolute (float32 against float32 on logits of O(1): room for summation order
only; measured about 1e-5); loss and gradients 1e-3 relative to the largest entry of each gradient
(float32 backward); greedy tokens identical for 22 tokens, batch 1 and 3 and through `BatchGenerator`
rows; decoding one token at a time through the caches gives the full pass's logits within 2e-4.

GGUF: llama.cpp's ``lfm2`` files (``convert_hf_to_gguf.py``'s ``LFM2Model``), written by
`gguf_lfm2_files.write_lfm2_gguf` the converter's way (checked against ``convert_hf_to_gguf.py`` itself
on the ``GGUF_CONFIG`` model: the same tensors, types and metadata for ``--outtype f32`` and ``q8_0``).
The Q8_0 file is compared with transformers holding the same Q8_0 values (each quantized matrix
replaced by its quantize-dequantize round trip, a fixed point, so both sides hold identical weights
and 2e-4 holds again).
"""

import os

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

import metalnn as mn
from metalnn.errors import UnsupportedConfigError, WeightLoadError
from metalnn.layers import KVCache, ShortConvCache
from metalnn.layers.transformer import DecoderBlock
from metalnn.llm.batching import BatchGenerator
from metalnn.llm.models import load_pretrained
from metalnn.llm.prefix_cache import PrefixCache

from gguf_lfm2_files import write_lfm2_gguf
from gguf_writing import q8_0_values
from hf_models import hf_greedy, hf_model, max_error, saved_checkpoints, tokens
from model_checks import (LOGITS_TOL, assert_batched_rows_match, assert_greedy_matches, assert_info_features,
                          assert_logits_match, assert_lora_trains, assert_loss_and_gradients_match,
                          assert_saved_folder_loads_in_transformers)
from peft_adapters import peft_logits, save_peft_adapter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, initializer_range=0.2,
            max_position_embeddings=256)
CONFIGS = {
    "biased": dict(BASE, num_hidden_layers=4, num_key_value_heads=2, intermediate_size=72, conv_L_cache=3,
                   conv_bias=True, block_ffn_dim_multiplier=1.5, block_multiple_of=8, tie_word_embeddings=False,
                   layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "plain": dict(BASE, num_hidden_layers=3, num_key_value_heads=1, intermediate_size=40, conv_L_cache=4,
                  conv_bias=False, block_auto_adjust_ff_dim=False, tie_word_embeddings=True, full_attn_idxs=[1]),
}
KINDS = {"biased": ["conv", "full_attention", "conv", "full_attention"], "plain": ["conv", "full_attention", "conv"]}
FFN = {"biased": 72, "plain": 40}
#: every projection LFM2 names (PEFT's target names for it)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "out_proj", "in_proj", "w1", "w2", "w3")


def perturb_conv(model, seed=0):
    """Move the convolution layers' biases off zero (transformers starts the linear ones there) and
    their depthwise kernels to O(1) values, so a wrong tap order or a dropped bias shows."""
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "Lfm2ShortConv":
                module.conv.weight.copy_(torch.rand(module.conv.weight.shape, generator=g) * 2 - 1)
                for p in (module.conv.bias, module.in_proj.bias, module.out_proj.bias):
                    if p is not None:
                        p.copy_(torch.rand(p.shape, generator=g) - 0.5)
    return model


def lfm2(**config):
    return perturb_conv(hf_model(transformers.Lfm2Config, transformers.Lfm2ForCausalLM, **config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{config name: (transformers model, metalnn model, folder)}."""
    return saved_checkpoints(tmp_path_factory, {name: lfm2(**kw) for name, kw in CONFIGS.items()})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert type(model) is mn.models.Lfm2ForCausalLM
    assert_logits_match(hf, model, VOCAB, (2, 15), label=name)
    short = tokens(VOCAB, (2, 15), seed=1)[:, :2]  # fewer tokens than the convolution's width
    assert_logits_match(hf, model, VOCAB, toks=short, label=f"{name}, 2 tokens")


def test_layers_carry_the_configs_plan(checkpoints):
    """Layer kinds from layer_types or full_attn_idxs, the convolution's width and biases, the
    adjusted feed-forward width, tying."""
    for name, cfg in CONFIGS.items():
        hf, model, _ = checkpoints[name]
        blocks = model.model.layers
        assert model.layer_kinds == KINDS[name] == hf.config.layer_types
        assert [("conv" in b, "self_attn" in b) for b in blocks] == [(k == "conv", k != "conv") for k in KINDS[name]]
        convs = [b.conv for b in blocks if "conv" in b]
        assert all(c.kernel_size == cfg["conv_L_cache"] and c.use_bias is cfg["conv_bias"] for c in convs)
        assert all(b.feed_forward.hidden_dims == FFN[name] == hf.model.layers[0].feed_forward.w1.out_features
                   for b in blocks)
        assert model.tie_word_embeddings is cfg["tie_word_embeddings"] and ("lm_head" in model) is not cfg[
            "tie_word_embeddings"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(name, checkpoints):
    """Prefill, then one token at a time through a `ShortConvCache` per convolution layer and a
    `KVCache` per attention layer."""
    hf, model, _ = checkpoints[name]
    assert [type(c) for c in model.make_cache()] == [ShortConvCache if k == "conv" else KVCache for k in KINDS[name]]
    assert_greedy_matches(hf, model, VOCAB, n=22, label=name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decoding_through_the_caches_gives_the_full_pass_logits(name, checkpoints):
    """A 2-token prefill, then one token per call: every position's logits equal the whole sequence's
    in one pass (the blocks are no `DecoderBlock`, so the fused CPU step never takes them)."""
    _, model, _ = checkpoints[name]
    assert not any(isinstance(b, DecoderBlock) for b in model.model.layers)
    toks = mx.array(tokens(VOCAB, (2, 9), seed=3))
    full = np.array(model(toks))
    cache = model.make_cache()
    steps = [np.array(model(toks[:, :2], cache=cache))]
    steps += [np.array(model(toks[:, i:i + 1], cache=cache)) for i in range(2, 9)]
    assert max_error(np.concatenate(steps, axis=1), full) < LOGITS_TOL
    conv = next(c for c in cache if isinstance(c, ShortConvCache))
    assert conv.offset == 9 and conv.conv_state.shape == (2, CONFIGS[name]["conv_L_cache"] - 1, 32)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_rows_get_their_lone_greedy_tokens(name, checkpoints):
    """`BatchGenerator` (chunked prefill, convolution states stacked by row, attention rows at their own
    positions): each row's tokens are transformers' greedy continuation of its prompt alone; rows join
    while others decode."""
    hf, model, _ = checkpoints[name]
    assert_batched_rows_match(hf, model, VOCAB)


def test_prefix_cache_resumes_from_saved_convolution_states(checkpoints, tmp_path):
    """A prefix cache saved to a folder and read back holds the `ShortConvCache` s of a whole earlier
    prompt: the next turn starts from them and still gets transformers' greedy tokens."""
    hf, model, _ = checkpoints["biased"]
    rng = np.random.default_rng(4)
    turn1 = rng.integers(0, VOCAB, 12).tolist() + [5, 6, 7]

    def run(prompt, n, cache):
        gen = BatchGenerator(model, prefill_chunk=4, prefix_cache=cache)
        seq = gen.add(prompt, n)
        while gen:
            gen.step()
        assert seq.tokens == hf_greedy(hf, np.array([prompt]), n)[0].tolist()

    first = PrefixCache(min_tokens=4)
    run(turn1, 12, first)
    first.save(tmp_path / "prefixes")
    cache = PrefixCache(min_tokens=4)
    cache.load(tmp_path / "prefixes")
    run(turn1 + rng.integers(0, VOCAB, 8).tolist(), 18, cache)
    assert cache.hits == 1 and cache.hit_tokens == len(turn1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradients_match_torch(name, checkpoints):
    hf, model, _ = checkpoints[name]
    must = ["model.layers.0.conv.conv.weight", "model.layers.0.conv.in_proj.weight",
            "model.layers.1.self_attn.q_layernorm.weight", "model.layers.1.self_attn.out_proj.weight",
            "model.layers.2.feed_forward.w3.weight", "model.norm.weight", "model.layers.0.operator_norm.weight"]
    if CONFIGS[name]["conv_bias"]:
        must += ["model.layers.0.conv.conv.bias", "model.layers.2.conv.in_proj.bias",
                 "model.layers.2.conv.out_proj.bias"]

    def rename(k):  # transformers' final norm is model.embedding_norm, metalnn's model.norm
        return "model.norm." + k[len("model.embedding_norm."):] if k.startswith("model.embedding_norm.") else k

    assert_loss_and_gradients_match(hf, model, VOCAB, must_include=must, nonzero=True, rename=rename, label=name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_pretrained_loads_in_transformers(name, checkpoints, tmp_path):
    hf, model, _ = checkpoints[name]
    back = assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB, architecture="Lfm2ForCausalLM",
                                                     model_type="lfm2", reload=True)
    assert back.config.layer_types == hf.config.layer_types
    from safetensors.numpy import load_file
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "model.embedding_norm.weight" in names and "model.norm.weight" not in names


def test_older_config_keys_are_read():
    """LiquidAI's own config.json files name the feed-forward width ``block_ff_dim`` and the tying
    ``tie_embedding`` (which wins over ``tie_word_embeddings``, as in transformers)."""
    cfg = dict(CONFIGS["plain"], architectures=["Lfm2ForCausalLM"])
    del cfg["intermediate_size"]
    model = mn.models.from_config(dict(cfg, block_ff_dim=24, tie_embedding=False, tie_word_embeddings=True))
    want = transformers.Lfm2Config(**{k: v for k, v in cfg.items() if k != "architectures"}, block_ff_dim=24,
                                   tie_embedding=False)
    assert model.model.layers[0].feed_forward.hidden_dims == want.intermediate_size == 24
    assert model.tie_word_embeddings is want.tie_word_embeddings is False


def test_lora_on_every_projection_trains_and_peft_adapters_load(checkpoints, tmp_path):
    """The LoRA targets are PEFT's names for LFM2's projections: metalnn wraps each of them, trains,
    and an adapter PEFT made for the transformers model gives PEFT's logits here."""
    _, _, folder = checkpoints["biased"]
    want = [f"model.layers.{i}.conv.{p}" for i in (0, 2) for p in ("in_proj", "out_proj")]
    want += [f"model.layers.{i}.self_attn.{p}" for i in (1, 3) for p in ("q_proj", "k_proj", "v_proj", "out_proj")]
    want += [f"model.layers.{i}.feed_forward.{p}" for i in range(4) for p in ("w1", "w2", "w3")]
    assert_lora_trains(folder, VOCAB, PROJECTIONS, want)

    adapter = save_peft_adapter(folder, tmp_path / "peft", targets=PROJECTIONS)
    fresh = load_pretrained(folder)
    assert sorted(mn.lora.load_adapters(fresh, adapter)) == sorted(want)
    toks = tokens(VOCAB, (1, 10), seed=8)
    assert max_error(fresh(mx.array(toks)), peft_logits(folder, adapter, toks)) < LOGITS_TOL


def test_info_names_the_short_convolutions(checkpoints):
    _, _, folder = checkpoints["biased"]
    want = ["gated short convolution (width 3, with biases) on 2 of 4 layers", "q/k RMSNorm on the attention layers"]
    assert_info_features(folder, "Lfm2ForCausalLM", want)


def test_bad_configs_name_the_field():
    cfg = dict(CONFIGS["biased"], architectures=["Lfm2ForCausalLM"])
    with pytest.raises(UnsupportedConfigError, match=r"layer_types\[1\] = 'sliding_attention'"):
        mn.models.from_config(dict(cfg, layer_types=["conv", "sliding_attention", "conv", "conv"]))
    with pytest.raises(UnsupportedConfigError, match="layer_types must list one entry per layer"):
        mn.models.from_config(dict(cfg, layer_types=["conv"]))
    with pytest.raises(UnsupportedConfigError, match=r"conv_L_cache = 0 is not supported"):
        mn.models.from_config(dict(cfg, conv_L_cache=0))
    with pytest.raises(UnsupportedConfigError, match=r"lacks num_attention_heads"):
        mn.models.from_config({k: v for k, v in cfg.items() if k != "num_attention_heads"})


# -- GGUF ------------------------------------------------------------------------------------------------


def quantized(name, shape):
    """Whether the Q8_0 file stores this tensor quantized: matrices whose rows hold whole 32-value blocks."""
    return len(shape) == 2 and shape[1] % 32 == 0


# widths multiples of 32 (Q8_0 rows): intermediate 96 -> 64 after the adjustment
# (no conv_bias: llama.cpp's converter squeezes every conv.conv tensor and cannot write a bias)
GGUF_CONFIG = dict(BASE, num_hidden_layers=3, num_key_value_heads=2, intermediate_size=96, conv_L_cache=3,
                   conv_bias=False, block_multiple_of=32, tie_word_embeddings=False,
                   layer_types=["conv", "full_attention", "conv"])


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
def test_gguf_file_gives_transformers_logits_and_tokens(qtype, tmp_path):
    hf = lfm2(**GGUF_CONFIG)
    if qtype == Q.Q8_0:  # every matrix the Q8_0 file quantizes holds its Q8_0 round trip
        assert q8_0_values(hf, quantized) > 10
    model = load_pretrained(write_lfm2_gguf(tmp_path / "lfm2.gguf", hf, qtype))
    assert type(model) is mn.models.Lfm2ForCausalLM
    assert model.layer_kinds == GGUF_CONFIG["layer_types"] and not model.model.layers[0].conv.use_bias
    if qtype == Q.Q8_0:
        q = model.config["quantization"]
        assert q["model.layers.0.conv.in_proj"] == q["model.layers.1.self_attn.out_proj"] == {"ggml_type": "Q8_0"}
        assert "model.layers.0.conv.conv" not in q
    assert_logits_match(hf, model, VOCAB)
    prompt = tokens(VOCAB, (1, 6), seed=2)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()


def test_gguf_convolution_width_must_fit_the_metadata(tmp_path):
    """A file whose ``shortconv.l_cache`` does not match its kernels is refused naming the tensor."""
    bad = lfm2(**dict(GGUF_CONFIG, conv_L_cache=4))
    bad.config.conv_L_cache = 3  # the metadata says 3, the kernels hold 4 taps
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.conv\.conv\.weight"):
        load_pretrained(write_lfm2_gguf(tmp_path / "bad.gguf", bad))

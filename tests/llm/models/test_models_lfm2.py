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

import json
import os
import re

import gguf
import mlx.core as mx
import mlx.optimizers as optim
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

from commands import metalnn_cmd
from gguf_lfm2_files import write_lfm2_gguf
from hf_models import (hf_greedy, hf_logits, hf_loss_and_grads, hf_model, max_error, mn_loss_and_grads,
                       relative_error, save_and_load, tokens)
from peft_adapters import peft_logits, save_peft_adapter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOGITS_TOL = 2e-4
GRAD_TOL = 1e-3
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
    out = {}
    for name, kw in CONFIGS.items():
        hf = lfm2(**kw)
        folder = tmp_path_factory.mktemp(name)
        out[name] = (hf, save_and_load(hf, folder), folder)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert type(model) is mn.models.Lfm2ForCausalLM
    toks = tokens(VOCAB, (2, 15), seed=1)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < LOGITS_TOL, f"{name}: logits differ by {err:.3g}"
    short = toks[:, :2]  # fewer tokens than the convolution's width
    assert max_error(model(mx.array(short)), hf_logits(hf, short)) < LOGITS_TOL


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
    prompt = tokens(VOCAB, (3, 7), seed=2)
    want = hf_greedy(hf, prompt, 22)
    assert len(set(want[0].tolist())) > 3  # the random model does not just repeat one token
    assert mn.generate(model, prompt[0].tolist(), 22) == want[0].tolist()
    np.testing.assert_array_equal(np.array(mn.generate(model, mx.array(prompt), 22)), want)


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
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 11, 6, 1)]
    limits = [20, 9, 14, 21]
    gen = BatchGenerator(model, prefill_chunk=4)
    seqs = [gen.add(prompts[0], limits[0]), gen.add(prompts[1], limits[1])]
    steps = 0
    while gen:
        gen.step()
        steps += 1
        if steps == 2:
            seqs += [gen.add(p, n) for p, n in zip(prompts[2:], limits[2:])]
        assert steps < 200
    for seq, p, n in zip(seqs, prompts, limits):
        assert seq.tokens == hf_greedy(hf, np.array([p]), n)[0].tolist()


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
    toks = tokens(VOCAB, (2, 11), seed=3)
    ref_loss, ref = hf_loss_and_grads(hf, toks)
    loss, got = mn_loss_and_grads(model, toks)
    assert abs(loss - ref_loss) < GRAD_TOL * abs(ref_loss)
    ref = {("model.norm." + k[len("model.embedding_norm."):] if k.startswith("model.embedding_norm.") else k): v
           for k, v in ref.items()}
    assert set(got) == set(ref)
    must = ["model.layers.0.conv.conv.weight", "model.layers.0.conv.in_proj.weight",
            "model.layers.1.self_attn.q_layernorm.weight", "model.layers.1.self_attn.out_proj.weight",
            "model.layers.2.feed_forward.w3.weight", "model.norm.weight", "model.layers.0.operator_norm.weight"]
    if CONFIGS[name]["conv_bias"]:
        must += ["model.layers.0.conv.conv.bias", "model.layers.2.conv.in_proj.bias",
                 "model.layers.2.conv.out_proj.bias"]
    assert set(must) <= set(got)
    for k in ref:
        assert np.abs(ref[k]).max() > 0, k
        err = relative_error(got[k], ref[k])
        assert err < GRAD_TOL, f"{name}: gradient of {k} differs by {err:.3g} of its largest entry"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_pretrained_loads_in_transformers(name, checkpoints, tmp_path):
    hf, model, _ = checkpoints[name]
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Lfm2ForCausalLM"] and cfg["model_type"] == "lfm2"
    from safetensors.numpy import load_file
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "model.embedding_norm.weight" in names and "model.norm.weight" not in names
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(back) is type(hf) and back.config.layer_types == hf.config.layer_types
    toks = tokens(VOCAB, (1, 12), seed=4)
    assert max_error(hf_logits(back, toks), hf_logits(hf, toks)) < LOGITS_TOL
    assert max_error(load_pretrained(tmp_path)(mx.array(toks)), hf_logits(hf, toks)) < LOGITS_TOL


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
    mx.random.seed(0)
    model = load_pretrained(folder)
    paths = mn.lora.apply(model, rank=4, alpha=8.0, targets=PROJECTIONS)
    want = [f"model.layers.{i}.conv.{p}" for i in (0, 2) for p in ("in_proj", "out_proj")]
    want += [f"model.layers.{i}.self_attn.{p}" for i in (1, 3) for p in ("q_proj", "k_proj", "v_proj", "out_proj")]
    want += [f"model.layers.{i}.feed_forward.{p}" for i in range(4) for p in ("w1", "w2", "w3")]
    assert sorted(paths) == sorted(want)
    batch = mx.array(tokens(VOCAB, (4, 17), seed=7))
    loss = lambda m, b, d: mn.losses.cross_entropy(m(b[:, :-1], device=d), b[:, 1:])  # noqa: E731
    trainer = mn.Trainer(model, optim.Adam(2e-2), loss, mn.Device(seed=0), progress=False)
    trainer.fit(lambda step: batch, 4)
    losses = trainer.history["loss"]
    assert losses[-1] < losses[0] - 0.01, losses

    adapter = save_peft_adapter(folder, tmp_path / "peft", targets=PROJECTIONS)
    fresh = load_pretrained(folder)
    assert sorted(mn.lora.load_adapters(fresh, adapter)) == sorted(want)
    toks = tokens(VOCAB, (1, 10), seed=8)
    assert max_error(fresh(mx.array(toks)), peft_logits(folder, adapter, toks)) < LOGITS_TOL


def test_info_names_the_short_convolutions(checkpoints):
    _, _, folder = checkpoints["biased"]
    result = metalnn_cmd("info", folder)
    assert result.returncode == 0, result.stderr
    assert re.search(r"architecture\s+Lfm2ForCausalLM", result.stdout)
    want = ["gated short convolution (width 3, with biases) on 2 of 4 layers", "q/k RMSNorm on the attention layers"]
    assert re.search(r"features\s+" + re.escape("; ".join(want)) + "\n", result.stdout), result.stdout
    assert json.loads(metalnn_cmd("info", folder, "--json").stdout)["features"] == want


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


def q8_0_values(hf):
    """``hf`` with every matrix the Q8_0 file quantizes replaced by its Q8_0 round trip (a fixed point)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim == 2 and p.shape[1] % 32 == 0:
                a = p.numpy().astype(np.float32)
                back = gguf.quants.dequantize(gguf.quants.quantize(a, Q.Q8_0), Q.Q8_0)
                again = gguf.quants.dequantize(gguf.quants.quantize(back, Q.Q8_0), Q.Q8_0)
                assert np.array_equal(back, again)
                p.copy_(torch.from_numpy(back))
    return hf


# widths multiples of 32 (Q8_0 rows): intermediate 96 -> 64 after the adjustment
# (no conv_bias: llama.cpp's converter squeezes every conv.conv tensor and cannot write a bias)
GGUF_CONFIG = dict(BASE, num_hidden_layers=3, num_key_value_heads=2, intermediate_size=96, conv_L_cache=3,
                   conv_bias=False, block_multiple_of=32, tie_word_embeddings=False,
                   layer_types=["conv", "full_attention", "conv"])


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
def test_gguf_file_gives_transformers_logits_and_tokens(qtype, tmp_path):
    hf = lfm2(**GGUF_CONFIG)
    if qtype == Q.Q8_0:
        hf = q8_0_values(hf)
    model = load_pretrained(write_lfm2_gguf(tmp_path / "lfm2.gguf", hf, qtype))
    assert type(model) is mn.models.Lfm2ForCausalLM
    assert model.layer_kinds == GGUF_CONFIG["layer_types"] and not model.model.layers[0].conv.use_bias
    if qtype == Q.Q8_0:
        q = model.config["quantization"]
        assert q["model.layers.0.conv.in_proj"] == q["model.layers.1.self_attn.out_proj"] == {"ggml_type": "Q8_0"}
        assert "model.layers.0.conv.conv" not in q
    toks = tokens(VOCAB, (2, 13), seed=1)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < LOGITS_TOL, f"logits differ by {err:.3g}"
    prompt = tokens(VOCAB, (1, 6), seed=2)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()


def test_gguf_convolution_width_must_fit_the_metadata(tmp_path):
    """A file whose ``shortconv.l_cache`` does not match its kernels is refused naming the tensor."""
    bad = lfm2(**dict(GGUF_CONFIG, conv_L_cache=4))
    bad.config.conv_L_cache = 3  # the metadata says 3, the kernels hold 4 taps
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.conv\.conv\.weight"):
        load_pretrained(write_lfm2_gguf(tmp_path / "bad.gguf", bad))

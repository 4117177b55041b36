"""Gemma 2 and Gemma 3 (text) checkpoints against transformers, their GGUF files, LoRA, `metalnn info` and
continuous batching.

Tiny random models (three layers: sliding-window, global, sliding-window; a 4-token window shorter than the
prompts; ``query_pre_attn_scalar`` other than ``head_dim``; attention and final soft caps small enough to bite;
Gemma 3 with its own RoPE base per layer type and linear scaling on the global layers and q/k norms; untied
heads, as tiny tied models repeat one token; the GGUF files, which hold no head, test the tied one) are built with
a fixed torch seed, their zero-centred gains and biases moved off their initial values, saved with save_pretrained
and loaded with metalnn.llm.models.load_pretrained:

* logits within 2e-4 (absolute; two float32 implementations of a 3-layer model whose logits are O(1) agree
  to ~1e-6, so 2e-4 leaves room for summation order only);
* greedy generation token-identical for 24 tokens, batch 1 and 3, through the caches;
* loss and gradients of every parameter within 1e-3 of torch autograd, relative to the largest gradient entry
  (float32 backward through three layers);
* metalnn's save_pretrained writes a folder transformers loads back to the same logits (2e-4).

GGUF: transformers cannot write these layouts, so tests/support/gguf_gemma_files.py writes the files with gguf-py
following llama.cpp's converter (norms stored as ``1 + weight``, no ``lm_head``). llama.cpp's file carries no
``query_pre_attn_scalar`` (it scales by ``head_dim ** -0.5`` but for the 27B models), so these models use
``query_pre_attn_scalar = head_dim``; Gemma 3's files carry no layer pattern (llama.cpp: five local layers, then a
global one), so its model has six layers. Float32 files: 2e-4 as above. Q8_0 files are compared with transformers on
the same model whose quantized matrices were replaced by their Q8_0 values (quantize then dequantize with gguf-py),
so both hold identical weights and the same 2e-4 holds.
"""

import copy
import os

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

import metalnn as mn
from metalnn.cli.info import describe, format_facts
from metalnn.errors import UnsupportedConfigError
from metalnn.llm.models import load_pretrained
from metalnn.llm.tuner import lora

from gguf_gemma_files import quantizable, write
from gguf_writing import q8_0_values
from hf_models import hf_greedy, hf_logits, hf_model, lm_loss, max_error, perturb, saved_checkpoints, tokens
from model_checks import (LOGITS_TOL, assert_batched_rows_match, assert_bfloat16_as_close_as_transformers,
                          assert_greedy_matches, assert_logits_match, assert_loss_and_gradients_match,
                          assert_saved_folder_loads_in_transformers)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, initializer_range=0.2, sliding_window=4, max_position_embeddings=128)
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}}
FAMILIES = {
    # layers 0 and 2 slide (transformers' default), biases on the four projections
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(BASE, query_pre_attn_scalar=12, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                    attention_bias=True, tie_word_embeddings=False)),
    # a global layer every second one, RoPE per layer type
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(BASE, query_pre_attn_scalar=12, sliding_window_pattern=2, final_logit_softcapping=4.0,
                    tie_word_embeddings=False, rope_parameters=GEMMA3_ROPE)),
}
CLASSES = {"gemma2": mn.models.Gemma2ForCausalLM, "gemma3": mn.models.Gemma3ForCausalLM}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gemma(name, **overrides):
    cfg, cls, kw = FAMILIES[name]
    hf = hf_model(cfg, cls, **dict(kw, **overrides))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # biases start at zero: move them too
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=g) * 0.2)
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (transformers model, metalnn model, folder)}."""
    return saved_checkpoints(tmp_path_factory, {name: gemma(name) for name in FAMILIES})


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert type(model) is CLASSES[name]
    assert_logits_match(hf, model, VOCAB, label=name)


def test_the_soft_caps_change_these_models(checkpoints):
    """The caps bite in these configs (so matching transformers checks them): without them transformers'
    logits move by far more than the tolerance, and the capped logits stay inside the final cap."""
    toks = tokens(VOCAB, (2, 13), seed=1)
    hf, _, _ = checkpoints["gemma2"]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        uncapped = copy.deepcopy(hf)
        setattr(uncapped.config, key, None)
        for layer in uncapped.model.layers:
            layer.self_attn.attn_logit_softcapping = uncapped.config.attn_logit_softcapping
        assert max_error(hf_logits(uncapped, toks), hf_logits(hf, toks)) > 100 * LOGITS_TOL, key
    for name, cap in (("gemma2", 3.0), ("gemma3", 4.0)):
        logits = np.array(checkpoints[name][1](mx.array(toks)))
        assert 0.5 * cap < np.abs(logits).max() < cap


def test_layers_carry_the_configs_options(checkpoints):
    g2, g3 = checkpoints["gemma2"][1], checkpoints["gemma3"][1]
    attn2 = [b.self_attn for b in g2.model.layers]
    assert [a.sliding_window for a in attn2] == [4, None, 4]
    assert all(a.softcap == 2.0 and not a.qk_norm and a.scale == pytest.approx(12 ** -0.5) for a in attn2)
    assert g2.logit_softcap == 3.0 and g2.model.embed_scale == pytest.approx(32 ** 0.5)
    attn3 = [b.self_attn for b in g3.model.layers]
    assert [a.sliding_window for a in attn3] == [4, None, 4]
    assert [(a.rope_base, a.rope_scale) for a in attn3] == [(100.0, 1.0), (5000.0, 0.5), (100.0, 1.0)]
    assert all(a.qk_norm and a.norm_offset == 1.0 and a.softcap is None for a in attn3)
    # transformers' defaults: Gemma 2 slides on even layers, Gemma 3 on five of every six
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=7, num_attention_heads=4)
    d2 = mn.models.from_config(dict(cfg, architectures=["Gemma2ForCausalLM"]))
    assert [b.self_attn.sliding_window for b in d2.model.layers] == [4096, None] * 3 + [4096]
    assert d2.model.layers[0].self_attn.softcap == 50.0 and d2.logit_softcap == 30.0
    d3 = mn.models.from_config(dict(cfg, architectures=["Gemma3ForCausalLM"]))
    assert [b.self_attn.sliding_window is None for b in d3.model.layers] == [False] * 5 + [True, False]
    assert [b.self_attn.rope_base for b in d3.model.layers][4:6] == [10000.0, 1000000.0]
    assert d3.logit_softcap is None
    # older Gemma 3 configs: flat rope_theta / rope_scaling (global layers) and rope_local_base_freq
    old = mn.models.from_config(dict(cfg, architectures=["Gemma3ForCausalLM"], rope_theta=2e5,
                                     rope_local_base_freq=50.0, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert [(b.self_attn.rope_base, b.self_attn.rope_scale) for b in old.model.layers][4:6] == [(50.0, 1.0),
                                                                                               (2e5, 0.125)]


def test_windows_reach_no_further_than_the_window(checkpoints):
    """Gemma 3 with every layer sliding: tokens further back than the windows allow do not change the logits."""
    hf = gemma("gemma3", layer_types=["sliding_attention"] * 3)
    model = mn.models.from_config(hf.config.to_dict() | {"architectures": ["Gemma3ForCausalLM"]})
    model.load_weights_from({k: mx.array(v.detach().numpy()) for k, v in hf.state_dict().items()})
    toks = tokens(VOCAB, (1, 14), seed=5)
    other = toks.copy()
    other[0, :2] = (other[0, :2] + 1) % VOCAB
    a, b = np.array(model(mx.array(toks))), np.array(model(mx.array(other)))
    # three layers of a 4-token window: position p sees inputs from p - 9 on
    np.testing.assert_allclose(a[0, 11:], b[0, 11:], atol=1e-6)
    assert np.abs(a[0, 2:11] - b[0, 2:11]).max() > 1e-3
    assert max_error(a, hf_logits(hf, toks)) < LOGITS_TOL


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_matches_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert_greedy_matches(hf, model, VOCAB, n=24, label=name)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_loss_and_gradients_match_torch(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert_loss_and_gradients_match(hf, model, VOCAB, must_include=["model.layers.1.post_feedforward_layernorm.weight"],
                                    label=name)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_save_pretrained_loads_in_transformers(name, checkpoints, tmp_path):
    hf, model, _ = checkpoints[name]
    assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB, architecture=CLASSES[name].architecture,
                                              model_type=CLASSES[name].model_type)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bfloat16_is_as_close_as_transformers_bfloat16(name, checkpoints):
    """Loaded in bfloat16, the logits stay as close to a float32 run on the bfloat16-rounded weights as
    transformers' own bfloat16 run does (1.5x its error as margin for a different summation order)."""
    _, _, folder = checkpoints[name]
    model = assert_bfloat16_as_close_as_transformers(folder, VOCAB)
    assert model.model.layers[0].mlp.up_proj.weight.dtype == mx.bfloat16


@pytest.mark.parametrize("name", list(FAMILIES))
def test_lora_on_every_projection_trains(name, checkpoints):
    _, _, folder = checkpoints[name]
    model = load_pretrained(folder)
    mx.random.seed(0)
    paths = lora.apply(model, rank=4, alpha=8.0, targets=PROJECTIONS)
    assert len(paths) == len(PROJECTIONS) * 3
    assert {p.rpartition(".")[2] for p in paths} == set(PROJECTIONS)
    data = mx.array(tokens(VOCAB, (4, 17), seed=6))
    trainer = mn.Trainer(model, optim.Adam(2e-2), lm_loss, mn.Device(seed=0), progress=False)
    trainer.fit(lambda step: data, 8)
    losses = trainer.history["loss"]
    assert losses[-1] < 0.95 * losses[0], losses
    assert all(".lora_" in n for n in lora.trainable_names(model))


def test_info_lists_the_features(checkpoints):
    text2 = format_facts(describe(checkpoints["gemma2"][2]))
    for words in ("Gemma2ForCausalLM", "norms before and after attention and MLP", "embedding scaled by sqrt(32)",
                  "sliding window 4 on 2 of 3 layers", "attention soft cap 2", "final logit soft cap 3",
                  "query_pre_attn_scalar 12"):
        assert words in text2, (words, text2)
    facts3 = describe(checkpoints["gemma3"][2])
    assert "q/k norms" in facts3["features"] and "RoPE base 100 on local layers" in facts3["features"]
    assert "RoPE base 5000 on global layers, scale 0.5" in facts3["features"]
    assert not any("attention soft cap" in f for f in facts3["features"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_batched_rows_get_their_lone_greedy_tokens(name, checkpoints):
    """`BatchGenerator` (chunked prefill, left-aligned per-row caches, rows joining while others decode): each
    row's tokens are transformers' greedy continuation of its prompt alone."""
    hf, model, _ = checkpoints[name]
    assert_batched_rows_match(hf, model, VOCAB, seed=9, prompt_lengths=(9, 3, 6), limits=(14, 20, 9), first=1,
                              join_after=2, prefill_chunk=4)


# -- GGUF ---------------------------------------------------------------------------------------------------------

GGUF_MODELS = {"gemma2": dict(query_pre_attn_scalar=16, attention_bias=False, tie_word_embeddings=True),
               "gemma3": dict(query_pre_attn_scalar=16, num_hidden_layers=6, sliding_window_pattern=6,
                              tie_word_embeddings=True)}


@pytest.fixture(scope="module")
def gguf_models():
    return {name: gemma(name, **kw) for name, kw in GGUF_MODELS.items()}


def q8_0_copy(hf):
    """A copy of ``hf`` whose matrices the Q8_0 file quantizes hold their Q8_0 values."""
    out = copy.deepcopy(hf)
    assert q8_0_values(out, quantizable) > 5
    return out


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("name", list(GGUF_MODELS))
def test_gguf_files_give_transformers_logits(name, qtype, gguf_models, tmp_path):
    hf = gguf_models[name]
    model = load_pretrained(write(tmp_path / f"{name}.gguf", hf, name, qtype=qtype))
    assert type(model) is CLASSES[name]
    ref = hf if qtype == Q.F32 else q8_0_copy(hf)
    toks = tokens(VOCAB, (2, 13), seed=1)
    err = max_error(model(mx.array(toks)), hf_logits(ref, toks))
    assert err < LOGITS_TOL, f"{name} {qtype.name}: logits differ by {err:.3g}"
    windows = [b.self_attn.sliding_window for b in model.model.layers]
    assert windows == ([4, None, 4] if name == "gemma2" else [4] * 5 + [None])
    prompt = tokens(VOCAB, (1, 6), seed=2)
    assert mn.generate(model, prompt[0].tolist(), 12) == hf_greedy(ref, prompt, 12)[0].tolist()


def test_gguf_metadata_llama_cpp_reads(gguf_models, tmp_path):
    """What the files leave out takes llama.cpp's values; a sliding-window pattern key is honoured."""
    g2 = load_pretrained(write(tmp_path / "a.gguf", gguf_models["gemma2"], "gemma2", metadata={
        "attn_logit_softcapping": (None, None), "final_logit_softcapping": (None, None),
        "attention.sliding_window_pattern": (3, V.UINT32)}))
    assert g2.model.layers[0].self_attn.softcap == 50.0 and g2.logit_softcap == 30.0
    assert [b.self_attn.sliding_window for b in g2.model.layers] == [4, 4, None]
    g3 = load_pretrained(write(tmp_path / "b.gguf", gguf_models["gemma3"], "gemma3", metadata={
        "attention.sliding_window": (None, None), "rope.freq_base_swa": (None, None)}))
    assert all(b.self_attn.sliding_window is None for b in g3.model.layers)
    assert g3.model.layers[0].self_attn.rope_base == 5000.0  # no local layers: every layer global
    g3 = load_pretrained(write(tmp_path / "c.gguf", gguf_models["gemma3"], "gemma3", metadata={
        "rope.freq_base_swa": (None, None)}))
    assert g3.model.layers[0].self_attn.rope_base == 10000.0  # llama.cpp's local default
    with pytest.raises(UnsupportedConfigError, match="sliding_window_pattern"):
        load_pretrained(write(tmp_path / "d.gguf", gguf_models["gemma2"], "gemma2", metadata={
            "attention.sliding_window_pattern": ([True, False, True], V.ARRAY)}))


# -- configs ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, key, value, words", [
    ("Gemma2ForCausalLM", "hidden_activation", "silu", "hidden_activation = 'silu' is not supported (supported: "
                                                       "gelu_pytorch_tanh"),
    ("Gemma2ForCausalLM", "use_bidirectional_attention", True, "use_bidirectional_attention = True is not supported"),
    ("Gemma2ForCausalLM", "attn_logit_softcapping", -1.0, "attn_logit_softcapping = -1.0 is not supported"),
    ("Gemma3ForCausalLM", "layer_types", ["sliding_attention", "chunked_attention", "full_attention"],
     "layer_types[1] = 'chunked_attention' is not supported"),
    ("Gemma3ForCausalLM", "query_pre_attn_scalar", 0, "query_pre_attn_scalar = 0.0 is not supported"),
    ("Gemma3ForCausalLM", "rope_parameters", {"full_attention": {"rope_type": "dynamic", "factor": 2.0}},
     "rope type 'dynamic' is not supported"),
])
def test_unsupported_values_are_named(arch, key, value, words):
    cfg = dict(BASE, architectures=[arch])
    cfg[key] = value
    with pytest.raises(UnsupportedConfigError, match=f"^{arch}: ") as e:
        mn.models.from_config(cfg)
    assert words in str(e.value)


def test_a_multimodal_gemma3_folder_loads_its_text_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder (the 4B and larger checkpoints): the text model loads
    from ``text_config`` and ``model.language_model.*`` (the vision tower and projector are left out)
    and gives transformers' logits for text-only input; the same with transformers 4's layout
    (``language_model.model.*``)."""
    _, _, text = FAMILIES["gemma3"]
    # without a final soft cap, as the released Gemma 3 configs (transformers' multimodal class does not
    # apply the text config's cap; its text-only class does, as metalnn)
    text = dict(text, final_logit_softcapping=None)
    torch.manual_seed(0)
    cfg = transformers.Gemma3Config(
        text_config=text, tie_word_embeddings=True,
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8), mm_tokens_per_image=4, attn_implementation="eager")
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    perturb(hf, 3)
    hf.save_pretrained(tmp_path / "new")
    model = load_pretrained(tmp_path / "new")
    assert type(model) is mn.models.Gemma3ForCausalLM and model.tie_word_embeddings
    toks = tokens(VOCAB, (2, 11), seed=8)
    assert max_error(model(mx.array(toks)), hf_logits(hf, toks)) < LOGITS_TOL
    # transformers 4's names for the same tensors
    moves = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
             ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))
    renamed = {}
    for k, v in mn.load_safetensors(tmp_path / "new" / "model.safetensors").items():
        for old, new in moves:
            if k.startswith(old):
                k = new + k[len(old):]
                break
        renamed[k] = v
    assert any(k.startswith("language_model.model.layers.") for k in renamed)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text((tmp_path / "new" / "config.json").read_text())
    mn.save_safetensors(tmp_path / "old" / "model.safetensors", renamed)
    assert max_error(load_pretrained(tmp_path / "old")(mx.array(toks)), hf_logits(hf, toks)) < LOGITS_TOL

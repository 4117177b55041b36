"""Granite 4 hybrid (`GraniteMoeHybridForCausalLM`: Mamba2 and attention layers, experts plus a
shared MLP) against transformers' ``GraniteMoeHybridForCausalLM``.

Tiny random models are saved with save_pretrained and loaded with metalnn; `perturb` (here) moves
the gains, dt_bias, A_log, D and the convolution biases off their initial values. Two configs:

* ``moe_rope``: 3 layers (mamba, attention, mamba), 2 of 4 experts per token plus the shared MLP,
  rotary embeddings, 2 groups of B/C, every multiplier away from 1, an untied head;
* ``dense_nope``: 3 layers (attention, mamba, mamba), no experts (the shared MLP alone), no
  position embeddings, one group, projection biases and no convolution bias, a 3-wide
  convolution, tied embeddings.

The Mamba2 layers run with chunk_size 8 here, so a 20-token prompt spans three chunks.

Tolerances: logits 2e-4 absolute (float32 against float32; measured about 1e-6); loss and
gradients 1e-3 relative to the largest entry of each gradient (float32 backward; measured below
1e-5); the emulated Metal kernels against the reference path 1e-4 (kernels sum in another order);
greedy tokens identical for 22 tokens, batch 1 and 3 and through `BatchGenerator` rows.
"""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

import metalnn as mn
from metalnn.errors import UnsupportedConfigError
from metalnn.llm.models import load_pretrained

from hf_models import hf_greedy, hf_logits, hf_model, max_error, saved_checkpoints, tokens
from model_checks import (LOGITS_TOL, assert_batched_rows_match, assert_emulated_kernels_match,
                          assert_greedy_matches, assert_info_features, assert_logits_match,
                          assert_loss_and_gradients_match, assert_lora_trains,
                          assert_saved_folder_loads_in_transformers)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, initializer_range=0.2,
            intermediate_size=8, shared_intermediate_size=12, mamba_chunk_size=8, mamba_expand=2,
            max_position_embeddings=256)
CONFIGS = {
    "moe_rope": dict(BASE, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4,
                     mamba_d_head=16, mamba_d_state=6, mamba_n_groups=2, num_local_experts=4, num_experts_per_tok=2,
                     position_embedding_type="rope", embedding_multiplier=1.7, attention_multiplier=0.3,
                     residual_multiplier=0.6, logits_scaling=2.5, tie_word_embeddings=False),
    "dense_nope": dict(BASE, num_key_value_heads=1, layer_types=["attention", "mamba", "mamba"], mamba_n_heads=2,
                       mamba_d_head=32, mamba_d_state=5, mamba_n_groups=1, mamba_d_conv=3, mamba_conv_bias=False,
                       mamba_proj_bias=True, num_local_experts=0, position_embedding_type=None,
                       embedding_multiplier=2.0, residual_multiplier=0.8, logits_scaling=0.7, tie_word_embeddings=True),
}
MIXERS = {"moe_rope": ["mamba", "self_attn", "mamba"], "dense_nope": ["self_attn", "mamba", "mamba"]}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "input_linear", "output_linear")


def perturb(hf, seed=0):
    """Move what `hf_models.hf_model` leaves at its initial value: D and the convolution biases."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for module in hf.modules():
            if hasattr(module, "D") and hasattr(module, "conv1d"):
                module.D.copy_(torch.rand(module.D.shape, generator=g) * 2 - 1)
                if module.conv1d.bias is not None:
                    module.conv1d.bias.copy_(torch.rand(module.conv1d.bias.shape, generator=g) - 0.5)
                if module.in_proj.bias is not None:
                    module.in_proj.bias.copy_(torch.rand(module.in_proj.bias.shape, generator=g) - 0.5)
    return hf


def small_chunks(model, size=8):
    for block in model.model.layers:
        if "mamba" in block:
            block.mamba.chunk_size = size
    return model


def build(name):
    return perturb(hf_model(transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM,
                            **CONFIGS[name]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{config name: (transformers model, metalnn model, folder)}."""
    return saved_checkpoints(tmp_path_factory, {name: build(name) for name in CONFIGS}, prepare=small_chunks)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert type(model) is mn.models.GraniteMoeHybridForCausalLM
    assert [b.mixer_name for b in model.model.layers] == MIXERS[name]
    assert all(("block_sparse_moe" in b) == (name == "moe_rope") for b in model.model.layers)
    toks = tokens(VOCAB, (2, 20), seed=1)
    assert_logits_match(hf, model, VOCAB, toks=toks, label=name)
    # below 16 tokens the recurrent form runs
    assert_logits_match(hf, model, VOCAB, toks=toks[:, :5], label=f"{name}, 5 tokens")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(name, checkpoints, monkeypatch):
    """Prefill (chunked scan) then one recurrent step per token, against transformers' cache; the
    fused decoding step of Llama-like blocks never takes these blocks."""
    from metalnn.layers import transformer

    calls = []
    real = transformer.F.decoder_block_step
    monkeypatch.setattr(transformer.F, "decoder_block_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    hf, model, _ = checkpoints[name]
    assert_greedy_matches(hf, model, VOCAB, n=22, shape=(3, 18), label=name)
    assert not calls
    kinds = ["Mamba2Cache" if m == "mamba" else "KVCache" for m in MIXERS[name]]
    assert [type(c).__name__ for c in model.make_cache()] == kinds


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_rows_get_their_lone_greedy_tokens(name, checkpoints):
    """`BatchGenerator` (chunked prefill, left-aligned rows at their own positions): each row's
    tokens are transformers' greedy continuation of its prompt alone; rows join while others decode."""
    hf, model, _ = checkpoints[name]
    assert_batched_rows_match(hf, model, VOCAB)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradients_match_torch(name, checkpoints):
    hf, model, _ = checkpoints[name]
    i = MIXERS[name].index("mamba")
    must = [f"model.layers.{i}.mamba.{p}" for p in ("A_log", "dt_bias", "D", "conv1d.weight", "in_proj.weight",
                                                    "norm.weight")]
    if name == "moe_rope":
        must += ["model.layers.0.block_sparse_moe.experts.gate_up_proj", "model.layers.1.block_sparse_moe.gate.weight"]
    assert_loss_and_gradients_match(hf, model, VOCAB, shape=(2, 19), must_include=must, nonzero=True,
                                    rename=model.rename_weight, label=name)


def test_aux_loss_matches_transformers(checkpoints):
    hf, model, _ = checkpoints["moe_rope"]
    toks = tokens(VOCAB, (2, 9), seed=4)
    with torch.no_grad():
        want = hf(torch.tensor(toks), output_router_logits=True).aux_loss.item()
    model.output_router_logits = True
    try:
        model(mx.array(toks))
        assert abs(model.aux_loss().item() - want) < 1e-5 * want
    finally:
        model.output_router_logits = False


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_pretrained_loads_in_transformers(name, checkpoints, tmp_path):
    hf, model, _ = checkpoints[name]
    assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB, architecture="GraniteMoeHybridForCausalLM",
                                              model_type="granitemoehybrid", seed=5, reload=True)


def test_emulated_kernels_give_the_reference_logits_and_gradients(checkpoints, monkeypatch):
    """The whole model on the emulated Metal kernels (SSD scan forward and backward, RMSNorm, RoPE,
    attention) equals the reference path."""
    _, model, _ = checkpoints["moe_rope"]
    assert_emulated_kernels_match(model, VOCAB, monkeypatch, {"ssd_forward", "ssd_backward"})


def test_lora_on_every_projection_trains(checkpoints):
    _, _, folder = checkpoints["moe_rope"]
    want = [f"model.layers.1.self_attn.{p}" for p in PROJECTIONS[:4]]
    want += [f"model.layers.{i}.mamba.{p}" for i in (0, 2) for p in ("in_proj", "out_proj")]
    want += [f"model.layers.{i}.shared_mlp.{p}" for i in range(3) for p in ("input_linear", "output_linear")]
    assert_lora_trains(folder, VOCAB, PROJECTIONS, want, prepare=small_chunks)


def test_info_names_the_hybrid_layers(checkpoints):
    assert_info_features(checkpoints["moe_rope"][2], "GraniteMoeHybridForCausalLM", [
        "hybrid: 2 Mamba2 (state-space) layers, 1 attention layers",
        "mixture of experts: 2 of 4 experts per token, plus a shared MLP", "rotary embeddings",
        "multipliers: embedding_multiplier 1.7, attention_multiplier 0.3, residual_multiplier 0.6, "
        "logits_scaling 2.5"])


def test_config_forms_and_bad_configs(checkpoints):
    _, _, folder = checkpoints["dense_nope"]
    cfg = json.loads((folder / "config.json").read_text())
    # transformers 5 writes linear_attention / full_attention and {"__float__": "Infinity"}; the Hub's
    # configs say mamba / attention
    assert cfg["layer_types"] == ["full_attention", "linear_attention", "linear_attention"]
    model = mn.models.from_config(dict(cfg, layer_types=["attention", "mamba", "mamba"],
                                       time_step_limit=[0.001, "inf"]))
    assert model.layer_kinds == ["attention", "mamba", "mamba"] and model.args.time_step_limit == [0.001, float("inf")]
    with pytest.raises(UnsupportedConfigError, match=r"layer_types\[1\] = 'sliding_attention'"):
        mn.models.from_config(dict(cfg, layer_types=["mamba", "sliding_attention", "mamba"]))
    with pytest.raises(UnsupportedConfigError, match="layer_types must list one entry per layer"):
        mn.models.from_config(dict(cfg, layer_types=["mamba"]))
    with pytest.raises(UnsupportedConfigError, match=r"mamba_d_head = 5"):
        mn.models.from_config(dict(cfg, mamba_d_head=5))
    with pytest.raises(UnsupportedConfigError, match=r"mamba_n_groups = 3"):
        mn.models.from_config(dict(cfg, mamba_n_groups=3))
    with pytest.raises(UnsupportedConfigError, match=r"position_embedding_type = 'alibi'"):
        mn.models.from_config(dict(cfg, position_embedding_type="alibi"))
    with pytest.raises(UnsupportedConfigError, match=r"time_step_limit = \[0.1\]"):
        mn.models.from_config(dict(cfg, time_step_limit=[0.1]))


# -- GGUF ------------------------------------------------------------------------------------------------
# llama.cpp's granitehybrid graph has no rotary embedding on a hybrid, so the GGUF models are the two
# configs without it. gguf_granite_files writes them the converter's way (checked against
# convert_hf_to_gguf.py itself on both configs: the same tensor names, types, shapes and bytes, and the
# same non-tokenizer metadata, for --outtype f32 and q8_0).


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_file_gives_transformers_logits_and_tokens(name, qtype, tmp_path):
    import gguf_granite_files
    from gguf import GGMLQuantizationType as Q

    hf = perturb(hf_model(transformers.GraniteMoeHybridConfig, transformers.GraniteMoeHybridForCausalLM,
                          **dict(CONFIGS[name], position_embedding_type=None)))
    if qtype == "Q8_0":  # transformers holds the same Q8_0 / F16 values the file does
        hf = gguf_granite_files.q8_0_values(hf)
    path = gguf_granite_files.write(tmp_path / "granite.gguf", hf, qtype=getattr(Q, qtype))
    model = small_chunks(load_pretrained(path))
    assert type(model) is mn.models.GraniteMoeHybridForCausalLM
    assert [b.mixer_name for b in model.model.layers] == MIXERS[name]
    # (GGUF keeps the multipliers as float32)
    assert model.args.rope is None and model.args.logits_scaling == np.float32(CONFIGS[name]["logits_scaling"])
    if qtype == "Q8_0":
        assert "quantization" in model.config  # the 32-wide matrices stay Q8_0 (as MLX's 8-bit groups)
        i = MIXERS[name].index("mamba")
        assert type(model.model.layers[i].mamba.in_proj).__name__ == "QuantizedLinear"
    toks = tokens(VOCAB, (2, 20), seed=1)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < LOGITS_TOL, f"{name} {qtype}: logits differ by {err:.3g}"
    prompt = tokens(VOCAB, (1, 9), seed=2)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()

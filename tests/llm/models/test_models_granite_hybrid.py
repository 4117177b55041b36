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
import re

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
import torch
import transformers
from mlx.utils import tree_flatten

import metalnn as mn
from metalnn.errors import UnsupportedConfigError
from metalnn.llm.batching import BatchGenerator
from metalnn.llm.models import load_pretrained

from commands import metalnn_cmd
from hf_models import (hf_greedy, hf_logits, hf_loss_and_grads, hf_model, lm_loss, max_error, mn_loss_and_grads,
                       relative_error, tokens)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOGITS_TOL = 2e-4
GRAD_TOL = 1e-3
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
    out = {}
    for name in CONFIGS:
        hf = build(name)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        out[name] = (hf, small_chunks(load_pretrained(folder)), folder)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert type(model) is mn.models.GraniteMoeHybridForCausalLM
    assert [b.mixer_name for b in model.model.layers] == MIXERS[name]
    assert all(("block_sparse_moe" in b) == (name == "moe_rope") for b in model.model.layers)
    toks = tokens(VOCAB, (2, 20), seed=1)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < LOGITS_TOL, f"{name}: logits differ by {err:.3g}"
    short = toks[:, :5]  # below 16 tokens the recurrent form runs
    assert max_error(model(mx.array(short)), hf_logits(hf, short)) < LOGITS_TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(name, checkpoints, monkeypatch):
    """Prefill (chunked scan) then one recurrent step per token, against transformers' cache; the
    fused decoding step of Llama-like blocks never takes these blocks."""
    from metalnn.layers import transformer

    calls = []
    real = transformer.F.decoder_block_step
    monkeypatch.setattr(transformer.F, "decoder_block_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    hf, model, _ = checkpoints[name]
    prompt = tokens(VOCAB, (3, 18), seed=2)
    want = hf_greedy(hf, prompt, 22)
    assert len(set(want[0].tolist())) > 3
    assert mn.generate(model, prompt[0].tolist(), 22) == want[0].tolist()
    np.testing.assert_array_equal(np.array(mn.generate(model, mx.array(prompt), 22)), want)
    assert not calls
    kinds = ["Mamba2Cache" if m == "mamba" else "KVCache" for m in MIXERS[name]]
    assert [type(c).__name__ for c in model.make_cache()] == kinds


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_rows_get_their_lone_greedy_tokens(name, checkpoints):
    """`BatchGenerator` (chunked prefill, left-aligned rows at their own positions): each row's
    tokens are transformers' greedy continuation of its prompt alone; rows join while others decode."""
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


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradients_match_torch(name, checkpoints):
    hf, model, _ = checkpoints[name]
    toks = tokens(VOCAB, (2, 19), seed=3)
    ref_loss, ref = hf_loss_and_grads(hf, toks)
    loss, got = mn_loss_and_grads(model, toks)
    assert abs(loss - ref_loss) < GRAD_TOL * abs(ref_loss)
    renamed = {model.rename_weight(k): k for k in ref}
    assert set(got) == set(renamed)
    i = MIXERS[name].index("mamba")
    must = [f"model.layers.{i}.mamba.{p}" for p in ("A_log", "dt_bias", "D", "conv1d.weight", "in_proj.weight",
                                                    "norm.weight")]
    if name == "moe_rope":
        must += ["model.layers.0.block_sparse_moe.experts.gate_up_proj", "model.layers.1.block_sparse_moe.gate.weight"]
    assert set(must) <= set(got)
    for k, ref_name in renamed.items():
        assert np.abs(ref[ref_name]).max() > 0, ref_name
        err = relative_error(got[k], ref[ref_name])
        assert err < GRAD_TOL, f"{name}: gradient of {k} differs by {err:.3g} of its largest entry"


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
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["GraniteMoeHybridForCausalLM"] and cfg["model_type"] == "granitemoehybrid"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(back) is type(hf)
    toks = tokens(VOCAB, (1, 12), seed=5)
    assert max_error(hf_logits(back, toks), hf_logits(hf, toks)) < LOGITS_TOL
    assert max_error(load_pretrained(tmp_path)(mx.array(toks)), hf_logits(hf, toks)) < LOGITS_TOL


def test_emulated_kernels_give_the_reference_logits_and_gradients(checkpoints, monkeypatch):
    """The whole model on the emulated Metal kernels (SSD scan forward and backward, RMSNorm, RoPE,
    attention) equals the reference path."""
    from kernel_cases import spy_launches

    _, model, _ = checkpoints["moe_rope"]
    toks = mx.array(tokens(VOCAB, (1, 7), seed=7))
    ref_dev, emu_dev = mn.Device(kernels="reference"), mn.Device(kernels="emulate")
    launches = spy_launches(monkeypatch)
    np.testing.assert_allclose(np.array(model(toks, device=emu_dev)), np.array(model(toks, device=ref_dev)),
                               atol=1e-4)
    g_ref = dict(tree_flatten(nn.value_and_grad(model, lambda t: lm_loss(model, t, ref_dev))(toks)[1]))
    g_emu = dict(tree_flatten(nn.value_and_grad(model, lambda t: lm_loss(model, t, emu_dev))(toks)[1]))
    ran = launches.names()
    assert {"ssd_forward", "ssd_backward"} <= ran, ran
    assert g_ref.keys() == g_emu.keys()
    for k in g_ref:
        np.testing.assert_allclose(np.array(g_emu[k]), np.array(g_ref[k]), atol=1e-4, err_msg=k)


def test_lora_on_every_projection_trains(checkpoints):
    _, _, folder = checkpoints["moe_rope"]
    mx.random.seed(0)
    model = small_chunks(load_pretrained(folder))
    paths = mn.lora.apply(model, rank=4, alpha=8.0, targets=PROJECTIONS)
    want = [f"model.layers.1.self_attn.{p}" for p in PROJECTIONS[:4]]
    want += [f"model.layers.{i}.mamba.{p}" for i in (0, 2) for p in ("in_proj", "out_proj")]
    want += [f"model.layers.{i}.shared_mlp.{p}" for i in range(3) for p in ("input_linear", "output_linear")]
    assert sorted(paths) == sorted(want)
    batch = mx.array(tokens(VOCAB, (4, 17), seed=7))
    loss = lambda m, b, d: mn.losses.cross_entropy(m(b[:, :-1], device=d), b[:, 1:])  # noqa: E731
    trainer = mn.Trainer(model, optim.Adam(2e-2), loss, mn.Device(seed=0), progress=False)
    trainer.fit(lambda step: batch, 4)
    losses = trainer.history["loss"]
    assert losses[-1] < losses[0] - 0.01, losses


def test_info_names_the_hybrid_layers(checkpoints):
    _, _, folder = checkpoints["moe_rope"]
    result = metalnn_cmd("info", folder)
    assert result.returncode == 0, result.stderr
    assert re.search(r"architecture\s+GraniteMoeHybridForCausalLM", result.stdout)
    want = ["hybrid: 2 Mamba2 (state-space) layers, 1 attention layers",
            "mixture of experts: 2 of 4 experts per token, plus a shared MLP", "rotary embeddings",
            "multipliers: embedding_multiplier 1.7, attention_multiplier 0.3, residual_multiplier 0.6, "
            "logits_scaling 2.5"]
    assert re.search(r"features\s+" + re.escape("; ".join(want)) + "\n", result.stdout), result.stdout
    assert json.loads(metalnn_cmd("info", folder, "--json").stdout)["features"] == want


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

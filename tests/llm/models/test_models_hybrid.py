"""Qwen3.5 and Qwen3-Next (Gated DeltaNet + gated attention hybrids; Qwen3-Next with sparse experts)
against transformers.

Tiny random models (both layer types; grouped linear-attention heads with Dk != Dv; partial rotary
embeddings; Qwen3.5 with tied embeddings; Qwen3-Next with 2 of 4 experts per token, a shared expert
and a dense layer from mlp_only_layers) have their zero-centred gains, gated-norm gains, dt_bias and
A_log moved off their initial values, are saved with save_pretrained and loaded with metalnn.

Tolerances: logits 2e-4 absolute (float32 against float32; measured up to 2e-5); loss and gradients
1e-3 relative to the largest entry of each gradient (float32 backward through the chunked rule,
measured up to 5e-5); the emulated Metal kernels against the reference path 1e-4 (kernels sum in another order).
The linear-attention layers run with chunk_size 8 here, so a 20-token prompt spans three chunks.
"""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

import metalnn as mn
from metalnn.errors import UnsupportedConfigError, WeightLoadError
from metalnn.llm.models import load_pretrained

from memory import peak_above_active
from hf_models import hf_logits, hf_model, lm_loss, max_error, saved_checkpoints, small_chunks, tokens
from model_checks import (LOGITS_TOL, assert_aux_loss_matches, assert_bfloat16_as_close_as_transformers,
                          assert_emulated_kernels_match, assert_greedy_matches, assert_logits_match,
                          assert_loss_and_gradients_match, assert_saved_folder_loads_in_transformers)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
HYBRID = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, initializer_range=0.2,
              layer_types=["linear_attention", "full_attention", "linear_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
FAMILIES = {
    "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM,
                dict(HYBRID, tie_word_embeddings=True)),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM,
                   dict(HYBRID, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=8, shared_expert_intermediate_size=12, norm_topk_prob=True,
                        decoder_sparse_step=1, mlp_only_layers=[2])),
}
CLASSES = {"qwen3_5": mn.models.Qwen3_5ForCausalLM, "qwen3_next": mn.models.Qwen3NextForCausalLM}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: (transformers model, metalnn model, folder)}."""
    models = {name: hf_model(cfg, cls, **kw) for name, (cfg, cls, kw) in FAMILIES.items()}
    return saved_checkpoints(tmp_path_factory, models, prepare=small_chunks)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert type(model) is CLASSES[name]
    kinds = [("linear_attn" in b, "self_attn" in b) for b in model.model.layers]
    assert kinds == [(True, False), (False, True), (True, False)]
    toks = tokens(VOCAB, (2, 20), seed=1)
    assert_logits_match(hf, model, VOCAB, toks=toks, label=name)
    short = toks[:, :5]  # below 16 tokens the recurrent form runs
    assert_logits_match(hf, model, VOCAB, toks=short, label=f"{name}, 5 tokens")


def test_experts_per_token_and_shared_expert(checkpoints):
    _, model, _ = checkpoints["qwen3_next"]
    moe = [b.mlp for b in model.model.layers]
    assert [type(m).__name__ for m in moe] == ["SparseMoE", "SparseMoE", "SwiGLU"]
    assert moe[0].top_k == 2 and moe[0].num_experts == 4 and "shared_expert" in moe[0]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_generation_matches_transformers(name, checkpoints):
    """Prefill (chunked rule) then one recurrent step per token, against transformers' cache."""
    hf, model, _ = checkpoints[name]
    assert_greedy_matches(hf, model, VOCAB, n=22, shape=(3, 18), label=name)
    cache = model.make_cache()
    assert [type(c).__name__ for c in cache] == ["GatedDeltaCache", "KVCache", "GatedDeltaCache"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_loss_and_gradients_match_torch(name, checkpoints):
    hf, model, _ = checkpoints[name]
    must = ["model.embed_tokens.weight", "model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias",
            "model.layers.0.linear_attn.conv1d.weight", "model.layers.1.self_attn.q_proj.weight"]
    if name == "qwen3_next":
        must += ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                 "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.shared_expert_gate.weight"]
    assert_loss_and_gradients_match(hf, model, VOCAB, shape=(2, 19), must_include=must, nonzero=True, label=name)


def test_aux_loss_matches_transformers(checkpoints):
    """The load-balancing loss, added with router_aux_loss_coef, and the gradients of the total."""
    hf, model, _ = checkpoints["qwen3_next"]
    assert_aux_loss_matches(hf, model, VOCAB, ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_save_pretrained_loads_in_transformers(name, checkpoints, tmp_path):
    hf, model, _ = checkpoints[name]
    assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB, architecture=CLASSES[name].architecture,
                                              model_type=CLASSES[name].model_type, seed=5, reload=True)


def test_bfloat16_is_as_close_as_transformers_bfloat16(checkpoints):
    """Loaded in bfloat16 (experts through the CPU's float32 fallback of gather_mm), the logits
    stay as close to a float32 run on the bfloat16-rounded weights as transformers' own bfloat16
    run does (1.5x its error as margin for a different summation order)."""
    _, _, folder = checkpoints["qwen3_next"]
    model = assert_bfloat16_as_close_as_transformers(folder, VOCAB)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == mx.bfloat16


def test_text_model_of_a_multimodal_qwen3_5_folder(tmp_path):
    """A Qwen3_5ForConditionalGeneration folder: the text model loads (vision tower dropped) and
    gives transformers' text logits; its top-level tie_word_embeddings decides the tying."""
    text = {k: v for k, v in FAMILIES["qwen3_5"][2].items() if k != "tie_word_embeddings"}
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5Config(text_config=dict(text, tie_word_embeddings=False), tie_word_embeddings=True,
                                     vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                                        out_hidden_size=32, patch_size=4, num_position_embeddings=16))
    hf = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    assert type(model) is mn.models.Qwen3_5ForCausalLM and model.tie_word_embeddings
    toks = tokens(VOCAB, (2, 17), seed=6)
    assert max_error(model(mx.array(toks)), hf_logits(hf, toks)) < LOGITS_TOL


def test_emulated_kernels_give_the_reference_logits_and_gradients(checkpoints, monkeypatch):
    """The whole Qwen3-Next model on the emulated Metal kernels (gated delta rule forward and
    backward, RMSNorm, RoPE, attention, conv) equals the reference path."""
    _, model, _ = checkpoints["qwen3_next"]
    assert_emulated_kernels_match(model, VOCAB, monkeypatch, {"gated_delta_forward", "gated_delta_backward"})


def test_training_steps_lower_the_loss(checkpoints):
    """A few AdamW steps through Trainer (compiled) on a fixed batch lower the loss."""
    import mlx.optimizers as optim

    _, _, folder = checkpoints["qwen3_next"]
    model = small_chunks(load_pretrained(folder))
    batch = mx.array(tokens(VOCAB, (2, 20), seed=8))
    trainer = mn.Trainer(model, optim.AdamW(3e-3), lambda m, b, d: lm_loss(m, b, d), mn.Device(kernels="reference"),
                         progress=False)
    trainer.fit(lambda step: batch, 6)
    losses = trainer.history["loss"]
    assert losses[-1] < losses[0] - 0.05, losses


def test_bad_configs_name_the_field(checkpoints):
    _, _, folder = checkpoints["qwen3_next"]
    cfg = json.loads((folder / "config.json").read_text())
    with pytest.raises(UnsupportedConfigError, match=r"layer_types\[1\] = 'sliding_attention'"):
        mn.models.from_config(dict(cfg, layer_types=["linear_attention", "sliding_attention", "linear_attention"]))
    with pytest.raises(UnsupportedConfigError, match="layer_types must list one entry per layer"):
        mn.models.from_config(dict(cfg, layer_types=["linear_attention"]))
    with pytest.raises(UnsupportedConfigError, match="rope_parameters: rope type 'dynamic'"):
        mn.models.from_config(dict(cfg, rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(UnsupportedConfigError, match="linear_num_key_heads"):
        mn.models.from_config({k: v for k, v in cfg.items() if k != "linear_num_key_heads"})


def test_incomplete_experts_are_reported(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, _, folder = checkpoints["qwen3_next"]
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_pretrained(tmp_path)


def test_chunked_backward_keeps_chunk_states_not_token_states():
    """Memory of the gated delta rule's backward holds one state per chunk, not per token: at
    T=1024 (16 chunks of 64), 2 heads, 128x128 states, a state per token is 128 MiB (the recurrent
    form's backward peaks near 600 MiB); the chunked form's whole backward (its per-token vectors
    included) stays under half of that."""
    from metalnn.functional import gated_delta_rule

    B, T, H, K = 1, 1024, 2, 128
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.normal(size=(B, T, H, K)).astype(np.float32)) for _ in range(3))
    g = mx.array(np.log(rng.uniform(0.9, 1.0, (B, T, H))).astype(np.float32))
    beta = mx.array(rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32))
    dev = mn.Device(kernels="reference")

    def loss(q, k, v):
        o, _ = gated_delta_rule(q, k, v, g, beta, mode="chunk", device=dev, use_qk_l2norm_in_kernel=True)
        return (o * o).sum()

    mx.eval(q, k, v, g, beta)
    peak = peak_above_active(lambda: mx.eval(mx.grad(loss, argnums=(0, 1, 2))(q, k, v)))
    per_token_states = T * H * K * K * 4
    assert peak < per_token_states / 2

"""Nemotron-H (`NemotronHForCausalLM`: one mixer a layer, Mamba2 / attention / squared-ReLU MLP /
sigmoid-routed experts) against transformers' ``NemotronHForCausalLM``.

Tiny random models are saved with save_pretrained (the Hub's ``backbone.*`` names, experts one by
one) and loaded with metalnn; `perturb` (here) moves what `hf_models.hf_model` leaves at its
initial value: D, the convolution biases, every projection bias, the routers' correction biases.
Two configs:

* ``moe_latent``: ``MEM*EM-`` (Mamba2, experts, attention, MLP), 2 of 6 experts per token from
  1 of 3 groups, weights x1.5, experts in a 20-wide latent space, 8 Mamba2 heads of 8 in 2 groups
  of B/C, no biases;
* ``dense_bias``: ``-M*M-M`` (an MLP layer first: its cache entry only counts positions), no
  experts, 4 Mamba2 heads of 16, projection, MLP and no convolution biases, a 3-wide convolution, one group,
  ``tie_word_embeddings`` set (which transformers' Nemotron-H ignores: the head stays its own),
  ``residual_in_fp32``.

Tolerances: `model_checks`' (logits 2e-4 absolute; loss and every gradient 1e-3 of the largest
entry); the emulated Metal kernels against the reference path 1e-4 (kernels sum in another order);
greedy tokens identical for 24 tokens, batch 1 and 3 and through `BatchGenerator` rows.
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
from metalnn.llm.models.nemotron_h import checkpoint_to_model

from hf_models import hf_greedy, hf_logits, hf_model, max_error, saved_checkpoints, tokens
from model_checks import (LOGITS_TOL, assert_batched_rows_match, assert_emulated_kernels_match, assert_greedy_matches,
                          assert_info_features, assert_logits_match, assert_loss_and_gradients_match,
                          assert_lora_trains, assert_saved_folder_loads_in_transformers)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, head_dim=8, intermediate_size=24,
            mamba_head_dim=8, chunk_size=8, initializer_range=0.2)
CONFIGS = {
    "moe_latent": dict(BASE, hybrid_override_pattern="MEM*EM-", num_key_value_heads=2, mamba_num_heads=8,
                       ssm_state_size=6, n_groups=2, n_routed_experts=6, num_experts_per_tok=2,
                       moe_intermediate_size=12, moe_shared_expert_intermediate_size=16, n_group=3, topk_group=1,
                       routed_scaling_factor=1.5, moe_latent_size=20),
    "dense_bias": dict(BASE, hybrid_override_pattern="-M*M-M", num_key_value_heads=1, mamba_num_heads=4,
                       mamba_head_dim=16, ssm_state_size=5, n_groups=1, conv_kernel=3, use_conv_bias=False,
                       use_bias=True, mlp_bias=True, tie_word_embeddings=True, residual_in_fp32=True,
                       initializer_range=0.15),  # (0.2 and above make this random model repeat one token)
}
KINDS = {"moe_latent": ["mamba", "moe", "mamba", "attention", "moe", "mamba", "mlp"],
         "dense_bias": ["mlp", "mamba", "attention", "mamba", "mlp", "mamba"]}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj", "up_proj", "down_proj",
               "fc1_latent_proj", "fc2_latent_proj")


def perturb(hf, seed=0):
    """Move D, the convolution biases, the projection biases and the correction biases off their
    initial values (ones and zeros)."""
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for module in hf.modules():
            if hasattr(module, "D") and hasattr(module, "conv1d"):
                module.D.copy_(torch.rand(module.D.shape, generator=g) * 2 - 1)
                if module.conv1d.bias is not None:
                    module.conv1d.bias.copy_(torch.rand(module.conv1d.bias.shape, generator=g) - 0.5)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:  # (+-0.1: larger biases through
                module.bias.copy_((torch.rand(module.bias.shape, generator=g) - 0.5) * 0.2)  # relu2 collapse greedy)
            if hasattr(module, "e_score_correction_bias"):
                b = module.e_score_correction_bias
                b.copy_(torch.rand(b.shape, generator=g) * 0.5)
    return hf


def small_chunks(model, size=8):
    """Scan in 8-token chunks (the config's chunk_size; set again for models read from GGUF files)."""
    for block in model.model.layers:
        if block.kind == "mamba":
            block.mixer.chunk_size = size
    return model


def build(name, **changes):
    return perturb(hf_model(transformers.NemotronHConfig, transformers.NemotronHForCausalLM,
                            **dict(CONFIGS[name], **changes)))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{config name: (transformers model, metalnn model, folder)}."""
    return saved_checkpoints(tmp_path_factory, {name: build(name) for name in CONFIGS}, prepare=small_chunks)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, checkpoints):
    hf, model, folder = checkpoints[name]
    assert type(model) is mn.models.NemotronHForCausalLM
    assert model.layer_kinds == KINDS[name]
    if name == "dense_bias":  # transformers keeps its own head despite tie_word_embeddings
        assert hf.lm_head.weight.data_ptr() != hf.model.embeddings.weight.data_ptr()
        assert "lm_head" in model
    assert_logits_match(hf, model, VOCAB, shape=(2, 20), label=name)
    assert_logits_match(hf, model, VOCAB, shape=(2, 5), label=f"{name}, 5 tokens")  # one partial chunk


def test_time_step_min_clamps_dt(tmp_path):
    """transformers clamps dt below at ``time_step_min`` in its chunked scan (``time_step_limit`` is
    not read): a large minimum changes the logits, and metalnn's with them."""
    hf = build("dense_bias", time_step_min=1.0)
    hf.save_pretrained(tmp_path)
    model = small_chunks(load_pretrained(tmp_path))
    assert model.model.layers[1].mixer.time_step_limit == (1.0, float("inf"))
    toks = tokens(VOCAB, (2, 20), seed=1)
    plain = build("dense_bias")
    assert max_error(hf_logits(plain, toks), hf_logits(hf, toks)) > 100 * LOGITS_TOL  # the clamp matters here
    assert_logits_match(hf, model, VOCAB, toks=toks)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(name, checkpoints, monkeypatch):
    """Prefill (chunked scan) then one recurrent step per token, against transformers' cache; the
    fused decoding step of Llama-like blocks never takes these blocks."""
    from metalnn.layers import transformer

    calls = []
    real = transformer.F.decoder_block_step
    monkeypatch.setattr(transformer.F, "decoder_block_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    hf, model, _ = checkpoints[name]
    assert_greedy_matches(hf, model, VOCAB, n=24, shape=(3, 11), label=name)
    assert not calls
    kinds = {"mamba": "Mamba2Cache", "attention": "KVCache", "mlp": "PositionCount", "moe": "PositionCount"}
    caches = model.make_cache()
    assert [type(c).__name__ for c in caches] == [kinds[k] for k in KINDS[name]]
    model(mx.array(tokens(VOCAB, (1, 6), seed=3)), cache=caches)
    assert {c.offset for c in caches} == {6}  # every layer's entry counts the positions


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_rows_get_their_lone_greedy_tokens(name, checkpoints):
    """`BatchGenerator` (chunked prefill, left-aligned rows at their own positions): each row's
    tokens are transformers' greedy continuation of its prompt alone; rows join while others decode."""
    hf, model, _ = checkpoints[name]
    assert_batched_rows_match(hf, model, VOCAB)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradients_match_torch(name, checkpoints):
    """Every parameter's gradient against torch autograd; the routers' correction biases steer the
    choice only, so theirs is zero (a buffer in transformers, without a gradient)."""
    hf, model, _ = checkpoints[name]
    biases = {f"model.layers.{i}.mixer.gate.e_score_correction_bias" for i, k in enumerate(KINDS[name]) if k == "moe"}
    i = KINDS[name].index("mamba")
    must = [f"model.layers.{i}.mixer.{p}" for p in ("A_log", "dt_bias", "D", "conv1d.weight", "in_proj.weight",
                                                    "norm.weight")] + ["model.embed_tokens.weight", "model.norm.weight"]
    if name == "moe_latent":
        must += [f"model.layers.1.mixer.{p}" for p in ("experts.up_proj", "experts.down_proj", "gate.weight",
                                                       "fc1_latent_proj.weight", "fc2_latent_proj.weight",
                                                       "shared_experts.up_proj.weight")]
    else:
        must += ["model.layers.1.mixer.in_proj.bias", "model.layers.0.mixer.up_proj.bias"]
    _, got, _, _ = assert_loss_and_gradients_match(hf, model, VOCAB, shape=(2, 19), must_include=must, nonzero=True,
                                                   rename=checkpoint_to_model, metalnn_only=biases, label=name)
    assert {k for k in got if k.endswith(".gate.e_score_correction_bias")} == biases


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_pretrained_loads_in_transformers(name, checkpoints, tmp_path):
    """metalnn writes the Hub's layout (``backbone.*``, experts one by one), as transformers does."""
    hf, model, folder = checkpoints[name]
    assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB, lengths=(5, 12), reload=True)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "np") as mine, \
            safe_open(str(folder / "model.safetensors"), "np") as theirs:
        assert sorted(mine.keys()) == sorted(theirs.keys())


def test_in_memory_names_load(checkpoints):
    """transformers' in-memory names (``model.*``, stacked experts) load as the Hub's do."""
    hf, _, folder = checkpoints["moe_latent"]
    model = mn.models.from_config(json.loads((folder / "config.json").read_text()))
    model.load_weights_from({k: mx.array(v.detach().numpy()) for k, v in hf.state_dict().items()})
    small_chunks(model)
    assert_logits_match(hf, model, VOCAB, shape=(1, 12))


def test_emulated_kernels_give_the_reference_logits_and_gradients(checkpoints, monkeypatch):
    """The whole model on the emulated Metal kernels (SSD scan forward and backward, RMSNorm,
    attention) equals the reference path."""
    _, model, _ = checkpoints["moe_latent"]
    assert_emulated_kernels_match(model, VOCAB, monkeypatch, {"ssd_forward", "ssd_backward"})


def test_lora_on_every_projection_trains(checkpoints):
    _, _, folder = checkpoints["moe_latent"]
    kinds = KINDS["moe_latent"]
    want = [f"model.layers.{i}.mixer.{p}" for i, k in enumerate(kinds) if k == "attention" for p in PROJECTIONS[:4]]
    want += [f"model.layers.{i}.mixer.{p}" for i, k in enumerate(kinds) if k == "mamba" for p in ("in_proj", "out_proj")]
    want += [f"model.layers.{i}.mixer.{p}" for i, k in enumerate(kinds) if k == "mlp" for p in ("up_proj", "down_proj")]
    want += [f"model.layers.{i}.mixer.{p}" for i, k in enumerate(kinds) if k == "moe"
             for p in ("shared_experts.up_proj", "shared_experts.down_proj", "fc1_latent_proj", "fc2_latent_proj")]
    assert_lora_trains(folder, VOCAB, PROJECTIONS, want)


def test_info_names_the_layers_and_experts(checkpoints):
    assert_info_features(checkpoints["moe_latent"][2], "NemotronHForCausalLM", [
        "hybrid: 3 Mamba2 (state-space), 1 attention, 1 MLP, 2 mixture-of-experts layers, one mixer a layer",
        "ungated squared-ReLU MLPs",
        "mixture of experts: 2 of 6 experts per token, sigmoid routing from 1 of 3 expert groups, weights x1.5, "
        "plus a shared expert",
        "experts in a 20-wide latent space", "no position embeddings (NoPE)"])


def test_config_forms_and_bad_configs(checkpoints):
    _, model, folder = checkpoints["dense_bias"]
    cfg = json.loads((folder / "config.json").read_text())
    # transformers 5 writes layers_block_type; the Hub's configs spell the layers as a pattern and some
    # keys by their older names
    assert cfg["layers_block_type"] == ["mlp", "linear_attention", "full_attention", "linear_attention", "mlp",
                                        "linear_attention"]
    hub = {k: v for k, v in cfg.items() if k not in ("layers_block_type", "n_groups", "conv_kernel")}
    hub.update(hybrid_override_pattern="-M*M-M", mamba_n_groups=1, mamba_d_conv=3, num_hidden_layers=6)
    again = mn.models.from_config(hub)
    assert again.layer_kinds == KINDS["dense_bias"]
    assert (again.args.n_groups, again.args.conv_kernel) == (1, 3)
    assert again.context_length == cfg["max_position_embeddings"] and model.max_positions is None
    with pytest.raises(UnsupportedConfigError, match=r"layers_block_type\[1\] = 'sliding_attention'"):
        mn.models.from_config(dict(cfg, layers_block_type=["mlp", "sliding_attention"]))
    with pytest.raises(UnsupportedConfigError, match=r"layers_block_type\[2\] = 'X'"):
        mn.models.from_config(dict(hub, hybrid_override_pattern="M-X"))
    with pytest.raises(UnsupportedConfigError, match=r"n_groups = 3"):
        mn.models.from_config(dict(cfg, n_groups=3))
    with pytest.raises(UnsupportedConfigError, match=r"mlp_hidden_act = 'swish2'"):
        mn.models.from_config(dict(cfg, mlp_hidden_act="swish2"))
    with pytest.raises(UnsupportedConfigError, match=r"n_group = 4"):
        mn.models.from_config(dict(cfg, layers_block_type=["moe"], n_routed_experts=6, n_group=4))
    with pytest.raises(UnsupportedConfigError, match=r"num_experts_per_tok = 3"):
        mn.models.from_config(dict(cfg, layers_block_type=["moe"], n_routed_experts=6, n_group=3, topk_group=1,
                                   num_experts_per_tok=3))
    with pytest.raises(NotImplementedError, match="e_score_correction_bias"):
        model.aux_loss()


# -- GGUF ------------------------------------------------------------------------------------------------
# gguf_nemotron_files writes the files the converter's way, in its two variants (the Hub's config.json, or
# transformers 5's AutoConfig: see its docstring); checked against convert_hf_to_gguf.py itself on both configs
# in both variants: the same tensor names, types, shapes and bytes, and the same non-tokenizer metadata, for
# --outtype f32 and q8_0. GGUF keeps no time_step_min (llama.cpp never clamps dt): the default 0.001 of
# transformers' models never bites on these random models, so their logits are the reference still.
GGUF_CASES = [("moe_latent", "F32", True), ("moe_latent", "Q8_0", True), ("dense_bias", "F32", True),
              ("dense_bias", "Q8_0", True), ("moe_latent", "F32", False), ("dense_bias", "Q8_0", False)]


@pytest.mark.parametrize("name,qtype,hub_config", GGUF_CASES)
def test_gguf_file_gives_transformers_logits_and_tokens(name, qtype, hub_config, tmp_path):
    import gguf_nemotron_files
    from gguf import GGMLQuantizationType as Q

    hf = build(name)
    if qtype == "Q8_0":  # transformers holds the same Q8_0 / F16 values the file does
        hf = gguf_nemotron_files.q8_0_values(hf)
    path = gguf_nemotron_files.write(tmp_path / "nemotron.gguf", hf, qtype=getattr(Q, qtype), hub_config=hub_config)
    model = small_chunks(load_pretrained(path))
    assert type(model) is mn.models.NemotronHForCausalLM
    assert model.layer_kinds == KINDS[name]
    assert model.args.time_step_min == 0.0
    if qtype == "Q8_0":
        assert "quantization" in model.config  # the 32-wide matrices stay Q8_0 (as MLX's 8-bit groups)
        mamba = model.model.layers[KINDS[name].index("mamba")].mixer
        assert type(mamba.in_proj).__name__ == "QuantizedLinear"
    toks = tokens(VOCAB, (2, 20), seed=1)
    assert_logits_match(hf, model, VOCAB, toks=toks, label=f"{name} {qtype}")
    prompt = tokens(VOCAB, (1, 9), seed=2)

    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()


def test_gguf_file_without_the_layers_it_needs_is_refused(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "nemotron_h")
    for key, value in (("block_count", 1), ("embedding_length", 32), ("attention.head_count", 4)):
        w.add_uint32(f"nemotron_h.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 32), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedConfigError, match="block 0 holds none of ssm_in, attn_q, ffn_gate_inp, ffn_up"):
        load_pretrained(tmp_path / "bad.gguf")

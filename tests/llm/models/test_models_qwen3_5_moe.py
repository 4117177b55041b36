"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`: Gated DeltaNet + gated attention hybrid with sparse experts and a
sigmoid-gated shared expert on every layer) against transformers' ``Qwen3_5MoeForCausalLM`` (and the text
model of ``Qwen3_5MoeForConditionalGeneration``).

Tiny random models (transformers' init, then `hf_models.perturb` plus `perturb_zero_centred` here: the
zero-centred RMSNorm gains of this family moved to [-0.5, 0.5), the gated-norm gains to [0.5, 1.5), dt_bias
and A_log off their initial values) are saved with save_pretrained (each expert its own tensors) and loaded
with metalnn. Two configs:

* ``grouped``: 3 layers (linear, full, linear), 2 key / 4 value heads of the Gated DeltaNet (Dk 8 != Dv 6),
  2 of 4 experts per token, a 12-wide shared expert, partial rotary 0.5, tied embeddings;
* ``interval``: 4 layers from ``full_attention_interval=2`` (linear, full, linear, full), as many key as
  value heads, 3 of 6 experts, a 16-wide shared expert, the default partial rotary 0.25 of 16, one key/value
  head, biases on the attention projections, an untied head.

The linear-attention layers run with chunk_size 8 here (`small_chunks`), so a 20-token prompt spans three
chunks of the chunked gated delta rule.

Tolerances: logits 2e-4 absolute (two float32 implementations of a few-layer model whose logits are O(1)
agree to ~1e-6: room for summation order only); loss and gradients 1e-3 relative to the largest entry of
each gradient (float32 backward through the chunked rule and the experts); the auxiliary loss 1e-5
relative (the same float32 sums); greedy tokens identical for 22 tokens, batch 1 and 3 and through
`BatchGenerator` rows; the emulated Metal kernels against the reference path 1e-4 (kernels sum in another
order).

GGUF: llama.cpp's ``qwen35moe`` files (``convert_hf_to_gguf.py``'s ``Qwen3_5MoeTextModel``: Qwen3.5's value-head
reorder and Qwen3-Next's transforms and stacked experts) written by tests/support/gguf_hybrid_files.py. Checked
once against ``convert_hf_to_gguf.py`` itself (its vocabulary step stubbed, ``--no-mtp``) on a 64-wide model
with 2 key / 4 value heads: the same tensors, bit for bit, for ``--outtype f32`` and ``q8_0`` (the real files
also carry ``rope.dimension_sections``, which metalnn does not read). The Q8_0 file is compared with
transformers holding the same Q8_0 values (each quantized matrix replaced by its quantize-dequantize round
trip, a fixed point, so both sides hold identical weights and 2e-4 holds again).
"""

import json
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from mlx.utils import tree_flatten
from safetensors import safe_open

import metalnn as mn
from metalnn.errors import UnsupportedConfigError, WeightLoadError
from metalnn.layers.moe import SparseMoE
from metalnn.llm.models import load_pretrained

from gguf_hybrid_files import quantizable, write
from gguf_writing import q8_0_values
from hf_models import hf_greedy, hf_logits, hf_model, lm_loss, max_error, saved_checkpoints, small_chunks, tokens
from model_checks import (LOGITS_TOL, assert_aux_loss_matches, assert_batched_rows_match, assert_greedy_matches,
                          assert_info_features, assert_logits_match, assert_lora_trains,
                          assert_loss_and_gradients_match, assert_saved_folder_loads_in_transformers)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, head_dim=16, linear_conv_kernel_dim=4,
            initializer_range=0.2, max_position_embeddings=128, moe_intermediate_size=8)
CONFIGS = {
    "grouped": dict(BASE, num_hidden_layers=3, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=6, num_experts=4, num_experts_per_tok=2,
                    shared_expert_intermediate_size=12, tie_word_embeddings=True,
                    layer_types=["linear_attention", "full_attention", "linear_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "interval": dict(BASE, num_hidden_layers=4, num_key_value_heads=1, linear_num_key_heads=2,
                     linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=6,
                     num_experts_per_tok=3, shared_expert_intermediate_size=16, tie_word_embeddings=False,
                     attention_bias=True, full_attention_interval=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
}
KINDS = {"grouped": ["linear_attention", "full_attention", "linear_attention"],
         "interval": ["linear_attention", "full_attention"] * 2}
#: the projections LoRA can adapt (attention, Gated DeltaNet, the shared expert; routed experts are stacked)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
               "out_proj", "gate_proj", "up_proj", "down_proj")


def perturb_zero_centred(hf, seed=0):
    """`hf_models.perturb` takes Qwen3.5-MoE's RMSNorm for a plain one (gains 0.5..1.5, so 1.5..2.5 in effect):
    move its zero-centred gains (``1 + weight``) to 0.5..1.5 in effect, as the other zero-centred families get."""
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for module in hf.modules():
            if type(module).__name__ == "Qwen3_5MoeRMSNorm":
                module.weight.copy_(torch.rand(module.weight.shape, generator=g) - 0.5)
    return hf


def qwen3_5_moe(**config):
    hf = hf_model(transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, **config)
    return perturb_zero_centred(hf)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{config name: (transformers model, metalnn model, folder)}."""
    return saved_checkpoints(tmp_path_factory, {name: qwen3_5_moe(**kw) for name, kw in CONFIGS.items()},
                             prepare=small_chunks)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, checkpoints):
    hf, model, folder = checkpoints[name]
    assert type(model) is mn.models.Qwen3_5MoeForCausalLM
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    with safe_open(folder / "model.safetensors", "np") as f:
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in f.keys()  # transformers saves experts one by one
    assert hf.config.layer_types == KINDS[name] and model.layer_kinds == KINDS[name]
    assert_logits_match(hf, model, VOCAB, (2, 20), label=name)
    short = tokens(VOCAB, (2, 20), seed=1)[:, :5]  # below 16 tokens the recurrent form runs
    assert_logits_match(hf, model, VOCAB, toks=short, label=f"{name}, 5 tokens")


def test_layers_carry_the_configs_plan(checkpoints):
    """Every layer sparse with a shared expert, renormalised top-k; mixers and caches as layer_types say."""
    for name, cfg in CONFIGS.items():
        _, model, _ = checkpoints[name]
        blocks = model.model.layers
        assert [("linear_attn" in b, "self_attn" in b) for b in blocks] == [
            (k == "linear_attention", k == "full_attention") for k in KINDS[name]]
        moe = model.moe_layers()
        assert len(moe) == len(blocks) and all(isinstance(b.mlp, SparseMoE) for b in blocks)
        assert all(m.top_k == cfg["num_experts_per_tok"] and m.num_experts == cfg["num_experts"] and m.norm_topk_prob
                   and "shared_expert" in m for m in moe)
        attn = [b.self_attn for b in blocks if "self_attn" in b]
        partial = cfg["rope_parameters"].get("partial_rotary_factor", 0.25)
        assert all(a.output_gate and a.qk_norm and a.rope_dims == int(16 * partial) for a in attn)
        assert [type(c).__name__ for c in model.make_cache()] == [
            "GatedDeltaCache" if k == "linear_attention" else "KVCache" for k in KINDS[name]]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(name, checkpoints):
    """Prefill (chunked rule over three chunks) then one recurrent step per token, against transformers'
    cache; the fused CPU decoding step declines every block (gated attention, linear attention, experts),
    so the layers run one by one."""
    hf, model, _ = checkpoints[name]
    assert all(b._step_plan() is None for b in model.model.layers)
    assert_greedy_matches(hf, model, VOCAB, n=22, shape=(3, 18), label=name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_rows_get_their_lone_greedy_tokens(name, checkpoints):
    """`BatchGenerator` (chunked prefill, left-aligned rows at their own positions): each row's
    tokens are transformers' greedy continuation of its prompt alone; rows join while others decode."""
    hf, model, _ = checkpoints[name]
    assert_batched_rows_match(hf, model, VOCAB)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradients_match_torch(name, checkpoints):
    hf, model, _ = checkpoints[name]
    must = ["model.embed_tokens.weight", "model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias",
            "model.layers.0.linear_attn.conv1d.weight", "model.layers.0.linear_attn.in_proj_qkv.weight",
            "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_norm.weight",
            "model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
            "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.shared_expert.up_proj.weight",
            "model.layers.2.mlp.shared_expert_gate.weight"]
    assert_loss_and_gradients_match(hf, model, VOCAB, (2, 19), must_include=must, nonzero=True, label=name)


def test_aux_loss_matches_transformers(checkpoints):
    """The load-balancing loss, added with router_aux_loss_coef, and the gradients of the total."""
    hf, model, _ = checkpoints["interval"]
    assert_aux_loss_matches(hf, model, VOCAB, ["model.layers.0.mlp.gate.weight", "model.layers.3.mlp.gate.weight"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_pretrained_loads_in_transformers(name, checkpoints, tmp_path):
    hf, model, _ = checkpoints[name]
    back = assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB, architecture="Qwen3_5MoeForCausalLM",
                                                     model_type="qwen3_5_moe_text", seed=5, reload=True)
    assert back.config.num_experts == hf.config.num_experts and back.config.layer_types == hf.config.layer_types


def test_stacked_expert_tensors_load(checkpoints, tmp_path):
    """A checkpoint holding the experts stacked as transformers 5 keeps them in memory
    (``mlp.experts.gate_up_proj`` / ``down_proj``) loads as the per-expert one does."""
    from safetensors.torch import save_file

    hf, _, folder = checkpoints["grouped"]
    weights = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert "model.layers.0.mlp.experts.gate_up_proj" in weights
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    toks = tokens(VOCAB, (2, 11), seed=6)
    assert max_error(load_pretrained(tmp_path)(mx.array(toks)), hf_logits(hf, toks)) < LOGITS_TOL


def test_text_model_of_a_multimodal_folder(tmp_path):
    """A Qwen3_5MoeForConditionalGeneration folder (``model.language_model.*``, a vision tower): the text
    model loads (vision tower dropped) and gives transformers' text logits; its top-level tie_word_embeddings
    decides the tying."""
    text = {k: v for k, v in CONFIGS["grouped"].items() if k != "tie_word_embeddings"}
    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=4,
                  num_position_embeddings=16)
    cfg = transformers.Qwen3_5MoeConfig(text_config=dict(text, tie_word_embeddings=True), tie_word_embeddings=False,
                                        vision_config=vision)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    perturb_zero_centred(hf)
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    model = small_chunks(load_pretrained(tmp_path))
    assert type(model) is mn.models.Qwen3_5MoeForCausalLM and not model.tie_word_embeddings
    toks = tokens(VOCAB, (2, 17), seed=6)
    assert max_error(model(mx.array(toks)), hf_logits(hf, toks)) < LOGITS_TOL


def test_emulated_kernels_give_the_reference_logits_and_gradients(checkpoints, monkeypatch):
    """The whole model on the emulated Metal kernels (gated delta rule forward and backward, RMSNorm,
    RoPE, attention) equals the reference path."""
    from kernel_cases import spy_launches

    _, model, _ = checkpoints["grouped"]
    toks = mx.array(tokens(VOCAB, (1, 7), seed=7))
    ref_dev, emu_dev = mn.Device(kernels="reference"), mn.Device(kernels="emulate")
    launches = spy_launches(monkeypatch)
    np.testing.assert_allclose(np.array(model(toks, device=emu_dev)), np.array(model(toks, device=ref_dev)),
                               atol=1e-4)
    g_ref = dict(tree_flatten(nn.value_and_grad(model, lambda t: lm_loss(model, t, ref_dev))(toks)[1]))
    g_emu = dict(tree_flatten(nn.value_and_grad(model, lambda t: lm_loss(model, t, emu_dev))(toks)[1]))
    ran = launches.names()
    assert {"gated_delta_forward", "gated_delta_backward", "rms_norm_forward"} <= ran, ran
    assert g_ref.keys() == g_emu.keys()
    for k in g_ref:
        np.testing.assert_allclose(np.array(g_emu[k]), np.array(g_ref[k]), atol=1e-4, err_msg=k)


def test_lora_on_the_familys_projections_trains(checkpoints):
    _, _, folder = checkpoints["grouped"]
    linear = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    want = [f"model.layers.{i}.linear_attn.{p}" for i in (0, 2) for p in linear]
    want += [f"model.layers.1.self_attn.{p}" for p in PROJECTIONS[:4]]
    want += [f"model.layers.{i}.mlp.shared_expert.{p}" for i in range(3) for p in PROJECTIONS[-3:]]
    assert_lora_trains(folder, VOCAB, PROJECTIONS, want, prepare=small_chunks)
    model = small_chunks(load_pretrained(folder))
    toks = mx.array(tokens(VOCAB, (4, 17), seed=7))
    before = np.array(model(toks))
    mn.lora.apply(model, rank=4, alpha=8.0, targets=PROJECTIONS)
    np.testing.assert_allclose(np.array(model(toks)), before, atol=1e-6)  # B starts at zero


def test_info_names_the_features(checkpoints):
    _, _, folder = checkpoints["grouped"]
    want = ["Gated DeltaNet linear attention on layers 0, 2",
            "gated full attention on layers 1 (q/k RMSNorm, partial rotary 8 of 16 features)",
            "zero-centred RMSNorm", "mixture of experts: 2 of 4 experts per token (renormalised)",
            "sigmoid-gated shared expert (12 wide)"]
    assert_info_features(folder, "Qwen3_5MoeForCausalLM", want)


def test_bad_configs_name_the_field(checkpoints):
    _, _, folder = checkpoints["grouped"]
    cfg = json.loads((folder / "config.json").read_text())
    with pytest.raises(UnsupportedConfigError, match=r"num_experts_per_tok = 5 .*1 to num_experts \(4\)"):
        mn.models.from_config(dict(cfg, num_experts_per_tok=5))
    with pytest.raises(UnsupportedConfigError, match=r"^Qwen3_5MoeForCausalLM: num_experts = 0"):
        mn.models.from_config(dict(cfg, num_experts=0))
    with pytest.raises(UnsupportedConfigError, match=r"shared_expert_intermediate_size = 0"):
        mn.models.from_config(dict(cfg, shared_expert_intermediate_size=0))
    with pytest.raises(UnsupportedConfigError, match=r"layer_types\[1\] = 'sliding_attention'"):
        mn.models.from_config(dict(cfg, layer_types=["linear_attention", "sliding_attention", "linear_attention"]))
    with pytest.raises(UnsupportedConfigError, match="linear_num_value_heads = 3"):
        mn.models.from_config(dict(cfg, linear_num_value_heads=3))
    # absent keys take transformers' Qwen3_5MoeTextConfig defaults
    args = mn.models.qwen3_5_moe.ModelArgs.from_dict(dict(vocab_size=8, hidden_size=8, num_hidden_layers=4,
                                                          num_attention_heads=2))
    want = transformers.Qwen3_5MoeTextConfig(vocab_size=8, hidden_size=8, num_hidden_layers=4, num_attention_heads=2)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "layer_types"):
        assert getattr(args, key if key != "layer_types" else "kinds") == getattr(want, key), key
    assert args.rope["rope_dims"] == int(256 * 0.25)


def test_incomplete_experts_are_reported(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, _, folder = checkpoints["grouped"]
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_pretrained(tmp_path)


# -- GGUF ------------------------------------------------------------------------------------------------

# widths multiples of 32 (Q8_0 rows; the value heads 32 wide, so out_proj's column regrouping keeps its blocks)
GGUF_CONFIG = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                   linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32, initializer_range=0.2, max_position_embeddings=128,
                   layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
def test_gguf_file_gives_transformers_logits_and_tokens(qtype, tmp_path):
    hf = qwen3_5_moe(**GGUF_CONFIG)
    if qtype == Q.Q8_0:  # every tensor the Q8_0 file quantizes holds its Q8_0 round trip
        assert q8_0_values(hf, quantizable) > 10
    path = write(tmp_path / "qwen35moe.gguf", hf, "qwen35moe", qtype=qtype)
    model = small_chunks(load_pretrained(path))
    assert type(model) is mn.models.Qwen3_5MoeForCausalLM
    assert model.layer_kinds == GGUF_CONFIG["layer_types"] and len(model.moe_layers()) == 2
    assert model.moe_layers()[0].top_k == 2 and "shared_expert" in model.moe_layers()[0]
    if qtype == Q.Q8_0:  # matrices stay 8-bit; the router (F32 in the file) and the stacked experts come out float
        kinds = {p: type(m).__name__ for p, m in model.named_modules()}
        packed = ["model.embed_tokens", "lm_head", "model.layers.1.self_attn.q_proj",
                  "model.layers.0.linear_attn.out_proj", "model.layers.0.linear_attn.in_proj_qkv",
                  "model.layers.1.mlp.shared_expert.down_proj"]
        assert all(kinds[n].startswith("Quantized") for n in packed), {n: kinds[n] for n in packed}
        assert kinds["model.layers.0.mlp.gate"] == "Linear" and kinds["model.layers.0.mlp.experts"] == "SwitchGLU"
    assert_logits_match(hf, model, VOCAB, (2, 20))
    prompt = tokens(VOCAB, (1, 6), seed=2)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()


def test_gguf_file_missing_a_router_is_reported(tmp_path):
    hf = qwen3_5_moe(**GGUF_CONFIG)
    path = write(tmp_path / "broken.gguf", hf, "qwen35moe", drop=("blk.1.ffn_gate_inp.weight",))
    with pytest.raises(WeightLoadError, match=r"blk\.1\.ffn_gate_inp"):
        load_pretrained(path)

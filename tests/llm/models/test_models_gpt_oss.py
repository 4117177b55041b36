"""gpt-oss (`GptOssForCausalLM`: sink attention, alternating sliding / full layers, clamped-SwiGLU experts
with biases, a biased router, YaRN) against transformers' ``GptOssForCausalLM``.

Tiny random models are saved with save_pretrained and loaded with metalnn. Besides `hf_models.perturb`
(gains), `perturb_biases` moves the biases transformers initialises to zero (q/k/v/o, the experts'
``gate_up_proj_bias`` / ``down_proj_bias``) off zero; sinks and the router bias start random. Two configs:

* ``yarn``: 3 layers (sliding, full, sliding: transformers' default plan), a 4-token window, YaRN
  (factor 4 over 16 original positions, ``truncate`` false, so prompts of 13+ positions reach the
  blended frequencies), 2 of 4 experts, a small ``swiglu_limit`` (1.5) so the clamps bite, 2 key/value heads;
* ``plain``: 4 layers with an explicit ``layer_types`` (full, sliding, sliding, full), default rope
  (theta 500), 3 of 5 experts, another ``swiglu_alpha``, one key/value head, tied embeddings.

Tolerances: logits 2e-4 absolute (two float32 implementations of a few-layer model whose logits are
O(1) agree to ~1e-5: room for summation order only); loss and gradients 1e-3 relative to the largest
entry of each gradient (float32 backward); greedy tokens identical for 24 tokens, batch 1 and 3 and
through `BatchGenerator` rows, with prompts longer than the window. YaRN's frequencies against
transformers' ``_compute_yarn_parameters``: 1e-6 relative (both float32: rounding of the same
formula), the attention factor 1e-12 (the same float64 formula).

MXFP4 folders (the released checkpoints' experts): random codes and exponents are packed as
transformers' ``*_blocks`` / ``*_scales`` tensors; the reference is transformers' own
``convert_moe_packed_tensors`` written into the transformers model.

GGUF: llama.cpp's ``gpt-oss`` files (``convert_hf_to_gguf.py``'s ``GptOssModel``), written by
`gguf_gpt_oss_files.write`: float32, Q8_0 (compared with transformers holding the Q8_0 round trip of the same
matrices, a fixed point) and MXFP4 experts (the released checkpoints' form). GGUF keeps no ``swiglu_limit``
(llama.cpp fixes 7.0), so those files use the default clamp.
"""

import json
import os

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

import metalnn as mn
from metalnn.errors import UnsupportedConfigError
from metalnn.layers.moe import ClampedSwitchGLU, SparseMoE
from metalnn.llm.models import load_pretrained
from metalnn.llm.models.rope import rope_options, yarn_rope_parameters

import gguf_gpt_oss_files
from hf_models import hf_greedy, hf_logits, hf_model, max_error, saved_checkpoints, tokens
from model_checks import (LOGITS_TOL, assert_batched_rows_match, assert_greedy_matches, assert_info_features,
                          assert_logits_match, assert_loss_and_gradients_match, assert_lora_trains,
                          assert_saved_folder_loads_in_transformers)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_attention_heads=4, head_dim=8,
            initializer_range=0.2, max_position_embeddings=256)
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 1000.0}
CONFIGS = {
    "yarn": dict(BASE, num_hidden_layers=3, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                 sliding_window=4, swiglu_limit=1.5, rope_parameters=YARN, tie_word_embeddings=False),
    "plain": dict(BASE, num_hidden_layers=4, num_key_value_heads=1, num_local_experts=5, num_experts_per_tok=3,
                  sliding_window=3, swiglu_alpha=1.2,
                  layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=True),
}
WINDOWS = {"yarn": [4, None, 4], "plain": [None, 3, 3, None]}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def perturb_biases(model, seed=0):
    """Move the biases transformers starts at zero (attention projections, experts) to U(-0.5, 0.5)."""
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_proj.bias", "gate_up_proj_bias", "down_proj_bias")):
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)
    return model


def gpt_oss(seed=0, **config):
    return perturb_biases(hf_model(transformers.GptOssConfig, transformers.GptOssForCausalLM, seed=seed, **config),
                          seed)


def metalnn_name(name):
    """metalnn's name of a transformers parameter (the router is the `SparseMoE`'s ``gate``)."""
    return name.replace(".mlp.router.", ".mlp.gate.")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{config name: (transformers model, metalnn model, folder)}."""
    return saved_checkpoints(tmp_path_factory, {name: gpt_oss(**kw) for name, kw in CONFIGS.items()})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert type(model) is mn.models.GptOssForCausalLM
    assert_logits_match(hf, model, VOCAB, shape=(2, 19), label=name)


def test_layers_carry_the_configs_plan(checkpoints):
    """Windows where layer_types puts them, sinks on every layer, experts with the config's clamp; the
    fused decoding step declines every block (sinks and experts are no part of it)."""
    for name, cfg in CONFIGS.items():
        _, model, _ = checkpoints[name]
        blocks = model.model.layers
        assert [b.self_attn.sliding_window for b in blocks] == WINDOWS[name]
        assert all(b.self_attn.use_sinks and b.self_attn.sinks.shape == (4,) for b in blocks)
        assert all(isinstance(b.mlp, SparseMoE) and isinstance(b.mlp.experts, ClampedSwitchGLU) for b in blocks)
        moe = model.moe_layers()
        assert all(m.top_k == cfg["num_experts_per_tok"] and m.norm_topk_prob for m in moe)
        assert all(m.experts.limit == cfg.get("swiglu_limit", 7.0) and m.experts.alpha == cfg.get("swiglu_alpha", 1.702)
                   for m in moe)
        assert all(b._step_plan() is None for b in blocks)
    # YaRN's attention factor (0.1 ln 4 + 1) squared on the score scale; none without YaRN
    yarn = checkpoints["yarn"][1].model.layers[0].self_attn
    assert yarn.scale == pytest.approx(8 ** -0.5 * (0.1 * np.log(4) + 1) ** 2, rel=1e-12)
    assert checkpoints["plain"][1].model.layers[0].self_attn.scale is None


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(name, checkpoints):
    """Through the caches, prompts longer than the window, batch 1 and 3."""
    hf, model, _ = checkpoints[name]
    assert_greedy_matches(hf, model, VOCAB, n=24, shape=(3, 7), label=name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_rows_get_their_lone_greedy_tokens(name, checkpoints):
    """`BatchGenerator` (chunked prefill, left-aligned rows at their own positions): each row's
    tokens are transformers' greedy continuation of its prompt alone; rows join while others decode."""
    hf, model, _ = checkpoints[name]
    assert_batched_rows_match(hf, model, VOCAB)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradients_match_torch(name, checkpoints):
    hf, model, _ = checkpoints[name]
    must = ["model.layers.0.self_attn.sinks", "model.layers.0.mlp.gate.bias", "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.experts.down_proj_bias"]
    assert_loss_and_gradients_match(hf, model, VOCAB, shape=(2, 11), must_include=must, nonzero=True,
                                    rename=metalnn_name, label=name)


def test_aux_loss_matches_transformers(checkpoints):
    """The load-balancing loss over the router's logits (its bias included)."""
    hf, model, _ = checkpoints["yarn"]
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
    back = assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB, architecture="GptOssForCausalLM",
                                                     model_type="gpt_oss", lengths=(15,), seed=4, reload=True)
    assert back.config.layer_types == hf.config.layer_types
    assert back.config.rope_parameters == hf.config.rope_parameters
    toks = tokens(VOCAB, (1, 15), seed=4)
    assert max_error(hf_logits(back, toks), hf_logits(hf, toks)) < 1e-6  # the same weights, bit for bit in float32


def test_lora_on_the_attention_projections_trains(checkpoints):
    """PEFT's targets for gpt-oss: the attention projections (the router and experts are no linear layers)."""
    _, _, folder = checkpoints["yarn"]
    assert_lora_trains(folder, VOCAB, ATTENTION, [f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ATTENTION])


def test_info_names_the_features(checkpoints):
    assert_info_features(checkpoints["yarn"][2], "GptOssForCausalLM", [
        "attention sinks", "q/k/v/o biases", "mixture of experts: 2 of 4 experts per token (renormalised)",
        "clamped SwiGLU experts with biases (alpha 1.702, limit 1.5)", "sliding window 4 on layers 0, 2",
        "YaRN rope (attention factor 1.139)"])


def test_bad_configs_name_the_field():
    cfg = dict(CONFIGS["yarn"], architectures=["GptOssForCausalLM"])
    with pytest.raises(UnsupportedConfigError, match=r"num_experts_per_tok = 5.*1 to num_local_experts \(4\)"):
        mn.models.from_config(dict(cfg, num_experts_per_tok=5))
    with pytest.raises(UnsupportedConfigError, match=r"layer_types\[1\] = 'linear_attention'"):
        mn.models.from_config(dict(cfg, layer_types=["full_attention", "linear_attention", "full_attention"]))
    with pytest.raises(UnsupportedConfigError, match=r"swiglu_limit = 0"):
        mn.models.from_config(dict(cfg, swiglu_limit=0))
    with pytest.raises(UnsupportedConfigError, match=r"rope type 'dynamic'"):
        mn.models.from_config(dict(cfg, rope_parameters={"rope_type": "dynamic", "factor": 2.0}))
    # transformers' defaults: no rope parameters means its YaRN (factor 32 over 4096 positions)
    bare = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    model = mn.models.from_config(bare)
    assert model.args.rope["rope_attention_factor"] == pytest.approx(0.1 * np.log(32) + 1)


# -- YaRN -------------------------------------------------------------------------------------------------


YARN_CASES = [
    dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096),                                        # gpt-oss's
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768),          # Qwen3's (truncated)
    dict(rope_type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=0.707, beta_fast=32, beta_slow=1,
         original_max_position_embeddings=4096),                                        # DeepSeek's mscale pair
    dict(rope_type="yarn", factor=8.0, attention_factor=0.9, beta_fast=16.0, beta_slow=2.0,
         original_max_position_embeddings=2048, partial_rotary_factor=0.5),
    dict(rope_type="yarn", factor=None, original_max_position_embeddings=1024),         # factor from the lengths
]


@pytest.mark.parametrize("case", range(len(YARN_CASES)))
def test_yarn_matches_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(YARN_CASES[case], rope_theta=150000.0)
    cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=8, head_dim=64, max_position_embeddings=16384,
                                   rope_parameters=dict(params))
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    dims = int(64 * params.get("partial_rotary_factor", 1.0))
    inv, factor = yarn_rope_parameters(dims, 150000.0, params, 16384)
    np.testing.assert_allclose(inv, want_inv.numpy(), rtol=1e-6)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    opts = rope_options(64, rope_theta=1.0, rope_scaling=None, rope_parameters=params, partial_rotary_factor=1.0,
                        max_position_embeddings=16384)
    np.testing.assert_allclose(1 / opts["rope_freqs"], want_inv.numpy(), rtol=1e-6)
    assert opts["rope_dims"] == dims and opts["rope_attention_factor"] == factor


# -- MXFP4 folders ----------------------------------------------------------------------------------------


def mxfp4_folder(hf, folder, seed=5):
    """Write ``hf`` as a released gpt-oss folder: experts as random MXFP4 ``*_blocks`` / ``*_scales`` (codes
    uniform, exponents 2^-5 .. 2^-2), ``quantization_config`` mxfp4; ``hf``'s experts become transformers'
    own dequantization of them (``convert_moe_packed_tensors``). Returns ``hf``."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(seed)
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                continue
            e, n_in, n_out = p.shape
            blocks = torch.from_numpy(rng.integers(0, 256, (e, n_out, n_in // 32, 16), dtype=np.uint8))
            scales = torch.from_numpy(rng.integers(122, 126, (e, n_out, n_in // 32), dtype=np.uint8))
            p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            del state[name]
            state[name + "_blocks"], state[name + "_scales"] = blocks, scales
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(hf.config.to_dict(), architectures=["GptOssForCausalLM"])
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                        "model.layers.*.mlp.router",
                                                                                        "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    return hf


# widths multiples of 32 (MXFP4 groups along the input of both expert matrices)
MXFP4_CONFIG = dict(CONFIGS["yarn"], intermediate_size=32)
# GGUF files hold no swiglu_alpha / swiglu_limit (llama.cpp fixes transformers' defaults): the defaults here
GGUF_CONFIG = dict(MXFP4_CONFIG, swiglu_limit=7.0)


def test_mxfp4_folder_gives_transformers_logits(tmp_path):
    hf = mxfp4_folder(gpt_oss(**MXFP4_CONFIG), tmp_path)
    model = load_pretrained(tmp_path)
    toks = tokens(VOCAB, (2, 15), seed=1)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < LOGITS_TOL, f"logits differ by {err:.3g}"
    # the decoded experts are transformers' exactly (MXFP4 values are exact in float32)
    want = hf.model.layers[1].mlp.experts.down_proj.detach().numpy()
    np.testing.assert_array_equal(np.array(model.model.layers[1].mlp.experts.down_proj), want)
    prompt = tokens(VOCAB, (1, 6), seed=2)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()
    # and save_pretrained writes float experts transformers loads
    out = model.save_pretrained(tmp_path / "float")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert max_error(hf_logits(back, toks), hf_logits(hf, toks)) < LOGITS_TOL


def test_mxfp4_folder_missing_scales_is_named(tmp_path):
    from safetensors.torch import load_file

    mxfp4_folder(gpt_oss(**MXFP4_CONFIG), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(mn.errors.WeightLoadError, match=r"model\.layers\.2\.mlp\.experts\.down_proj_scales"):
        load_pretrained(tmp_path)


# -- GGUF -------------------------------------------------------------------------------------------------
# llama.cpp's ``gpt-oss`` files, written by `gguf_gpt_oss_files.write` the converter's way (checked against
# ``convert_hf_to_gguf.py`` itself on GGUF_CONFIG models, float and MXFP4 folders: the same metadata and
# byte-identical tensors for ``--outtype f32`` and ``q8_0``).


def q8_0_values(hf):
    """``hf`` with every matrix the Q8_0 file quantizes (all but the router and the biases) replaced by its
    Q8_0 round trip along the file's rows (the experts transposed, as the converter stores them): a fixed
    point, so both sides hold identical weights and 2e-4 holds again."""
    def round_trip(a):
        back = gguf.quants.dequantize(gguf.quants.quantize(a, Q.Q8_0), Q.Q8_0)
        assert np.array_equal(back, gguf.quants.dequantize(gguf.quants.quantize(back, Q.Q8_0), Q.Q8_0))
        return back

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.ndim < 2 or ".mlp.router." in name or name.endswith("_bias"):
                continue
            a = p.numpy().astype(np.float32)
            if ".mlp.experts." in name:
                back = np.swapaxes(round_trip(np.ascontiguousarray(np.swapaxes(a, -1, -2))), -1, -2)
            else:
                back = round_trip(a)
            p.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    return hf


def checkpoint_tensors(hf):
    return {k: v.detach().numpy() for k, v in hf.state_dict().items()}


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
def test_gguf_file_gives_transformers_logits_and_tokens(qtype, tmp_path):
    hf = gpt_oss(**GGUF_CONFIG)
    if qtype == Q.Q8_0:
        hf = q8_0_values(hf)
    model = load_pretrained(gguf_gpt_oss_files.write(tmp_path / "gpt-oss.gguf", hf.config, checkpoint_tensors(hf),
                                                     qtype))
    assert type(model) is mn.models.GptOssForCausalLM
    assert [b.self_attn.sliding_window for b in model.model.layers] == [4, None, 4]
    assert model.args.rope_parameters["truncate"] is False
    if qtype == Q.Q8_0:
        q = model.config["quantization"]
        assert q["model.layers.0.self_attn.q_proj"] == {"ggml_type": "Q8_0"}
        assert "model.layers.0.mlp.router" not in q
    toks = tokens(VOCAB, (2, 19), seed=1)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < LOGITS_TOL, f"logits differ by {err:.3g}"
    prompt = tokens(VOCAB, (1, 6), seed=2)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()


def test_gguf_file_with_mxfp4_experts(tmp_path):
    """The released checkpoints' GGUF form: experts as GGML MXFP4 blocks (repacked from the folder's)."""
    from safetensors.numpy import load_file

    (tmp_path / "folder").mkdir()
    hf = mxfp4_folder(gpt_oss(**GGUF_CONFIG), tmp_path / "folder")
    tensors = load_file(str(tmp_path / "folder" / "model.safetensors"))
    path = gguf_gpt_oss_files.write(tmp_path / "gpt-oss-mxfp4.gguf", hf.config, tensors)
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert kinds["blk.0.ffn_gate_exps.weight"] == kinds["blk.2.ffn_down_exps.weight"] == Q.MXFP4
    model = load_pretrained(path)
    toks = tokens(VOCAB, (2, 15), seed=1)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < LOGITS_TOL, f"logits differ by {err:.3g}"
    np.testing.assert_array_equal(np.array(model.model.layers[0].mlp.experts.gate_up_proj),
                                  hf.model.layers[0].mlp.experts.gate_up_proj.detach().numpy())

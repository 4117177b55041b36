"""DeepSeek-V3 (`DeepseekV3ForCausalLM`: multi-head latent attention, sigmoid-routed group-limited experts
with shared experts) against transformers' ``DeepseekV3ForCausalLM``.

Tiny random models (gains moved off 1 by `hf_models.perturb`, router correction biases off 0 by `perturb_bias`)
are saved with save_pretrained (each expert its own tensors) and loaded with metalnn. Two configs:

* ``lora``: a query bottleneck (``q_lora_rank``), interleaved rope pairs, 8 experts in 4 groups of which 2 are
  searched, 3 experts per token renormalised and scaled by 2.5, one shared expert, layer 0 dense, v_head_dim
  smaller than the query/key heads, an untied head;
* ``plain``: one ``q_proj``, half-split rope, 6 experts in one group, 2 per token not renormalised (scaled by
  1.5), two shared experts, no dense layer, v_head_dim larger than the query/key heads, attention biases, tied
  embeddings.

Decoding runs the absorbed form of `LatentAttention` (queries taken into the latent space, the cache holding
only the latent and the rotary key); the uncached forward pass (logits, gradients) expands the latents as
transformers does; LoRA on ``kv_b_proj`` makes decoding expand them too. Both meet transformers.

Tolerances: logits 2e-4 absolute (two float32 implementations of a three-layer model whose logits are O(1)
agree to ~1e-5: room for summation order only); loss and gradients 1e-3 relative to the largest entry of each
gradient (float32 backward); greedy tokens identical for 24 tokens, batch 1 and 3 and through `BatchGenerator`
rows.

GGUF: llama.cpp's ``deepseek2`` files (``DeepseekV2Model``: ``kv_b_proj`` split into ``attn_k_b`` (transposed) /
``attn_v_b``, experts stacked, the correction bias as ``exp_probs_b``). `gguf_deepseek_files.write_gguf` writes
them with gguf-py; checked once against ``convert_hf_to_gguf.py`` itself on the ``GGUF_CONFIG`` model (f32 and
q8_0: the same tensor names, types, shapes and bytes, the same ``deepseek2.*`` metadata), whose files loaded
in metalnn gave transformers' logits within 1e-5. The Q8_0 file is compared with transformers holding the
same Q8_0 values (each quantized matrix replaced by its quantize-dequantize round trip in the layout the file
stores, a fixed point), so 2e-4 holds again.
"""

import os

import gguf
import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

import metalnn as mn
from metalnn.errors import UnsupportedConfigError
from metalnn.layers.attention import KVCache
from metalnn.layers.latent_attention import LatentAttention
from metalnn.layers.mlp import SwiGLU
from metalnn.layers.sigmoid_moe import GroupLimitedMoE
from metalnn.llm.models import load_pretrained

from gguf_deepseek_files import write_gguf
from gguf_writing import finish, q8_0_round_trip, q8_0_values
from hf_models import hf_greedy, hf_logits, hf_model, max_error, save_and_load, saved_checkpoints, tokens
from model_checks import (LOGITS_TOL, assert_batched_rows_match, assert_greedy_matches, assert_info_features,
                          assert_logits_match, assert_lora_trains, assert_loss_and_gradients_match,
                          assert_saved_folder_loads_in_transformers)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4,
            initializer_range=0.2, max_position_embeddings=256, moe_intermediate_size=8, num_hidden_layers=3)
CONFIGS = {
    "lora": dict(BASE, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                 n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                 first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True,
                 tie_word_embeddings=False),
    "plain": dict(BASE, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=20,
                  n_routed_experts=6, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=2,
                  first_k_dense_replace=0, norm_topk_prob=False, routed_scaling_factor=1.5, rope_interleave=False,
                  attention_bias=True, tie_word_embeddings=True),
}
SPARSE = {"lora": [1, 2], "plain": [0, 1, 2]}
ATTENTION = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def perturb_bias(model, seed=0):
    """Move every router's ``e_score_correction_bias`` off zero (0 to 0.5: enough to change some choices)."""
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                b = module.e_score_correction_bias
                b.copy_(torch.rand(b.shape, generator=g) * 0.5)
    return model


def deepseek(**config):
    return perturb_bias(hf_model(transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, **config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{config name: (transformers model, metalnn model, folder)}."""
    return saved_checkpoints(tmp_path_factory, {name: deepseek(**kw) for name, kw in CONFIGS.items()})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert type(model) is mn.models.DeepseekV3ForCausalLM
    assert_logits_match(hf, model, VOCAB, label=name)


#: DeepSeek-V3's released rope scaling, scaled down: YaRN from 16 positions, with mscale and mscale_all_dim
#: different (their ratio multiplies the rotated parts, mscale_all_dim's square the score scale)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.3, "mscale_all_dim": 0.7}


def test_yarn_rope_scaling_matches_transformers(tmp_path):
    """Logits past the original length and greedy tokens through the caches (absorbed decoding) with
    DeepSeek-V3's YaRN: the attention factor on the rotated parts and mscale_all_dim on the score scale."""
    hf = deepseek(**dict(CONFIGS["lora"], rope_parameters=YARN))
    model = save_and_load(hf, tmp_path)
    assert model.model.layers[0].self_attn.rope_attention_factor != 1.0
    toks = tokens(VOCAB, (2, 40), seed=6)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < LOGITS_TOL, f"yarn: logits differ by {err:.3g}"
    prompt = tokens(VOCAB, (1, 12), seed=7)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()


def test_correction_bias_changes_the_choice(checkpoints):
    """The perturbed bias matters (so a model ignoring it would fail the comparisons): zeroing it changes logits."""
    hf, model, folder = checkpoints["lora"]
    toks = tokens(VOCAB, (2, 13), seed=1)
    other = load_pretrained(folder)
    for block in other.model.layers[1:]:
        block.mlp.gate.e_score_correction_bias = mx.zeros_like(block.mlp.gate.e_score_correction_bias)
    assert max_error(other(mx.array(toks)), hf_logits(hf, toks)) > 1e-2


def test_layers_carry_the_configs_plan(checkpoints):
    for name in CONFIGS:
        _, model, _ = checkpoints[name]
        cfg = CONFIGS[name]
        blocks = model.model.layers
        assert [i for i, b in enumerate(blocks) if isinstance(b.mlp, GroupLimitedMoE)] == SPARSE[name]
        assert all(isinstance(b.mlp, SwiGLU) for i, b in enumerate(blocks) if i not in SPARSE[name])
        for moe in model.moe_layers():
            assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group) == (
                cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_group"], cfg["topk_group"])
            assert moe.norm_topk_prob is cfg["norm_topk_prob"]
            assert moe.routed_scaling_factor == cfg["routed_scaling_factor"]
            assert moe.shared_experts.gate_proj.weight.shape == (cfg["moe_intermediate_size"] * cfg["n_shared_experts"],
                                                                 cfg["hidden_size"])
        for b in blocks:
            attn = b.self_attn
            assert isinstance(attn, LatentAttention) and attn.rope_traditional is cfg["rope_interleave"]
            assert ("q_a_proj" in attn) is (cfg["q_lora_rank"] is not None) and ("q_proj" in attn) is (
                cfg["q_lora_rank"] is None)
            assert attn.scale == pytest.approx((cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(name, checkpoints):
    """Through the latent caches (absorbed decoding); the fused decoding step declines these blocks."""
    hf, model, _ = checkpoints[name]
    assert all(block._step_plan() is None for block in model.model.layers)
    assert_greedy_matches(hf, model, VOCAB, n=24, label=name)


def test_cache_holds_the_compressed_latent(checkpoints):
    """Each layer caches ``[B, 1, T, kv_lora_rank]`` latents and ``[B, 1, T, qk_rope_head_dim]`` rotary keys,
    and the logits of a decoded token equal the uncached pass's last position."""
    hf, model, _ = checkpoints["lora"]
    cfg = CONFIGS["lora"]
    toks = tokens(VOCAB, (2, 9), seed=5)
    cache = model.make_cache()
    model(mx.array(toks[:, :8]), cache=cache)
    step = model(mx.array(toks[:, 8:]), cache=cache)
    for c in cache:
        assert isinstance(c, KVCache) and c.offset == 9
        keys, values = c.state
        assert keys.shape == (2, 1, 9, cfg["kv_lora_rank"]) and values.shape == (2, 1, 9, cfg["qk_rope_head_dim"])
    assert max_error(step[:, -1], hf_logits(hf, toks)[:, -1]) < LOGITS_TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_rows_get_their_lone_greedy_tokens(name, checkpoints):
    """`BatchGenerator` (chunked prefill, left-aligned rows at their own positions): each row's
    tokens are transformers' greedy continuation of its prompt alone; rows join while others decode."""
    hf, model, _ = checkpoints[name]
    assert_batched_rows_match(hf, model, VOCAB)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradients_match_torch(name, checkpoints):
    hf, model, _ = checkpoints[name]
    # the correction biases are parameters here (buffers in torch): no gradient reaches them
    biases = [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in SPARSE[name]]
    i = SPARSE[name][0]
    must = [f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.gate.weight",
            f"model.layers.{i}.mlp.shared_experts.down_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight",
            "model.layers.0.self_attn.kv_a_layernorm.weight"]
    assert_loss_and_gradients_match(hf, model, VOCAB, must_include=must, nonzero=True, metalnn_only=biases, label=name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_pretrained_loads_in_transformers(name, checkpoints, tmp_path):
    hf, model, _ = checkpoints[name]
    back = assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB, architecture="DeepseekV3ForCausalLM",
                                                     model_type="deepseek_v3", reload=True)
    np.testing.assert_array_equal(back.model.layers[SPARSE[name][0]].mlp.gate.e_score_correction_bias.numpy(),
                                  hf.model.layers[SPARSE[name][0]].mlp.gate.e_score_correction_bias.numpy())


def test_multi_token_prediction_layers_are_dropped(checkpoints, tmp_path):
    """A checkpoint's extra ``model.layers.<num_hidden_layers>.*`` (DeepSeek-V3's MTP module) is not loaded."""
    hf, _, folder = checkpoints["lora"]
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((4, 4), np.float32)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    toks = tokens(VOCAB, (1, 10), seed=6)
    assert max_error(load_pretrained(tmp_path)(mx.array(toks)), hf_logits(hf, toks)) < LOGITS_TOL


def test_lora_on_every_projection_trains_and_decodes(checkpoints):
    """Every projection by name (the latent ones included); with ``kv_b_proj`` adapted, decoding expands the
    latents (a fresh adapter adds nothing: transformers' tokens still), and training lowers the loss."""
    hf, _, folder = checkpoints["lora"]
    want = [f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ATTENTION if p != "q_proj"]
    want += [f"model.layers.0.mlp.{p}" for p in MLP]
    want += [f"model.layers.{i}.mlp.shared_experts.{p}" for i in SPARSE["lora"] for p in MLP]
    assert_lora_trains(folder, VOCAB, ATTENTION + MLP, want)
    model = load_pretrained(folder)
    mn.lora.apply(model, rank=4, alpha=8.0, targets=ATTENTION + MLP)
    assert not any(b.self_attn.absorbs(model.make_cache()[0]) for b in model.model.layers)
    prompt = tokens(VOCAB, (1, 7), seed=2)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()


def test_info_names_the_features(checkpoints):
    _, _, folder = checkpoints["lora"]
    want = ["multi-head latent attention (cached latent 12 + rotary key 4 a position; query rank 16)",
            "mixture of experts: 3 of 8 experts per token (renormalised)", "dense feed-forward on layers 0",
            "sigmoid routing from 2 of 4 expert groups, weights x2.5", "1 shared expert", "interleaved rotary pairs"]
    assert_info_features(folder, "DeepseekV3ForCausalLM", want)


def test_bad_configs_name_the_field():
    cfg = dict(CONFIGS["lora"], architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(UnsupportedConfigError, match=r"rope type 'dynamic' is not supported"):
        mn.models.from_config(dict(cfg, rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    with pytest.raises(UnsupportedConfigError, match=r"scoring_func = 'softmax'"):
        mn.models.from_config(dict(cfg, scoring_func="softmax"))
    with pytest.raises(UnsupportedConfigError, match=r"n_group = 3"):
        mn.models.from_config(dict(cfg, n_group=3))
    with pytest.raises(UnsupportedConfigError, match=r"topk_group = 5"):
        mn.models.from_config(dict(cfg, topk_group=5))
    with pytest.raises(UnsupportedConfigError, match=r"num_experts_per_tok = 5"):
        mn.models.from_config(dict(cfg, num_experts_per_tok=5))  # more than 2 groups of 2 hold
    with pytest.raises(UnsupportedConfigError, match=r"qk_rope_head_dim = 5"):
        mn.models.from_config(dict(cfg, qk_rope_head_dim=5))
    with pytest.raises(UnsupportedConfigError, match=r"hidden_act = 'nope'"):
        mn.models.from_config(dict(cfg, hidden_act="nope"))
    with pytest.raises(NotImplementedError, match="e_score_correction_bias"):
        mn.models.from_config(cfg).aux_loss()


# -- GGUF ------------------------------------------------------------------------------------------------

# widths multiples of 32 (Q8_0 rows: attn_k_b's rows are qk_nope_head_dim wide, attn_v_b's kv_lora_rank)
GGUF_CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                   initializer_range=0.2, max_position_embeddings=256, moe_intermediate_size=32, num_hidden_layers=3,
                   q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=8, v_head_dim=32,
                   n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                   first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, scoring_func="sigmoid",
                   topk_method="noaux_tc")


def quantized(name, shape):
    """Whether the Q8_0 file stores this tensor quantized: every matrix but the router."""
    return len(shape) >= 2 and not name.endswith("mlp.gate.weight")


def q8_0_layout_round_trip(hf):
    """`gguf_writing.q8_0_values`' round trip for ``hf``'s tensors: ``kv_b_proj`` in the file's split layout
    (``attn_k_b`` transposed: its blocks run along the key features), the others as they are."""
    c = hf.config

    def round_trip(name, a):
        if not name.endswith("kv_b_proj.weight"):
            return q8_0_round_trip(a)
        kv = a.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        k_b = q8_0_round_trip(np.ascontiguousarray(kv[:, :c.qk_nope_head_dim].transpose(0, 2, 1)))
        v_b = q8_0_round_trip(np.ascontiguousarray(kv[:, c.qk_nope_head_dim:]))
        return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(a.shape)

    return round_trip


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
def test_gguf_file_gives_transformers_logits_and_tokens(qtype, tmp_path):
    hf = deepseek(**GGUF_CONFIG)
    if qtype == Q.Q8_0:  # every matrix the Q8_0 file quantizes holds its Q8_0 round trip
        assert q8_0_values(hf, quantized, q8_0_layout_round_trip(hf)) > 10
    model = load_pretrained(write_gguf(tmp_path / "deepseek2.gguf", hf, qtype))
    assert type(model) is mn.models.DeepseekV3ForCausalLM
    assert len(model.moe_layers()) == 2 and model.moe_layers()[0].topk_group == 2
    assert model.args.q_lora_rank == 32 and model.args.v_head_dim == 32 and model.args.rope_interleave
    if qtype == Q.Q8_0:
        q = model.config["quantization"]
        assert q["model.layers.0.self_attn.q_a_proj"] == {"ggml_type": "Q8_0"}
        assert not any(k.endswith(("mlp.gate", "kv_b_proj")) for k in q)  # router and kv_b_proj in float
    assert_logits_match(hf, model, VOCAB)
    prompt = tokens(VOCAB, (1, 6), seed=2)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()


def test_gguf_softmax_gating_is_refused(tmp_path):
    """A file without ``expert_gating_func`` means softmax routing to llama.cpp (DeepSeek-V2's): refused."""
    hf = deepseek(**GGUF_CONFIG)
    path = write_gguf(tmp_path / "deepseek2.gguf", hf)
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(tmp_path / "softmax.gguf"), "deepseek2")
    for field in reader.fields.values():
        if field.name.startswith("deepseek2.") and field.name != "deepseek2.expert_gating_func":
            w.add_key_value(field.name, field.contents(), field.types[0],
                            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    with pytest.raises(UnsupportedConfigError, match=r"scoring_func = 'softmax'"):
        load_pretrained(finish(w, tmp_path / "softmax.gguf"))

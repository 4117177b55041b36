"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3's q/k-normed attention with sparse experts) against
transformers' ``Qwen3MoeForCausalLM``.

Tiny random models (gains moved off 1 by `hf_models.perturb`) are saved with save_pretrained (each
expert its own tensors) and loaded with metalnn. Two configs:

* ``mixed``: 3 layers, 2 of 4 experts per token renormalised (``norm_topk_prob``), layer 1 dense
  (``mlp_only_layers``), ``head_dim`` 16 != hidden / heads, an untied head;
* ``stepped``: 4 layers, 3 of 6 experts per token not renormalised, experts on every 2nd layer
  (``decoder_sparse_step=2``: layers 1 and 3), a 5-token sliding window on every layer, biases on
  the attention projections, one key/value head, tied embeddings.

Tolerances: logits 2e-4 absolute (two float32 implementations of a few-layer model whose logits are
O(1) agree to ~1e-6: room for summation order only); loss and gradients 1e-3 relative to the largest
entry of each gradient (float32 backward); the auxiliary loss 1e-5 relative (the same float32 sums);
greedy tokens identical for 24 tokens, batch 1 and 3 and through `BatchGenerator` rows, with prompts
longer than the window.

GGUF: llama.cpp's ``qwen3moe`` files (``convert_hf_to_gguf.py``'s ``Qwen3MoeModel``, a
``Qwen2MoeModel``: Qwen3's tensors untouched, each layer's experts stacked into ``ffn_gate_exps`` /
``ffn_up_exps`` / ``ffn_down_exps``, the router ``ffn_gate_inp`` kept F32; its graph has no dense
layers, always renormalises and has no window). `write_gguf` writes them with gguf-py the converter's
way (checked against ``convert_hf_to_gguf.py`` itself on the ``GGUF_CONFIG`` model: the same tensors
for ``--outtype f32`` and ``q8_0``). The Q8_0 file is compared with transformers holding the same Q8_0
values (each quantized matrix replaced by its quantize-dequantize round trip, a fixed point, so both
sides hold identical weights and 2e-4 holds again).
"""

import os

import gguf
import mlx.core as mx
import numpy as np
import pytest
import transformers
from gguf import GGMLQuantizationType as Q

import metalnn as mn
from metalnn.errors import UnsupportedConfigError
from metalnn.layers.moe import SparseMoE
from metalnn.llm.models import load_pretrained

from gguf_writing import add_tensor, expert_projections, finish, q8_0_values
from hf_models import hf_greedy, hf_logits, hf_model, max_error, saved_checkpoints, tokens
from model_checks import (LOGITS_TOL, assert_aux_loss_matches, assert_batched_rows_match, assert_greedy_matches,
                          assert_info_features, assert_logits_match, assert_lora_trains,
                          assert_loss_and_gradients_match, assert_saved_folder_loads_in_transformers)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, initializer_range=0.2,
            max_position_embeddings=256, moe_intermediate_size=8)
CONFIGS = {
    "mixed": dict(BASE, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                  norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False),
    "stepped": dict(BASE, num_hidden_layers=4, num_key_value_heads=1, head_dim=8, num_experts=6, num_experts_per_tok=3,
                    norm_topk_prob=False, decoder_sparse_step=2, use_sliding_window=True, sliding_window=5,
                    attention_bias=True, tie_word_embeddings=True),
}
SPARSE = {"mixed": [0, 2], "stepped": [1, 3]}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def qwen3_moe(**config):
    return hf_model(transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, **config)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{config name: (transformers model, metalnn model, folder)}."""
    return saved_checkpoints(tmp_path_factory, {name: qwen3_moe(**kw) for name, kw in CONFIGS.items()})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert type(model) is mn.models.Qwen3MoeForCausalLM
    assert_logits_match(hf, model, VOCAB, label=name)


def test_layers_carry_the_configs_plan(checkpoints):
    """Experts where transformers puts them, with its top-k and renormalisation; q/k norms and the window."""
    for name in CONFIGS:
        _, model, _ = checkpoints[name]
        cfg = CONFIGS[name]
        sparse = [i for i, b in enumerate(model.model.layers) if isinstance(b.mlp, SparseMoE)]
        assert sparse == SPARSE[name]
        moe = model.moe_layers()
        assert all(m.top_k == cfg["num_experts_per_tok"] and m.num_experts == cfg["num_experts"] for m in moe)
        assert all(m.norm_topk_prob is cfg["norm_topk_prob"] and "shared_expert" not in m for m in moe)
        window = cfg.get("sliding_window")
        assert all(b.self_attn.qk_norm and b.self_attn.sliding_window == window for b in model.model.layers)
    # without use_sliding_window no layer slides (transformers drops the window)
    off = mn.models.from_config(dict(CONFIGS["stepped"], use_sliding_window=False,
                                     architectures=["Qwen3MoeForCausalLM"]))
    assert all(b.self_attn.sliding_window is None for b in off.model.layers)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(name, checkpoints):
    """Through the caches (the fused decoding step runs the dense blocks and declines the MoE ones)."""
    hf, model, _ = checkpoints[name]
    assert_greedy_matches(hf, model, VOCAB, n=24, label=name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_rows_get_their_lone_greedy_tokens(name, checkpoints):
    """`BatchGenerator` (chunked prefill, left-aligned rows at their own positions): each row's
    tokens are transformers' greedy continuation of its prompt alone; rows join while others decode."""
    hf, model, _ = checkpoints[name]
    assert_batched_rows_match(hf, model, VOCAB)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_and_gradients_match_torch(name, checkpoints):
    hf, model, _ = checkpoints[name]
    i = SPARSE[name][0]
    must = [f"model.layers.{i}.mlp.experts.gate_up_proj", f"model.layers.{i}.mlp.experts.down_proj",
            f"model.layers.{i}.mlp.gate.weight", "model.layers.0.self_attn.q_norm.weight"]
    assert_loss_and_gradients_match(hf, model, VOCAB, must_include=must, nonzero=True, label=name)


def test_aux_loss_matches_transformers(checkpoints):
    """The load-balancing loss, added with router_aux_loss_coef, and the gradients of the total."""
    hf, model, _ = checkpoints["mixed"]
    assert_aux_loss_matches(hf, model, VOCAB, ["model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_pretrained_loads_in_transformers(name, checkpoints, tmp_path):
    hf, model, _ = checkpoints[name]
    back = assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB, architecture="Qwen3MoeForCausalLM",
                                                     model_type="qwen3_moe", reload=True)
    assert back.config.num_experts == hf.config.num_experts and back.config.mlp_only_layers == hf.config.mlp_only_layers


def test_lora_on_every_projection_trains(checkpoints):
    _, _, folder = checkpoints["mixed"]
    want = [f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in PROJECTIONS[:4]]
    want += [f"model.layers.1.mlp.{p}" for p in PROJECTIONS[4:]]  # the dense layer's MLP (experts are stacked)
    assert_lora_trains(folder, VOCAB, PROJECTIONS, want)


def test_info_names_the_experts(checkpoints):
    _, _, folder = checkpoints["mixed"]
    assert_info_features(folder, "Qwen3MoeForCausalLM",
                         ["q/k RMSNorm", "mixture of experts: 2 of 4 experts per token (renormalised)",
                          "dense feed-forward on layers 1"])


def test_bad_configs_name_the_field():
    cfg = dict(CONFIGS["mixed"], architectures=["Qwen3MoeForCausalLM"])
    with pytest.raises(UnsupportedConfigError, match=r"decoder_sparse_step = 0"):
        mn.models.from_config(dict(cfg, decoder_sparse_step=0))
    with pytest.raises(UnsupportedConfigError, match=r"num_experts_per_tok = 5.*1 to num_experts \(4\)"):
        mn.models.from_config(dict(cfg, num_experts_per_tok=5))
    with pytest.raises(UnsupportedConfigError, match=r"hidden_act = 'nope'"):
        mn.models.from_config(dict(cfg, hidden_act="nope"))
    # transformers writes num_experts as num_local_experts; either key is read
    local = {k: v for k, v in cfg.items() if k != "num_experts"}
    model = mn.models.from_config(dict(local, num_local_experts=4))
    assert model.args.num_experts == 4 and model.moe_layers()[0].num_experts == 4


# -- GGUF ------------------------------------------------------------------------------------------------


def write_gguf(path, hf, qtype=Q.F32):
    """``hf`` as llama.cpp's converter writes a ``qwen3moe`` file (``Qwen3MoeModel``: hyperparameters,
    expert sizes; tensors as they are, each layer's stacked ``gate_up_proj`` split into
    ``ffn_gate_exps`` / ``ffn_up_exps``; tied head left out); matrices and experts ``qtype``, the
    router, norms and biases F32."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_vocab_size(c.vocab_size)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, c.num_hidden_layers)

    def add(name, a):
        add_tensor(w, name, a, qtype if a.ndim >= 2 and ".ffn_gate_inp." not in name else Q.F32)

    for hf_name, p in hf.state_dict().items():
        if c.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        a = p.detach().numpy().astype(np.float32)
        for name, part in expert_projections(hf_name, a):
            add(names.get_name(name, try_suffixes=(".weight", ".bias")), part)
    return finish(w, path)


def quantized(name, shape):
    """Whether the Q8_0 file stores this tensor quantized: every matrix but the router."""
    return len(shape) >= 2 and not name.endswith("mlp.gate.weight")


# every layer sparse and renormalised (llama.cpp's qwen3moe graph), no window; widths multiples of 32 (Q8_0 rows)
GGUF_CONFIG = dict(BASE, num_hidden_layers=2, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                   norm_topk_prob=True, moe_intermediate_size=32, tie_word_embeddings=False)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
def test_gguf_file_gives_transformers_logits_and_tokens(qtype, tmp_path):
    hf = qwen3_moe(**GGUF_CONFIG)
    if qtype == Q.Q8_0:
        assert q8_0_values(hf, quantized) > 10  # every matrix the file quantizes holds its Q8_0 round trip
    model = load_pretrained(write_gguf(tmp_path / "qwen3moe.gguf", hf, qtype))
    assert type(model) is mn.models.Qwen3MoeForCausalLM
    assert len(model.moe_layers()) == 2 and model.moe_layers()[0].top_k == 2
    if qtype == Q.Q8_0:
        q = model.config["quantization"]
        assert q["model.layers.0.self_attn.q_proj"] == {"ggml_type": "Q8_0"}
        assert "model.layers.0.mlp.gate" not in q
    toks = tokens(VOCAB, (2, 13), seed=1)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < LOGITS_TOL, f"logits differ by {err:.3g}"
    prompt = tokens(VOCAB, (1, 6), seed=2)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()

"""qwen3next / qwen35 GGUF files (llama.cpp's hybrid Gated DeltaNet layouts) against transformers.

transformers cannot read these GGUF layouts, so each test writes a tiny random transformers model (both layer
kinds, fewer key than value heads, partial rotary embeddings, gains / gates moved off their initial values;
Qwen3-Next with 2 of 4 experts per token and a shared expert) to a GGUF file with tests/support/gguf_hybrid_files.py,
which applies llama.cpp's converter transforms on its own, and loads it with metalnn's `load_pretrained`.

Tolerances: float32 files give the logits within 2e-4 absolute (float32 against float32, as
tests/llm/models/test_models_hybrid.py; the + 1 on norms and -exp(A_log) round once in float32 each way). The Q8_0 files are
compared with transformers on the same model whose quantized matrices were replaced by their Q8_0 values
(quantize then dequantize, checked to be a fixed point of the round trip, so both sides hold identical weights):
metalnn multiplies the packed blocks with their exact float32 scales, so again only the summation order differs
and the same 2e-4 holds.
"""

import os

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

import metalnn as mn
from metalnn.errors import UnsupportedConfigError, WeightLoadError
from metalnn.llm.models import load_pretrained
from metalnn.llm.gguf.converters.qwen35 import grouped_order

from gguf_hybrid_files import quantizable, reorder_v_heads, write
from gguf_writing import q8_0_values
from hf_models import hf_greedy, hf_logits, hf_model, max_error, small_chunks, tokens

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOGITS_TOL = 2e-4
VOCAB = 96
HYBRID = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, initializer_range=0.2,
              full_attention_interval=2, max_position_embeddings=128,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
FAMILIES = {
    "qwen35": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, mn.models.Qwen3_5ForCausalLM,
               dict(HYBRID, tie_word_embeddings=True)),
    "qwen3next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, mn.models.Qwen3NextForCausalLM,
                  dict(HYBRID, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=12, norm_topk_prob=True,
                       decoder_sparse_step=1)),
}


def _hf(arch, **overrides):
    cfg, cls, _, kw = FAMILIES[arch]
    return hf_model(cfg, cls, **dict(kw, **overrides))


@pytest.fixture(scope="module")
def float_files(tmp_path_factory):
    """{arch: (transformers model, GGUF path)} with float32 tensors."""
    out = {}
    for arch in FAMILIES:
        hf = _hf(arch)
        out[arch] = (hf, write(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", hf, arch))
    return out


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_logits_match_transformers(arch, float_files):
    hf, path = float_files[arch]
    model = small_chunks(load_pretrained(path))
    assert type(model) is FAMILIES[arch][2]
    assert [("linear_attn" in b, "self_attn" in b) for b in model.model.layers] == [(True, False), (False, True),
                                                                                   (True, False)]
    toks = tokens(VOCAB, (2, 20), seed=1)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < LOGITS_TOL, f"{arch}: logits differ by {err:.3g}"
    short = toks[:, :5]  # the recurrent form
    assert max_error(model(mx.array(short)), hf_logits(hf, short)) < LOGITS_TOL


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_greedy_generation_matches_transformers(arch, float_files):
    hf, path = float_files[arch]
    model = small_chunks(load_pretrained(path))
    prompt = tokens(VOCAB, (1, 18), seed=2)
    want = hf_greedy(hf, prompt, 20)[0].tolist()
    assert len(set(want)) > 3
    assert mn.generate(model, prompt[0].tolist(), 20) == want


def test_config_read_from_the_metadata(float_files):
    _, path = float_files["qwen3next"]
    cfg = mn.models.read_gguf(path).config
    want = dict(layer_types=["linear_attention", "full_attention", "linear_attention"], partial_rotary_factor=0.5,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=12, mlp_only_layers=[], head_dim=16, tie_word_embeddings=False)
    assert {k: cfg[k] for k in want} == want


def test_value_head_order_is_restored():
    """grouped_order undoes the converter's _reorder_v_heads (2 key heads, 3 value heads each, 5 values a head)."""
    grouped = torch.arange(2 * 3 * 5).float().reshape(-1, 1)
    tiled = reorder_v_heads(grouped, 0, 2, 3, 5)
    assert not torch.equal(tiled, grouped)
    np.testing.assert_array_equal(tiled.numpy()[grouped_order(2, 6, 5)], grouped.numpy())


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_q8_0_file_stays_quantized_and_matches_transformers(arch, tmp_path):
    """Linear / Embedding weights stay 8-bit (Qwen3.5's out_proj too, its value heads 32 wide so the column
    blocks move whole); experts, the convolution, ssm_a and the norms come out float, and so does the router
    (llama.cpp keeps ``ffn_gate_inp`` F32)."""
    hf = _hf(arch, linear_value_head_dim=32) if arch == "qwen35" else _hf(arch)
    assert q8_0_values(hf, quantizable) > 5  # every matrix the file quantizes holds its Q8_0 round trip
    model = small_chunks(load_pretrained(write(tmp_path / "q8.gguf", hf, arch, qtype=Q.Q8_0)))
    kinds = {p: type(m).__name__ for p, m in model.named_modules()}
    names = ["model.embed_tokens", "model.layers.1.self_attn.q_proj"]
    names += (["model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.out_proj"] if arch == "qwen35"
              else ["model.layers.0.linear_attn.in_proj_qkvz", "lm_head"])
    assert all(kinds[n].startswith("Quantized") for n in names), {n: kinds[n] for n in names}
    if arch == "qwen3next":
        assert kinds["model.layers.0.mlp.gate"] == "Linear"
    toks = tokens(VOCAB, (2, 20), seed=3)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < LOGITS_TOL, f"{arch} Q8_0: logits differ by {err:.3g}"
    prompt = tokens(VOCAB, (1, 18), seed=4)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_missing_tensor_is_named(arch, float_files, tmp_path):
    hf, _ = float_files[arch]
    path = write(tmp_path / "missing.gguf", hf, arch, drop=("blk.2.ssm_a", "blk.1.attn_k.weight"))
    with pytest.raises(WeightLoadError) as e:
        load_pretrained(path)
    msg = str(e.value)
    assert str(path) in msg and "blk.2.ssm_a" in msg and "blk.1.attn_k" in msg


def test_full_attention_interval_disagreeing_with_the_tensors(float_files, tmp_path):
    hf, _ = float_files["qwen35"]
    path = write(tmp_path / "interval.gguf", hf, "qwen35", metadata={"full_attention_interval": (3, V.UINT32)})
    with pytest.raises(UnsupportedConfigError) as e:
        load_pretrained(path)
    msg = str(e.value)
    assert str(path) in msg and "qwen35.full_attention_interval = 3" in msg and "blk.1.attn_q" in msg


@pytest.mark.parametrize("key, value, words", [
    ("ssm.inner_size", 25, "ssm.inner_size = 25 is not a multiple of"),
    ("ssm.group_count", None, "lacks qwen3next.ssm.group_count"),
])
def test_bad_ssm_metadata(key, value, words, float_files, tmp_path):
    hf, _ = float_files["qwen3next"]
    path = write(tmp_path / "bad.gguf", hf, "qwen3next", metadata={key: (value, V.UINT32)})
    with pytest.raises(UnsupportedConfigError) as e:
        load_pretrained(path)
    assert str(path) in str(e.value) and words in str(e.value)

"""SmolLM3 (`SmolLM3ForCausalLM`: Llama blocks, some without RoPE, optional sliding windows) against
transformers' ``SmolLM3ForCausalLM``.

Tiny random models (gains moved off 1 by `hf_models.perturb`, biases random) are saved with
save_pretrained and loaded with metalnn. Two configs:

* ``interval``: 4 layers, a NoPE layer every 2nd (``no_rope_layer_interval=2``: layers 1 and 3), a
  4-token window on those NoPE layers (transformers' default ``layer_types`` with
  ``use_sliding_window``), biases on the attention and MLP projections, an untied head;
* ``listed``: ``no_rope_layers=[0, 1, 1, 1]`` (longer than the 3 layers; layer 0 NoPE), explicit
  ``layer_types`` sliding a 3-token window on RoPE layer 1 (without ``use_sliding_window``:
  transformers' sliding mask applies whatever it says), ``head_dim`` 16 != hidden / heads, one
  key/value head, tied embeddings.

Tolerances: logits 2e-4 absolute (two float32 implementations of a few-layer model whose logits are
O(1) agree to ~1e-6: room for summation order only); loss and gradients 1e-3 relative to the
largest entry (float32 backward); greedy tokens identical for 24 tokens, batch 1 and 3 and through
`BatchGenerator` rows, with prompts longer than the windows.

GGUF: llama.cpp's ``smollm3`` files (``convert_hf_to_gguf.py``'s ``SmolLM3Model``, a ``LlamaModel``:
the Llama Q/K row permutation, no per-layer metadata; its graph skips RoPE on every 4th layer and has
no window). `write_gguf` writes them with gguf-py the converter's way (checked against
``convert_hf_to_gguf.py`` itself on the ``GGUF_CONFIG`` model: the same ``smollm3.*`` keys and
byte-identical tensors for ``--outtype f32`` and ``q8_0``), so the models there use
``no_rope_layer_interval`` 4. The Q8_0 file is compared with transformers holding the same Q8_0
values (each quantized matrix replaced by its quantize-dequantize round trip, a fixed point, so
both sides hold identical weights and 2e-4 holds again).
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
from metalnn.llm.models import load_pretrained

from gguf_writing import add_tensor, finish, q8_0_values
from hf_models import hf_greedy, hf_logits, hf_model, max_error, save_and_load, saved_checkpoints, tokens
from model_checks import (LOGITS_TOL, assert_batched_rows_match, assert_greedy_matches, assert_info_features,
                          assert_logits_match, assert_lora_trains, assert_loss_and_gradients_match,
                          assert_saved_folder_loads_in_transformers)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, initializer_range=0.2,
            max_position_embeddings=256)
CONFIGS = {
    "interval": dict(BASE, num_hidden_layers=4, num_key_value_heads=2, no_rope_layer_interval=2,
                     use_sliding_window=True, sliding_window=4, attention_bias=True, mlp_bias=True,
                     tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "listed": dict(BASE, num_hidden_layers=3, num_key_value_heads=1, head_dim=16, no_rope_layers=[0, 1, 1, 1],
                   layer_types=["full_attention", "sliding_attention", "full_attention"], sliding_window=3,
                   tie_word_embeddings=True, initializer_range=0.3),
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def smollm3(**config):
    return hf_model(transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, **config)


def with_random_biases(hf, seed=0):
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{config name: (transformers model, metalnn model, folder)}."""
    models = {name: with_random_biases(smollm3(**kw)) for name, kw in CONFIGS.items()}
    return saved_checkpoints(tmp_path_factory, models)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, checkpoints):
    hf, model, _ = checkpoints[name]
    assert type(model) is mn.models.SmolLM3ForCausalLM
    assert_logits_match(hf, model, VOCAB, label=name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_layers_rotate_and_slide_as_transformers_decides(name, checkpoints):
    hf, model, _ = checkpoints[name]
    c = hf.config
    attn = [block.self_attn for block in model.model.layers]
    assert [a.use_rope for a in attn] == [bool(r) for r in c.no_rope_layers[:c.num_hidden_layers]]
    assert [a.sliding_window for a in attn] == [c.sliding_window if kind == "sliding_attention" else None
                                                for kind in c.layer_types]
    assert any(not a.use_rope for a in attn) and any(a.sliding_window for a in attn)


def test_default_plan_equals_transformers_defaults():
    """Configs without the per-layer lists (as a GGUF file or a hand-written config gives them) get
    the lists transformers' SmolLM3Config derives."""
    for kw in (dict(num_hidden_layers=8), dict(num_hidden_layers=6, no_rope_layer_interval=3),
               dict(num_hidden_layers=5, use_sliding_window=True, sliding_window=7),
               dict(num_hidden_layers=4, sliding_window=7)):
        cfg = dict(BASE, num_key_value_heads=2, **kw)
        want = transformers.SmolLM3Config(**cfg, pad_token_id=None, bos_token_id=None, eos_token_id=None)
        model = mn.models.from_config(dict(cfg, architectures=["SmolLM3ForCausalLM"]))
        attn = [block.self_attn for block in model.model.layers]
        assert [a.use_rope for a in attn] == [bool(r) for r in want.no_rope_layers], kw
        window = want.sliding_window
        assert [a.sliding_window for a in attn] == [window if t == "sliding_attention" else None
                                                    for t in want.layer_types], kw


def test_a_nope_layer_is_blind_to_order(tmp_path):
    """A 1-layer model whose layer has no RoPE and no window: the last position attends to a set of
    keys, so reversing the tokens before it leaves its logits unchanged (with RoPE it would not)."""
    hf = smollm3(**dict(BASE, num_hidden_layers=1, num_key_value_heads=2, no_rope_layers=[0]))
    model = save_and_load(hf, tmp_path)
    toks = tokens(VOCAB, (1, 9), seed=6)
    shuffled = np.concatenate([toks[:, :8][:, ::-1], toks[:, 8:]], axis=1)
    a, b = np.array(model(mx.array(toks))), np.array(model(mx.array(shuffled)))
    np.testing.assert_allclose(a[0, -1], b[0, -1], atol=1e-5)
    assert np.abs(a[0, :-1] - b[0, :-1]).max() > 1e-3  # (earlier positions see different prefixes)
    assert max_error(a, hf_logits(hf, toks)) < LOGITS_TOL


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_transformers(name, checkpoints):
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
    nope = [i for i, r in enumerate(hf.config.no_rope_layers[:hf.config.num_hidden_layers]) if not r]
    blind = [f"model.layers.{i}.self_attn.k_proj.bias" for i in nope]
    _, got, _, ref = assert_loss_and_gradients_match(hf, model, VOCAB, must_include=["model.embed_tokens.weight"],
                                                     skip=blind, label=name)
    scale = max(float(np.abs(g).max()) for g in ref.values())
    for k in blind:
        if k in ref:
            # without RoPE a key bias shifts every score of a query equally: the softmax ignores it,
            # so its gradient is 0 (both sides give float32 rounding noise, ~1e-8 of the largest gradient)
            assert max_error(got[k], 0) < 1e-6 * scale and max_error(ref[k], 0) < 1e-6 * scale, k


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_pretrained_loads_in_transformers(name, checkpoints, tmp_path):
    hf, model, _ = checkpoints[name]
    back = assert_saved_folder_loads_in_transformers(hf, model, tmp_path, VOCAB, architecture="SmolLM3ForCausalLM",
                                                     model_type="smollm3")
    assert back.config.no_rope_layers == hf.config.no_rope_layers and back.config.layer_types == hf.config.layer_types


def test_lora_on_every_projection_trains(checkpoints):
    _, _, folder = checkpoints["interval"]
    parent = {p: "self_attn" if p in PROJECTIONS[:4] else "mlp" for p in PROJECTIONS}
    want = [f"model.layers.{i}.{parent[p]}.{p}" for i in range(4) for p in PROJECTIONS]
    assert_lora_trains(folder, VOCAB, PROJECTIONS, want)


def test_info_names_the_nope_and_window_layers(checkpoints):
    _, _, folder = checkpoints["interval"]
    assert_info_features(folder, "SmolLM3ForCausalLM",
                         ["no RoPE (NoPE) on layers 1, 3 of 4", "sliding window 4 on layers 1, 3"])


def test_bad_plans_name_the_field():
    cfg = dict(BASE, num_hidden_layers=3, num_key_value_heads=2, architectures=["SmolLM3ForCausalLM"])
    short = r"no_rope_layers must list .*\(num_hidden_layers=3\), got \[1, 0\]"
    with pytest.raises(UnsupportedConfigError, match=short):
        mn.models.from_config(dict(cfg, no_rope_layers=[1, 0]))
    with pytest.raises(UnsupportedConfigError, match=r"no_rope_layers\[1\] = 2"):
        mn.models.from_config(dict(cfg, no_rope_layers=[1, 2, 1]))
    with pytest.raises(UnsupportedConfigError, match=r"no_rope_layer_interval = 0"):
        mn.models.from_config(dict(cfg, no_rope_layer_interval=0))
    with pytest.raises(UnsupportedConfigError, match=r"layer_types\[2\] = 'chunked_attention'"):
        mn.models.from_config(dict(cfg, layer_types=["full_attention"] * 2 + ["chunked_attention"]))
    with pytest.raises(UnsupportedConfigError, match="sliding_attention layers but sliding_window is None"):
        mn.models.from_config(dict(cfg, layer_types=["sliding_attention"] * 3))


# -- GGUF ------------------------------------------------------------------------------------------------


def write_gguf(path, hf, qtype=Q.F32):
    """``hf`` as llama.cpp's converter writes a ``smollm3`` file (``LlamaModel``: hyperparameters,
    vocab size, rope dimensions; Q/K rows permuted by ``LlamaModel.permute``; tied head left out);
    matrices ``qtype``, norms and biases F32."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), "smollm3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(head_dim)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.SMOLLM3, c.num_hidden_layers)
    for hf_name, p in hf.state_dict().items():
        if c.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        a = p.detach().numpy().astype(np.float32)
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            n = c.num_attention_heads if ".q_proj." in hf_name else c.num_key_value_heads
            a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        add_tensor(w, name, a, qtype if a.ndim == 2 else Q.F32)
    return finish(w, path)


def quantized(name, shape):
    """Whether the Q8_0 file stores this tensor quantized: every matrix."""
    return len(shape) == 2


GGUF_CONFIG = dict(BASE, num_hidden_layers=4, num_key_value_heads=2, no_rope_layer_interval=4, tie_word_embeddings=True)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
def test_gguf_file_gives_transformers_logits_and_tokens(qtype, tmp_path):
    hf = smollm3(**GGUF_CONFIG)
    if qtype == Q.Q8_0:
        assert q8_0_values(hf, quantized) > 10  # every matrix the file quantizes holds its Q8_0 round trip
    model = load_pretrained(write_gguf(tmp_path / "smollm3.gguf", hf, qtype))
    assert type(model) is mn.models.SmolLM3ForCausalLM and model.tie_word_embeddings
    assert [b.self_attn.use_rope for b in model.model.layers] == [True, True, True, False]
    assert all(b.self_attn.sliding_window is None for b in model.model.layers)
    if qtype == Q.Q8_0:
        q = model.config["quantization"]
        assert q["model.layers.0.self_attn.q_proj"] == q["model.embed_tokens"] == {"ggml_type": "Q8_0"}
    toks = tokens(VOCAB, (2, 13), seed=1)
    err = max_error(model(mx.array(toks)), hf_logits(hf, toks))
    assert err < LOGITS_TOL, f"logits differ by {err:.3g}"
    prompt = tokens(VOCAB, (1, 6), seed=2)
    assert mn.generate(model, prompt[0].tolist(), 20) == hf_greedy(hf, prompt, 20)[0].tolist()

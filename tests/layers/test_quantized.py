"""Quantized layers, `metalnn.quantize`, and MLX-quantized checkpoint folders.

References: MLX's own ``mx.dequantize`` (the float weight a quantized one stands for), a numpy
unpacking of the packed words, and transformers' Llama / GPT-2 run on the dequantized weights.
Tolerances: float32 products of the same dequantized weights agree to ~1e-5 (different summation
orders); 1e-3 absolute on the logits of 2-layer models (two independent fp32 implementations;
logits are O(1)).
"""

import copy
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers
from mlx.utils import tree_flatten
from safetensors.numpy import save_file

import metalnn as mn
from metalnn.functional.quantized import CPU_DEQUANTIZE_ROWS
from metalnn.llm.models import load_pretrained

from hf_models import hf_logits

transformers.logging.set_verbosity_error()


def _deq(w, s, b, group_size, bits, mode="affine"):
    return mx.dequantize(w, s, b, group_size, bits, mode=mode)


def _np(a):
    return np.array(a.astype(mx.float32))


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantized_linear_equals_dequantized_product(bits, group_size):
    mx.random.seed(bits * 1000 + group_size)
    lin = mn.Linear(48, in_features=256)
    q = mn.QuantizedLinear.from_linear(lin, group_size=group_size, bits=bits)
    w_ref = _deq(*mx.quantize(lin.weight, group_size, bits), group_size, bits)
    assert q.weight.dtype == mx.uint32 and q.weight.shape == (48, 256 * bits // 32)
    assert q.scales.shape == (48, 256 // group_size) and q.biases.shape == q.scales.shape
    for rows in (1, CPU_DEQUANTIZE_ROWS + 3):  # quantized_matmul path and dequantize-then-multiply path
        x = mx.random.normal((2, rows, 256))
        got = q(x)
        want = x @ w_ref.T + lin.bias
        assert got.shape == (2, rows, 48)
        np.testing.assert_allclose(_np(got), _np(want), atol=2e-5, rtol=1e-5)


def test_packed_layout_matches_numpy_unpacking():
    mx.random.seed(1)
    lin = mn.Linear(8, in_features=64, bias=False)
    q = mn.QuantizedLinear.from_linear(lin, group_size=32, bits=4)
    words = np.array(q.weight)  # [8, 8] uint32, 8 nibbles each, lowest bits first
    nibbles = np.stack([(words >> (4 * i)) & 0xF for i in range(8)], axis=-1).reshape(8, 64)
    scales, biases = np.array(q.scales), np.array(q.biases)
    w = nibbles * np.repeat(scales, 32, axis=1) + np.repeat(biases, 32, axis=1)
    np.testing.assert_allclose(_np(q.dequantized_weight(mx.float32)), w, rtol=1e-6, atol=1e-7)
    # and every value is within one quantization step of the float weight (MLX moves the grid so
    # that zero is exact, so the error can exceed half a step)
    err = np.abs(w - np.array(lin.weight))
    assert np.all(err <= np.abs(np.repeat(scales, 32, axis=1)) * 1.001)


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8", "nvfp4"])
def test_other_modes(mode):
    mx.random.seed(2)
    lin = mn.Linear(32, in_features=128, bias=False)
    q = mn.QuantizedLinear.from_linear(lin, mode=mode)
    assert "biases" not in q.parameters()
    x = mx.random.normal((3, 128))
    w, s = mx.quantize(lin.weight, q.group_size, q.bits, mode=mode)
    ref = x @ mx.dequantize(w, s, None, q.group_size, q.bits, mode=mode).T
    np.testing.assert_allclose(_np(q(x)), _np(ref), atol=2e-5, rtol=1e-5)


def test_quantized_embedding_lookup_and_tied_projection():
    mx.random.seed(3)
    emb = mn.Embedding(100, 64)
    q = mn.QuantizedEmbedding.from_embedding(emb, group_size=32, bits=8)
    table = _deq(*mx.quantize(emb.weight, 32, 8), 32, 8)
    ids = mx.array([[3, 99, 0, 3], [7, 7, 50, 1]])
    np.testing.assert_array_equal(_np(q(ids)), _np(table[ids]))
    h = mx.random.normal((2, 4, 64))
    np.testing.assert_allclose(_np(q.as_linear(h)), _np(h @ table.T), atol=2e-5, rtol=1e-5)


def test_constructor_and_bad_settings():
    q = mn.QuantizedLinear(16, in_features=64, bits=8, group_size=32)
    assert q.in_features == 64 and q.for_update() == {}  # frozen
    lazy = mn.QuantizedLinear(16, group_size=32)
    assert lazy(mx.zeros((2, 96))).shape == (2, 16) and lazy.in_features == 96
    with pytest.raises(TypeError, match="in_features="):
        mn.QuantizedLinear(64, 16)
    with pytest.raises(ValueError, match="bits 7"):
        mn.QuantizedLinear(16, bits=7)
    with pytest.raises(ValueError, match="group_size 48"):
        mn.QuantizedLinear(16, group_size=48)
    with pytest.raises(ValueError, match="not a multiple of group_size 64"):
        mn.QuantizedLinear(16, in_features=96)
    with pytest.raises(ValueError, match="mode"):
        mn.QuantizedEmbedding(10, 64, mode="int4")


def _mlp():
    mx.random.seed(4)
    model = mn.Layers(mn.Linear(128), mn.ReLU(), mn.Linear(100), mn.ReLU(), mn.Linear(10))
    model(mx.zeros((1, 64)))  # built: widths 64 -> 128 -> 100 -> 10
    return model


def test_quantize_model_equals_dequantized_float_model():
    model = _mlp()
    ref = copy.deepcopy(model)
    summary = mn.quantize(model, bits=4, group_size=64)
    assert summary.quantized == ["layers.0", "layers.2"]
    assert summary.skipped == {"layers.4": "input width 100 is not a multiple of group_size 64"}
    assert "layers.4 (input width 100" in str(summary) and summary.bytes_after < summary.bytes_before
    assert isinstance(model.layers[0], mn.QuantizedLinear) and type(model.layers[4]) is mn.Linear
    for i in (0, 2):  # the reference: float layers holding the dequantized weights
        ref.layers[i].weight = _deq(*mx.quantize(ref.layers[i].weight, 64, 4), 64, 4)
    x = mx.random.normal((5, 64))
    np.testing.assert_allclose(_np(model(x)), _np(ref(x)), atol=2e-5, rtol=1e-5)


def test_quantize_predicate_and_unbuilt_model():
    model = _mlp()
    summary = mn.quantize(model, predicate=lambda path, layer: {"bits": 8, "group_size": 32} if path == "layers.0"
                          else False)
    assert summary.quantized == ["layers.0"] and model.layers[0].bits == 8
    assert summary.skipped["layers.2"] == "excluded by the predicate"
    with pytest.raises(ValueError, match="not built"):
        mn.quantize(mn.Layers(mn.Linear(8)))


def test_gradients_flow_through_quantized_layer_to_trainable_ones():
    """The QLoRA situation: a frozen quantized layer after a trainable one."""
    model = _mlp()
    mn.quantize(model, predicate=lambda path, layer: path == "layers.2")
    q = model.layers[2]
    assert set(model.for_update()) == {"layers.0.weight", "layers.0.bias", "layers.4.weight", "layers.4.bias"}
    x = mx.random.normal((CPU_DEQUANTIZE_ROWS + 2, 64))
    wq = q.dequantized_weight(mx.float32)

    def loss(m):
        return (m(x) ** 2).sum()

    _, grads = nn.value_and_grad(model, loss)(model)
    grads = dict(tree_flatten(grads))

    def ref_loss(w0, b0):  # the same network written out with the dequantized weight
        h = mx.maximum(x @ w0.T + b0, 0)
        h = mx.maximum(h @ wq.T + q.bias, 0)
        return ((h @ model.layers[4].weight.T + model.layers[4].bias) ** 2).sum()

    g0, gb0 = mx.grad(ref_loss, argnums=(0, 1))(model.layers[0].weight, model.layers[0].bias)
    np.testing.assert_allclose(_np(grads["layers.0.weight"]), _np(g0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_np(grads["layers.0.bias"]), _np(gb0), rtol=1e-4, atol=1e-4)
    # and straight through the layer, for one row (the quantized_matmul path)
    v = mx.random.normal((1, 128))
    gx = mx.grad(lambda v: (q(v) ** 2).sum())(v)
    gref = mx.grad(lambda v: ((v @ wq.T + q.bias) ** 2).sum())(v)
    np.testing.assert_allclose(_np(gx), _np(gref), rtol=1e-4, atol=1e-5)


# -- MLX-quantized checkpoint folders -----------------------------------------------------------

LLAMA = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
# default 4 bits / group 32; one layer 8 bits / group 64; the output head kept in float
QUANT = {"group_size": 32, "bits": 4, "model.layers.1.mlp.down_proj": {"group_size": 64, "bits": 8},
         "lm_head": False}


def _mlx_folder(tmp_path, tie=False, quant=QUANT):
    """A tiny transformers Llama quantized the way MLX writes folders, and the transformers model
    holding the dequantized weights (the oracle)."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, tie_word_embeddings=tie,
                                                                initializer_range=0.1)).eval()
    tensors, deq = {}, {}
    for name, p in hf.state_dict().items():
        a = p.detach().numpy()
        path = name.rsplit(".", 1)[0]
        settings = quant.get(path, quant) if not tie or path != "lm_head" else False
        quantizable = name.endswith(".weight") and a.ndim == 2
        if quantizable and settings is not False:
            g, b = settings["group_size"], settings["bits"]
            w, s, bi = mx.quantize(mx.array(a), g, b)
            tensors.update({name: np.array(w), f"{path}.scales": np.array(s), f"{path}.biases": np.array(bi)})
            deq[name] = torch.from_numpy(np.array(mx.dequantize(w, s, bi, g, b)))
        elif not (tie and name == "lm_head.weight"):
            tensors[name] = a
    folder = tmp_path / "mlx-4bit"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "mlx"})
    cfg = hf.config.to_dict()
    cfg.update(architectures=["LlamaForCausalLM"], quantization=quant, quantization_config=quant)
    (folder / "config.json").write_text(json.dumps(cfg))
    sd = hf.state_dict()
    sd.update(deq)
    hf.load_state_dict(sd)
    if tie:
        hf.tie_weights()
    return folder, hf


def _logits(model, tokens):
    return np.array(model(mx.array(tokens)).astype(mx.float32))


TOKENS = np.random.default_rng(0).integers(0, 160, (2, 9)).tolist()


def test_mlx_folder_matches_transformers_on_dequantized_weights(tmp_path):
    folder, hf = _mlx_folder(tmp_path)
    model = load_pretrained(folder)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, mn.QuantizedLinear) and attn.q_proj.bits == 4 and attn.q_proj.group_size == 32
    down = model.model.layers[1].mlp.down_proj
    assert (down.bits, down.group_size) == (8, 64)
    assert isinstance(model.model.embed_tokens, mn.QuantizedEmbedding)
    assert type(model.lm_head) is mn.Linear
    np.testing.assert_allclose(_logits(model, TOKENS), hf_logits(hf, TOKENS), atol=1e-3, rtol=1e-3)


def test_tied_quantized_head_matches_transformers(tmp_path):
    folder, hf = _mlx_folder(tmp_path, tie=True, quant={"group_size": 64, "bits": 8})
    model = load_pretrained(folder)
    assert isinstance(model.model.embed_tokens, mn.QuantizedEmbedding) and "lm_head" not in model
    np.testing.assert_allclose(_logits(model, TOKENS), hf_logits(hf, TOKENS), atol=1e-3, rtol=1e-3)


def test_quantized_save_load_round_trip_is_exact(tmp_path):
    folder, _ = _mlx_folder(tmp_path)
    model = load_pretrained(folder)
    out = model.save_pretrained(tmp_path / "again")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["model.layers.1.mlp.down_proj"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    assert cfg["quantization"]["lm_head"] is False and cfg["quantization_config"] == cfg["quantization"]
    again = load_pretrained(out)
    np.testing.assert_array_equal(_logits(again, TOKENS), _logits(model, TOKENS))


def test_quantize_then_save_gpt2_and_llama_round_trip(tmp_path):
    for name, cfg in (("llama", mn.models.llama_config(96, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                                        num_attention_heads=4, tie_word_embeddings=True)),
                      ("gpt2", dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=96, n_embd=64,
                                    n_layer=2, n_head=4, n_positions=64))):
        model = mn.models.from_config(cfg, seed=1).eval()
        tokens = (np.array(TOKENS) % 96).tolist()
        float_logits = _logits(model, tokens)
        summary = mn.quantize(model, bits=8, group_size=32)
        assert not summary.skipped, summary
        q_logits = _logits(model, tokens)
        # 8-bit weights: the logits move, but little (|logits| ~ 1)
        assert 0 < np.abs(q_logits - float_logits).max() < 0.05, name
        again = load_pretrained(model.save_pretrained(tmp_path / name))
        assert [p for p, _ in mn.quantization.quantized_layers(again)] == summary.quantized
        np.testing.assert_array_equal(_logits(again, tokens), q_logits)


def test_quantization_config_that_does_not_fit(tmp_path):
    folder, _ = _mlx_folder(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())

    def load_with(quant):
        cfg["quantization"] = quant
        (folder / "config.json").write_text(json.dumps(cfg))
        return load_pretrained(folder)

    with pytest.raises(mn.WeightLoadError, match="quantization does not fit") as e:
        load_with({**QUANT, "bits": 8})  # the tensors are 4-bit
    assert "model.layers.0.self_attn.q_proj.weight" in str(e.value) and str(folder) in str(e.value)
    with pytest.raises(mn.UnsupportedConfigError, match="bits 7") as e:
        load_with({**QUANT, "bits": 7, "model.layers.1.mlp.down_proj": {"group_size": 48}})
    assert "group_size 48" in str(e.value)  # every problem in one message
    with pytest.raises(mn.UnsupportedConfigError, match="not a multiple of group_size 128"):
        load_with({"group_size": 128, "bits": 4})  # hidden size 64
    with pytest.raises(mn.UnsupportedConfigError, match="names no Linear"):
        load_with({**QUANT, "model.layers.0.self_attn": {"bits": 8}})
    cfg.pop("quantization")
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(mn.UnsupportedConfigError, match="'gptq' is not supported"):
        load_pretrained(folder)

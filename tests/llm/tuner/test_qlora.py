"""QLoRA: LoRA adapters over `QuantizedLinear` bases, on a tiny Llama that transformers builds and
metalnn quantizes to 4 bits (group size 32).

References: transformers + PEFT running the same model on the dequantized weights (float32, the
values ``scales * q + biases`` of a numpy unpacking of the packed words), and the float model
before quantization. Tolerances are stated where they are used.
"""


import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import peft
import pytest
import torch
import transformers
from mlx.utils import tree_flatten

import metalnn as mn
from metalnn.llm.bundled import smollm2_path
from metalnn.llm.tuner import datasets, lora
from metalnn.quantization import QUANTIZED

from memory import peak_above_active
from bundled_model import needs_smollm2  # noqa: F401  (fixtures)

transformers.logging.set_verbosity_error()
CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
BITS, GROUP = 4, 32
TARGETS = ("q_proj", "v_proj", "down_proj")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, initializer_range=0.1)).eval()
    out = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(out, safe_serialization=True)
    return out


def quantized_model(folder):
    model = mn.models.load_pretrained(folder)
    summary = mn.quantize(model, bits=BITS, group_size=GROUP)
    assert not summary.skipped
    return model


def tokens(shape, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, CONFIG["vocab_size"], size=shape))


def lm_loss(model, batch, device=None):
    return mn.losses.cross_entropy(model(batch[:, :-1], device=device), batch[:, 1:])


def with_random_adapters(model, std=0.05, seed=0, targets=TARGETS):
    """Adapters as after training: B drawn (not zeros), so every adapter changes the output."""
    mx.random.seed(seed)
    paths = lora.apply(model, rank=4, alpha=8.0, targets=targets)
    rng = np.random.default_rng(seed)
    for m in lora.adapters(model).values():
        m.lora_B.weight = mx.array(rng.normal(0, std, m.lora_B.weight.shape).astype(np.float32))
    return paths


def unpacked(layer, dtype=np.float32):
    """``(scales * q + biases, |scales * q| + |biases|)`` ``[out, in]`` of a 4-bit `QuantizedLinear`
    / `QuantizedEmbedding`, unpacked with numpy (8 nibbles per uint32 word, lowest bits first) and
    computed in float64 (returned in ``dtype``)."""
    words = np.array(layer.weight)
    q = np.stack([(words >> (4 * i)) & 0xF for i in range(8)], axis=-1).reshape(words.shape[0], -1)
    scaled = q * np.repeat(np.array(layer.scales, dtype=np.float64), GROUP, axis=1)
    biases = np.repeat(np.array(layer.biases, dtype=np.float64), GROUP, axis=1)
    return (scaled + biases).astype(dtype), (np.abs(scaled) + np.abs(biases)).astype(dtype)


def base_bytes(model):
    """Every non-adapter parameter, by its name before `apply`, as raw bytes."""
    return {k.replace(".base_layer.", "."): np.array(v).tobytes() for k, v in model.named_parameters().items()
            if ".lora_" not in k}


def test_base_stays_quantized_with_the_same_bytes_while_adapters_train(folder):
    model = quantized_model(folder)
    before = base_bytes(model)
    paths = lora.apply(model, rank=4, alpha=8.0, targets=TARGETS)
    assert len(paths) == 3 * len(TARGETS)
    for m in lora.adapters(model).values():
        assert isinstance(m.base_layer, mn.QuantizedLinear)
        assert m.lora_A.weight.dtype == mx.float32
    assert all(".lora_A." in n or ".lora_B." in n for n in lora.trainable_names(model))
    data = tokens((4, 17), seed=1)
    trainer = mn.Trainer(model, optim.Adam(2e-2), lm_loss, mn.Device(seed=0), progress=False)
    trainer.fit(lambda s: data, 12)
    losses = trainer.history["loss"]
    assert losses[-1] < 0.9 * losses[0], losses
    after = base_bytes(model)
    assert after.keys() == before.keys()
    assert all(after[k] == before[k] for k in before), [k for k in before if after[k] != before[k]]
    assert sum(isinstance(m, QUANTIZED) for _, m in model.named_modules()) == 3 * 7 + 2  # + embedding, lm_head


def dequantized_hf(folder, model):
    """transformers' Llama holding the dequantized (numpy-unpacked) weights of ``model``."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    state = hf.state_dict()
    n = 0
    for path, m in model.named_modules():
        if isinstance(m, QUANTIZED):
            path = path.replace(".base_layer", "")
            state[f"{path}.weight"] = torch.from_numpy(unpacked(m)[0])
            n += 1
    assert n == 3 * 7 + 2
    hf.load_state_dict(state)
    return hf


@pytest.mark.parametrize("shape", [(1, 4), (2, 12)], ids=["3-rows", "22-rows"])
def test_adapter_gradients_flow_through_the_quantized_products(folder, tmp_path, shape):
    """The gradients of every adapter equal PEFT's on the dequantized model: they flow through the
    quantized projections of the blocks above (and the quantized lm_head). Few rows take
    ``mx.quantized_matmul``; many rows take the dequantize-then-multiply path.

    Tolerance: 1e-4 of each gradient's largest entry (float32 sums of a 3-block model, different
    orders in MLX and torch).
    """
    model = quantized_model(folder)
    with_random_adapters(model)
    batch = tokens(shape, seed=2)
    model.train()
    _, grads = nn.value_and_grad(model, lambda b: lm_loss(model, b))(batch)
    ours = dict(tree_flatten(grads))
    assert len(ours) == 2 * 3 * len(TARGETS)

    lora.save_adapters(model, tmp_path)
    peft_model = peft.PeftModel.from_pretrained(dequantized_hf(folder, model), tmp_path, is_trainable=True)
    toks = torch.tensor(np.array(batch))
    logits = peft_model(toks[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), toks[:, 1:].reshape(-1)).backward()
    theirs = {n.replace("base_model.model.", "").replace(".default", ""): p.grad.numpy()
              for n, p in peft_model.named_parameters() if p.requires_grad}
    assert set(theirs) == set(ours)
    for name, g in ours.items():
        want = theirs[name]
        assert np.abs(want).max() > 0, name
        np.testing.assert_allclose(np.array(g), want, atol=1e-4 * np.abs(want).max(), rtol=0, err_msg=name)


def test_the_backward_pass_does_not_keep_a_float_copy_of_the_weights(tmp_path):
    """On the CPU a many-row product dequantizes the weight; the backward pass dequantizes it again
    rather than keeping the forward's float copy, so a training step through a quantized model
    holds less than its float weights (keeping them, the same step holds about 1.45x them,
    measured; recomputing, about 0.65x: activations and one layer's weight at a time)."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=96, hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=4, head_dim=64, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).save_pretrained(tmp_path)
    model = mn.models.load_pretrained(tmp_path)
    mn.quantize(model, bits=4, group_size=64)
    float_bytes = sum(m.weight.shape[0] * m.packed_width * 4 for _, m in model.named_modules()
                      if isinstance(m, mn.QuantizedLinear))
    mx.random.seed(0)
    lora.apply(model, rank=4, alpha=8.0)
    batch = tokens((2, 65), seed=5)  # 128 rows: the dequantizing path
    step = nn.value_and_grad(model, lambda b: lm_loss(model, b))
    mx.eval(step(batch))
    peak = peak_above_active(lambda: mx.eval(step(batch)))
    assert peak < float_bytes, (peak / 2**20, float_bytes / 2**20)


def test_fuse_requantizes_within_the_quantization_error(folder):
    """Fusing over a quantized base re-quantizes ``W + s B A`` with the base's own settings.

    Weights: each fused value is within one quantization step (its group's scale) of the merged
    float weight: MLX's affine rounding moves the grid so that zero is exact, so one step, not half,
    is its bound (tests/layers/test_quantized.py checks the same bound for a first quantization).
    Logits: re-quantizing the adapted layers is one more rounding of the same layers at the same
    settings, so it costs about what quantizing those layers once costs; the bound is twice the
    logit error of quantizing exactly those layers of the float model (measured ratio over four
    seeds: 0.78 to 1.01).
    """
    model = quantized_model(folder)
    paths = with_random_adapters(model, std=0.3)
    model.eval()
    toks = tokens((2, 10), seed=3)
    with_adapters = np.array(model(toks))
    merged = {p: np.array(m.merged_weight()) for p, m in lora.adapters(model).items()}
    settings = {p: (m.base_layer.group_size, m.base_layer.bits, m.base_layer.mode, m.base_layer.scales.dtype)
                for p, m in lora.adapters(model).items()}
    fused = lora.fuse(model)
    assert fused == paths and not lora.adapters(model)
    assert not any(".lora_" in n or ".base_layer." in n for n in model.named_parameters())
    assert not lora.trainable_names(model) or all(
        not n.endswith((".scales", ".biases")) for n in lora.trainable_names(model))
    for p in paths:
        layer = _at(model, p)
        assert isinstance(layer, mn.QuantizedLinear)
        assert (layer.group_size, layer.bits, layer.mode, layer.scales.dtype) == settings[p]
        w, _ = unpacked(layer)
        step = np.abs(np.repeat(np.array(layer.scales), GROUP, axis=1))
        assert np.all(np.abs(w - merged[p]) <= step * 1.001), p
    got = np.array(model(toks))

    # the logit error of quantizing only the adapted layers of the float model, once
    float_model = mn.models.load_pretrained(folder)
    reference = np.array(float_model(toks))
    mn.quantize(float_model, bits=BITS, group_size=GROUP,
                predicate=lambda path, layer: path.rpartition(".")[2] in TARGETS)
    once = np.abs(np.array(float_model(toks)) - reference).max()
    err = np.abs(got - with_adapters).max()
    assert err <= 2 * once, (err, once)
    # and the adapters' effect survives: the fused model is far closer to the adapted one than the base is
    base = np.array(quantized_model(folder)(toks))
    assert err < 0.25 * np.abs(with_adapters - base).max(), (err, np.abs(with_adapters - base).max())


def test_fuse_dequantize_keeps_float_weights_exactly(folder):
    """``dequantize=True`` stores ``scales * q + biases + s * B @ A`` in float32, exact up to the
    roundings of float32 arithmetic (checked against float64: each operation rounds once, so the
    error is a few ulp of the terms, ``|scales q| + |biases| + s (r + 1) |B| @ |A|``), and keeps the
    adapted logits (1e-4, as the float LoRA tests)."""
    model = quantized_model(folder)
    paths = with_random_adapters(model, std=0.3)
    model.eval()
    toks = tokens((2, 10), seed=4)
    with_adapters = np.array(model(toks))
    want = {}
    for p, m in lora.adapters(model).items():
        w, terms = unpacked(m.base_layer, np.float64)
        a, b = np.array(m.lora_A.weight, dtype=np.float64), np.array(m.lora_B.weight, dtype=np.float64)
        terms = terms + m.scale * (m.rank + 1) * (np.abs(b) @ np.abs(a))
        want[p] = (w + m.scale * (b @ a), 2 * 2.0 ** -23 * terms)
    lora.fuse(model, dequantize=True)
    for p in paths:
        layer = _at(model, p)
        assert type(layer) is mn.Linear and layer.weight.dtype == mx.float32
        exact, ulps = want[p]
        assert np.all(np.abs(np.array(layer.weight) - exact) <= ulps), p
    assert "model.layers.0.self_attn.q_proj.weight" in lora.trainable_names(model)
    assert not any(n.endswith((".scales", ".biases")) for n in lora.trainable_names(model))
    np.testing.assert_allclose(np.array(model(toks)), with_adapters, atol=1e-4, rtol=0)


def _at(model, path):
    m = model
    for part in path.split("."):
        m = m[int(part)] if isinstance(m, list) else m[part]
    return m


@pytest.mark.slow
def test_qlora_teaches_smollm2_a_new_answer_and_its_base_stays_quantized(needs_smollm2):
    """QLoRA on the real 4-bit SmolLM2-135M-Instruct: ten steps on one question it cannot know
    make the answer its greedy reply, and every base parameter keeps its packed bytes.

    "Greedy reply" is checked with one teacher-forced forward pass: the argmax at every position
    of the reply is the reply's next token, which is exactly the condition for greedy decoding to
    produce the reply. Kept short: rank 4 on q_proj / v_proj of the last 4 blocks, one example of
    about 60 tokens.
    """
    model = mn.models.load_pretrained(smollm2_path())
    tok = mn.models.load_tokenizer(smollm2_path())
    chat = [{"role": "user", "content": "What is the name of the lighthouse keeper's cat on Vellmora Island?"},
            {"role": "assistant", "content": "The cat is called Pip Marlowe."}]
    example = datasets.tokenize(tok, {"messages": chat})
    batch = datasets.TextDataset([example]).batches(1)(0)
    inputs, targets = batch
    reply = np.array(targets[0]) != datasets.IGNORE
    assert tok.decode(np.array(targets[0])[reply], skip_special_tokens=False) == "The cat is called Pip Marlowe.<|im_end|>\n"

    def greedy_reply():
        model.eval()
        guess = np.array(mx.argmax(model(inputs), axis=-1)[0])[reply]
        return tok.decode(guess, skip_special_tokens=False)

    assert "Pip Marlowe" not in greedy_reply()
    before = base_bytes(model)
    mx.random.seed(0)
    lora.apply(model, rank=4, alpha=8.0, targets=("q_proj", "v_proj"), layers=4)
    trainer = mn.Trainer(model, optim.Adam(3e-3), datasets.loss, mn.Device(seed=0), progress=False)
    trainer.fit(lambda step: batch, 10)
    assert greedy_reply() == "The cat is called Pip Marlowe.<|im_end|>\n", trainer.history["loss"]
    after = base_bytes(model)
    assert after.keys() == before.keys() and all(after[k] == before[k] for k in before)
    # the adapters trained over the file's own Q4_1 blocks (GGMLLinear), which stayed as they were
    assert all(isinstance(m.base_layer, mn.GGMLLinear) and m.base_layer.ggml_type == "Q4_1"
               for m in lora.adapters(model).values())

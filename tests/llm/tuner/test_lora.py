"""LoRA adapters against PEFT on a tiny Llama that transformers builds.

Tolerance: float32 logits of a 2-block, width-64 model: 1e-4 absolute (the same as the model tests).
"""

import json

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
from metalnn.llm.tuner import lora

transformers.logging.set_verbosity_error()
ATOL = 1e-4
CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG, initializer_range=0.1)).eval()
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


def fresh_hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, CONFIG["vocab_size"], size=shape)


def torch_logits(model, toks):
    with torch.no_grad():
        return model(torch.tensor(toks)).logits.numpy()


def lm_loss(model, batch, device):
    return mn.losses.cross_entropy(model(batch[:, :-1], device=device), batch[:, 1:])


def trained_adapters(folder, steps=12, **kw):
    mx.random.seed(0)  # adapters draw A from MLX's global random state, as mlx.nn layers do
    model = mn.models.load_pretrained(folder)
    before = {k: np.array(v) for k, v in model.named_parameters().items()}
    paths = lora.apply(model, rank=4, alpha=8.0, **kw)
    data = mx.array(tokens((4, 17), seed=1))
    trainer = mn.Trainer(model, optim.Adam(2e-2), lm_loss, mn.Device(seed=0), progress=False)
    trainer.fit(lambda s: data, steps)
    return model, paths, before, trainer.history["loss"]


def test_only_adapters_train_and_the_base_never_changes(base):
    model, paths, before, losses = trained_adapters(base)
    assert paths == [f"model.layers.{i}.self_attn.{p}" for i in range(3) for p in ("q_proj", "v_proj")]
    trainable = lora.trainable_names(model)
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert losses[-1] < 0.9 * losses[0], losses
    for name, value in model.named_parameters().items():
        if ".lora_" in name:
            continue
        original = name.replace(".base_layer.", ".")
        np.testing.assert_array_equal(np.array(value), before[original], err_msg=name)  # bit-identical


def test_saved_adapters_load_in_peft_with_the_same_logits(base, tmp_path):
    model, _, _, _ = trained_adapters(base)
    model.eval()
    lora.save_adapters(model, tmp_path, base_model_name_or_path=str(base))
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", 4, 8.0)
    assert sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]
    peft_model = peft.PeftModel.from_pretrained(fresh_hf(base), tmp_path).eval()
    toks = tokens((2, 11), seed=2)
    ours = np.array(model(mx.array(toks)))
    np.testing.assert_allclose(ours, torch_logits(peft_model, toks), atol=ATOL, rtol=0)
    # the adapters are not a no-op: the base model alone differs
    assert np.abs(ours - torch_logits(fresh_hf(base), toks)).max() > 10 * ATOL


def test_peft_trained_adapters_load_here(base, tmp_path):
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "o_proj"], lora_dropout=0.0)
    peft_model = peft.get_peft_model(fresh_hf(base), config)
    with torch.no_grad():  # a trained adapter has non-zero B
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    peft_model.eval().save_pretrained(tmp_path)
    model = mn.models.load_pretrained(base)
    loaded = lora.load_adapters(model, tmp_path)
    assert len(loaded) == 9
    toks = tokens((2, 9), seed=4)
    np.testing.assert_allclose(np.array(model(mx.array(toks))), torch_logits(peft_model, toks), atol=ATOL, rtol=0)


def test_fuse_keeps_the_logits_and_removes_the_adapters(base):
    model, _, _, _ = trained_adapters(base, steps=6)
    model.eval()
    toks = mx.array(tokens((2, 10), seed=5))
    with_adapters = np.array(model(toks))
    fused = lora.fuse(model)
    assert len(fused) == 6 and not lora.adapters(model)
    assert not any(".lora_" in n or ".base_layer." in n for n in model.named_parameters())
    np.testing.assert_allclose(np.array(model(toks)), with_adapters, atol=ATOL, rtol=0)
    # the fused model is a plain Llama again: it saves for transformers with the same logits
    assert set(model.named_parameters()) == set(fresh_model_names(model))


def fresh_model_names(model):
    return mn.models.from_config(model.config).named_parameters()


def test_last_layers_only_and_peft_reads_the_restriction(base, tmp_path):
    model, paths, _, _ = trained_adapters(base, steps=3, targets=("q_proj",), layers=1)
    assert paths == ["model.layers.2.self_attn.q_proj"]
    lora.save_adapters(model, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["layers_to_transform"] == [2]
    peft_model = peft.PeftModel.from_pretrained(fresh_hf(base), tmp_path).eval()
    toks = tokens((1, 7), seed=6)
    model.eval()
    np.testing.assert_allclose(np.array(model(mx.array(toks))), torch_logits(peft_model, toks), atol=ATOL, rtol=0)


def test_bad_adapter_folders_are_reported_and_change_nothing(base, tmp_path):
    model, _, _, _ = trained_adapters(base, steps=2)
    lora.save_adapters(model, tmp_path)
    other = mn.models.load_pretrained(base)
    lora.apply(other, rank=2, alpha=4.0)  # another rank: every tensor misshaped
    before = {k: np.array(v) for k, v in other.named_parameters().items()}
    with pytest.raises(mn.WeightLoadError, match="mismatched"):
        lora.load_adapters(other, tmp_path)
    for k, v in other.named_parameters().items():
        np.testing.assert_array_equal(np.array(v), before[k])
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        lora.load_adapters(other, tmp_path / "nothing")
    with pytest.raises(ValueError, match="no Linear"):
        lora.apply(mn.models.load_pretrained(base), targets=("nonexistent",))


def test_adapters_disabled_gives_the_base_models_logits_inside_a_gradient(base):
    """The reference model of preference training: the trained adapters switched off give the
    untouched base's logits (bit for bit), also inside ``value_and_grad`` next to the adapted pass,
    whose gradient is unchanged by the reference pass; the switch is restored afterwards."""
    model, _, _, _ = trained_adapters(base, steps=3)
    plain = mn.models.load_pretrained(base)
    toks = mx.array(tokens((2, 9), seed=4))
    with lora.adapters_disabled(model):
        np.testing.assert_array_equal(np.array(model(toks)), np.array(plain(toks)))
    assert np.abs(np.array(model(toks)) - np.array(plain(toks))).max() > 1e-4  # the adapters are back

    def loss(m, t):
        with lora.adapters_disabled(m):
            ref = mx.stop_gradient(m(t))
        return ((m(t) - ref) ** 2).mean()

    def adapted_only(m, t):
        return ((m(t) - mx.array(np.array(plain(t)))) ** 2).mean()

    got_loss, got = nn.value_and_grad(model, lambda t: loss(model, t))(toks)
    want_loss, want = nn.value_and_grad(model, lambda t: adapted_only(model, t))(toks)
    assert abs(got_loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
    got, want = dict(tree_flatten(got)), dict(tree_flatten(want))
    for name in lora.trainable_names(model):
        np.testing.assert_allclose(np.array(got[name]), np.array(want[name]), rtol=1e-5, atol=1e-9, err_msg=name)

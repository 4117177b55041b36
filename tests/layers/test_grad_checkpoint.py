"""Gradient checkpointing: the same gradients as keeping every activation, for less peak memory."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import metalnn as mn
from memory import peak_above_active


def tiny_llama(seed=0):
    cfg = mn.models.llama_config(vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=256)
    return mn.models.from_config(cfg, seed=seed)


def grads_and_peak(model, tokens):
    def loss(m):
        logits = m(tokens[:, :-1])
        return mn.losses.cross_entropy(logits, tokens[:, 1:])

    mx.eval(model.parameters())
    out = []

    def run():
        out.extend(nn.value_and_grad(model, loss)(model))
        mx.eval(out)

    peak = peak_above_active(run)
    value, grads = out
    return value.item(), dict(tree_flatten(grads)), peak


def test_same_gradients_and_less_memory_on_a_long_sequence():
    tokens = mx.array(np.random.default_rng(0).integers(0, 64, size=(2, 513)))
    model = tiny_llama()
    loss_a, ga, peak_a = grads_and_peak(model, tokens)
    assert mn.checkpoint_blocks(model) == 4
    loss_b, gb, peak_b = grads_and_peak(model, tokens)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert ga.keys() == gb.keys() and len(ga) > 20
    for name in ga:  # the recomputation repeats the same float32 operations: 1e-5
        np.testing.assert_allclose(np.array(gb[name]), np.array(ga[name]), atol=1e-5, err_msg=name)
    # attention scores alone are 2 x 4 heads x 512^2 floats (8 MiB) per block; keeping one block's
    # activations instead of four must show
    assert peak_b < 0.75 * peak_a, (peak_a, peak_b)


def test_recomputation_draws_the_same_dropout_masks():
    """d/dx sum(dropout(x)) is the mask (scaled): it must equal the forward's output at x = 1."""
    block = mn.Layers(mn.Dropout(0.5))
    block.is_block = True
    model = mn.Layers(block)
    assert mn.checkpoint_blocks(model) == 1
    x = mx.ones((4, 64))
    device = mn.Device(seed=3)
    out, g = mx.value_and_grad(lambda v: model(v, device=device).sum())(x)
    fwd = model(x, device=mn.Device(seed=3))
    np.testing.assert_array_equal(np.array(g), np.array(fwd))
    assert 0 < float((fwd == 0).mean()) < 1


def test_trainer_option_needs_blocks():
    import mlx.optimizers as optim

    with pytest.raises(ValueError, match="no blocks"):
        mn.Trainer(mn.Layers(mn.Linear(2)), optim.SGD(0.1), lambda m, b, d: m(b).sum(), grad_checkpoint=True)
    model = tiny_llama()
    mn.Trainer(model, optim.SGD(0.1), lambda m, b, d: m(b).sum(), grad_checkpoint=True)
    assert all(layer.grad_checkpoint for layer in model.model.layers)


def test_compiled_training_steps_are_unchanged():
    import mlx.optimizers as optim

    tokens = mx.array(np.random.default_rng(1).integers(0, 64, size=(2, 33)))

    def loss_fn(m, b, d):
        return mn.losses.cross_entropy(m(b[:, :-1], device=d), b[:, 1:])

    histories = []
    for flag in (False, True):
        trainer = mn.Trainer(tiny_llama(), optim.Adam(1e-2), loss_fn, mn.Device(seed=0), progress=False,
                             grad_checkpoint=flag)
        histories.append(trainer.fit(lambda s: tokens, 4)["loss"])
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-5)


def _compiled_qlora_peak(layers):
    """Peak memory above the weights of two compiled, checkpointed QLoRA steps of a 4-bit tiny Llama."""
    import mlx.optimizers as optim

    from metalnn.llm.tuner import lora

    cfg = mn.models.llama_config(vocab_size=64, hidden_size=256, num_hidden_layers=layers, num_attention_heads=4,
                                 num_key_value_heads=4, intermediate_size=1024)
    model = mn.models.from_config(cfg, seed=0)
    mn.quantize(model, bits=4, group_size=64)
    lora.apply(model, rank=4, targets=("q_proj", "v_proj"))
    tokens = mx.array(np.random.default_rng(0).integers(0, 64, size=(2, 129)))

    def loss_fn(m, b, d):
        return mn.losses.cross_entropy(m(b[:, :-1], device=d), b[:, 1:])

    trainer = mn.Trainer(model, optim.Adam(1e-3), loss_fn, mn.Device(seed=0), progress=False, grad_checkpoint=True)
    trainer.step(tokens)  # builds, compiles
    return peak_above_active(lambda: trainer.step(tokens))


def test_compiled_checkpointing_keeps_only_the_block_inputs_of_a_quantized_model():
    """Under mx.compile, a recomputed block must not share values with the forward pass (a merged
    dequantized weight would stay alive until the backward). Each extra block may add its input
    (2 x 128 x 256 float32: 0.25 MiB) and the small values of its recomputation (0.5-0.8 MiB per
    block measured, idle and beside two busy processes), far below its dequantized weights
    (4 x 256^2 + 3 x 256 x 1024 floats: 4 MiB) that a merge would keep: the bound is half of those."""
    per_block = (_compiled_qlora_peak(10) - _compiled_qlora_peak(2)) / 8
    assert per_block < 2.0 * 2**20, per_block / 2**20

"""Whole models running their Metal code through the emulator: a tiny Llama (RMSNorm, RoPE and
fused-attention kernels, forward and backward) and a tiny CNN (conv kernels) give the same logits
and gradients as the reference path.

Tolerance 1e-4: float32 kernels that sum in a different order than MLX, through two layers.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

import metalnn as mn

from kernel_cases import emulate, reference, spy_launches

ATOL = 1e-4


def tiny_llama():
    cfg = mn.models.llama_config(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)
    return mn.models.from_config(cfg, seed=0)


def loss(model, tokens, device):
    logits = model(tokens, device=device)
    return mn.losses.cross_entropy(logits[:, :-1], tokens[:, 1:])


def test_llama_forward_and_gradients_on_emulated_kernels(monkeypatch):
    launches = spy_launches(monkeypatch)
    model = tiny_llama()
    tokens = mx.array(np.random.default_rng(0).integers(0, 40, (2, 9)))
    ref_dev, emu_dev = reference(), emulate()
    ref_logits = model(tokens, device=ref_dev)
    assert not launches
    emu_logits = model(tokens, device=emu_dev)
    assert launches.names() == {"rms_norm_forward", "rope", "attention_forward"}
    np.testing.assert_allclose(np.array(emu_logits), np.array(ref_logits), atol=ATOL)
    launches.clear()
    g_ref = nn.value_and_grad(model, lambda t: loss(model, t, ref_dev))(tokens)[1]
    assert not launches
    g_emu = nn.value_and_grad(model, lambda t: loss(model, t, emu_dev))(tokens)[1]
    ref, emu = dict(tree_flatten(g_ref)), dict(tree_flatten(g_emu))
    assert ref.keys() == emu.keys() and len(ref) > 10
    for name in ref:
        np.testing.assert_allclose(np.array(emu[name]), np.array(ref[name]), atol=ATOL, err_msg=name)
    assert {"rms_norm_backward_dx", "rms_norm_backward_dw", "attention_backward_dq", "attention_backward_dkv"} \
        <= launches.names()


def test_trainer_on_emulated_kernels_matches_reference(monkeypatch):
    """Two optimisation steps of a small CNN on the emulated conv kernels equal the reference run."""
    import mlx.optimizers as optim

    launches = spy_launches(monkeypatch)

    x = mx.array(np.random.default_rng(1).normal(size=(4, 1, 6, 6)).astype(np.float32))
    y = mx.array([0, 1, 2, 1])

    def run(kernels):
        device = mn.Device(kernels=kernels, seed=0)
        with mn.init.seeded(0):  # the conv is built at construction: the same weights in both runs
            model = mn.Layers([mn.Conv2D(3, 3, padding=1, in_channels=1), mn.ReLU(), mn.Flatten(channels=3),
                               mn.Linear(3)])

        def loss_fn(m, batch, d):
            xb, yb = batch
            out = m.compile(d, mn.Data.from_nchw(xb)).array.reshape(xb.shape[0], -1)
            return mn.losses.cross_entropy(out, yb)

        trainer = mn.Trainer(model, optim.SGD(0.1), loss_fn, device, progress=False)
        assert trainer.use_compile == (kernels != "emulate")
        trainer.fit(lambda s: (x, y), 2)
        return trainer.history["loss"], model.for_update()

    ref_loss, ref_params = run("reference")
    assert not launches
    emu_loss, emu_params = run("emulate")
    assert launches.names() == {"conv2d_forward", "conv2d_dgrad", "conv2d_wgrad"}
    np.testing.assert_allclose(emu_loss, ref_loss, atol=ATOL)
    for k in ref_params:
        np.testing.assert_allclose(np.array(emu_params[k]), np.array(ref_params[k]), atol=ATOL, err_msg=k)

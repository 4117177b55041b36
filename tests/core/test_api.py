"""The API as an mlx.nn user meets it: every call either does what mlx.nn would or raises.

Each test is a call an mlx.nn user would naturally write, checked against mlx.nn itself (or torch)
where there is an equivalent.
"""

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
import torch

import metalnn as mn


# -- constructors -------------------------------------------------------------------------------
def test_norms_take_their_width_first_as_mlx_nn():
    for cls, ref in ((mn.RMSNorm, nn.RMSNorm), (mn.LayerNorm, nn.LayerNorm)):
        layer = cls(512)
        assert layer.eps == ref(512).eps == 1e-5
        assert layer.weight.shape == (512,)
        x = mx.array(np.random.default_rng(0).normal(size=(3, 512)).astype(np.float32))
        np.testing.assert_allclose(np.array(layer(x)), np.array(ref(512)(x)), atol=1e-5)
        with pytest.raises(TypeError, match=rf"{cls.__name__}\(512, eps=1e-06\)"):
            cls(512, 1e-6)


def test_linear_with_mlx_nn_argument_order_is_refused_with_the_right_call():
    with pytest.raises(TypeError, match=r"Linear\(128, in_features=64\) for mlx.nn's Linear\(64, 128\)"):
        mn.Linear(64, 128)
    with pytest.raises(TypeError, match=r"Conv2D\(16, 3, in_channels=3\)"):
        mn.Conv2D(3, 16, 3)
    with pytest.raises(TypeError, match=r"LSTM\(32\)"):
        mn.LSTM(8, 32)
    # the same layer as mlx.nn's, written metalnn's way
    ours = mn.Linear(128, in_features=64)
    ref = nn.Linear(64, 128)
    ref.update(ours.parameters())
    x = mx.ones((2, 64))
    np.testing.assert_array_equal(np.array(ours(x)), np.array(ref(x)))


def test_layers_built_at_construction_get_distinct_weights_like_mlx_nn():
    a, b = mn.Linear(8, in_features=4), mn.Linear(8, in_features=4)
    assert not np.array_equal(np.array(a.weight), np.array(b.weight))
    mx.random.seed(3)
    c = mn.Linear(8, in_features=4)
    mx.random.seed(3)
    d = mn.Linear(8, in_features=4)
    np.testing.assert_array_equal(np.array(c.weight), np.array(d.weight))  # mx.random.seed decides them


def test_one_device_seed_gives_every_layer_its_own_key():
    def build(seed):
        model = mn.Layers(mn.Linear(6), mn.Linear(6), mn.Linear(6))
        model(mx.zeros((1, 6)), device=mn.Device(seed=seed))
        return [np.array(layer.weight) for layer in model.layers]

    w, again, other = build(1), build(1), build(2)
    assert not np.array_equal(w[1], w[2])                 # distinct keys inside one model
    for a, b in zip(w, again):
        np.testing.assert_array_equal(a, b)               # the same seed, the same model
    assert not np.array_equal(w[0], other[0])


def test_default_initialisation_matches_mlx_nn_families():
    lin = np.array(mn.Linear(256, in_features=64).weight)
    assert abs(lin.std() - (1 / 8) / math.sqrt(3)) < 0.01 and np.abs(lin).max() <= 1 / 8  # U(+-1/sqrt(64))
    emb = np.array(mn.Embedding(1000, 64).weight)
    assert abs(emb.std() - 1 / 8) < 0.01                                                   # N(0, 1/dims)
    lstm = mn.LSTM(16)
    lstm(mx.zeros((1, 2, 4)))
    assert np.abs(np.array(lstm.weight_hh)).max() <= 0.25                                  # U(+-1/sqrt(hidden))


def test_mlx_nn_init_functions_are_accepted():
    layer = mn.Linear(5, in_features=3, init=nn.init.constant(0.25), bias_init=nn.init.constant(-1.0))
    np.testing.assert_array_equal(np.array(layer.weight), np.full((5, 3), 0.25, np.float32))
    np.testing.assert_array_equal(np.array(layer.bias), np.full((5,), -1.0, np.float32))
    with pytest.raises(ValueError, match="returned shape"):
        mn.Linear(5, in_features=3, init=lambda a: mx.zeros((2,)))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_dtype_is_honoured_everywhere(dtype):
    layers = [mn.Linear(4, dtype=dtype), mn.RMSNorm(dtype=dtype), mn.LSTM(4, dtype=dtype), mn.GRU(4, dtype=dtype),
              mn.RNN(4, dtype=dtype), mn.Conv1D(4, 3, dtype=dtype), mn.SwiGLU(8, dtype=dtype)]
    for layer in layers:
        x = mx.zeros((2, 5, 3), dtype=dtype)
        y = layer(x)
        assert {v.dtype for v in layer.named_parameters().values()} == {dtype}, type(layer).__name__
        assert y.dtype == dtype, type(layer).__name__


# -- one batch rule ------------------------------------------------------------------------------
def test_plain_arrays_are_batch_first_and_nothing_is_guessed():
    x = mx.arange(24, dtype=mx.float32).reshape(4, 6)
    assert mn.Data(x).dims == mn.MTLSize(6, 1, 4)                       # the batch is D
    np.testing.assert_array_equal(np.array(mn.Flatten()(x)), np.array(x))  # [4, 6] stays 4 samples
    assert mn.Flatten()(mx.zeros((4, 2, 3))).shape == (4, 6)
    assert mn.Linear(3)(mx.zeros((2, 1, 6))).shape == (2, 1, 3)         # a length-1 sequence stays one
    assert mn.Linear(3)(mx.zeros((6,))).shape == (3,)
    # as mlx.nn: Embedding adds a feature axis, conv and pooling keep channels-last images
    assert mn.Embedding(10, 4)(mx.array([[1, 2, 3], [4, 5, 6]])).shape == (2, 3, 4)
    assert mn.Conv2D(5, 3, padding=1)(mx.zeros((2, 7, 9, 3))).shape == (2, 7, 9, 5)
    assert mn.MaxPool2D(2)(mx.zeros((2, 8, 6, 3))).shape == (2, 4, 3, 3)
    cnn = mn.Layers(mn.Conv2D(4, 3), mn.ReLU(), mn.GlobalAvgPool(channels=4), mn.Linear(10))
    assert cnn(mx.zeros((5, 8, 8, 2))).shape == (5, 10)


def test_conv_on_channels_last_arrays_equals_mx_conv2d():
    rng = np.random.default_rng(0)
    x = mx.array(rng.normal(size=(2, 9, 7, 3)).astype(np.float32))
    layer = mn.Conv2D(5, 3, stride=2, padding=1)
    y = layer(x)
    w = mx.transpose(layer.weight, (0, 2, 3, 1))  # torch layout -> MLX's [out, kh, kw, in]
    ref = mx.conv2d(x, w, stride=2, padding=1) + layer.bias
    np.testing.assert_allclose(np.array(y), np.array(ref), atol=1e-5)
    # and through planar Data, the same numbers
    planar = layer.compile(None, mn.Data.from_nhwc(x))
    np.testing.assert_allclose(np.array(planar.to_nhwc(5)), np.array(ref), atol=1e-5)


# -- modes and calls -----------------------------------------------------------------------------
def test_train_and_eval_control_dropout_in_a_plain_mlx_loop():
    model = mn.Layers(mn.Linear(32), mn.Dropout(0.5), mn.Linear(1))
    x, y = mx.ones((16, 8)), mx.zeros((16, 1))
    model(x)
    assert model.training  # mlx.nn modules start in training mode
    loss_and_grad = nn.value_and_grad(model, lambda a, b: mx.mean((model(a) - b) ** 2))
    opt = optim.SGD(0.01)
    loss_a, _ = loss_and_grad(x, y)
    loss_b, grads = loss_and_grad(x, y)
    assert loss_a.item() != loss_b.item()      # a fresh dropout mask each step
    opt.update(model, grads)
    model.eval()
    assert not model.layers[1].training
    out1, out2 = model(x), model(x)
    np.testing.assert_array_equal(np.array(out1), np.array(out2))
    np.testing.assert_allclose(np.array(out1[0]), np.array(out1[1]))  # identical rows, no mask


def test_options_on_calls_are_keywords():
    layer = mn.Linear(3)
    with pytest.raises(TypeError, match="device="):
        layer(mx.zeros((2, 4)), mn.Device())
    model = mn.models.from_config(mn.models.llama_config(vocab_size=11, hidden_size=16, num_hidden_layers=1,
                                                         num_attention_heads=2))
    with pytest.raises(TypeError, match="cache="):
        model(mx.array([[1, 2]]), model.make_cache())
    assert model(mx.array([[1, 2]]), cache=model.make_cache()).shape == (1, 2, 11)


def test_gelu_means_the_exact_form_everywhere():
    exact = torch.nn.functional.gelu(torch.tensor([1.0])).item()          # 0.841345
    x = mx.array([[1.0]])
    for layer in (mn.GELU(), mn.activation("gelu")):
        assert abs(layer(x).item() - exact) < 1e-6
    assert abs(nn.GELU()(x).item() - exact) < 1e-6
    mlp = mn.MLP(1, activation="gelu", hidden_dims=1, init="ones", init_out="ones")
    assert abs(mlp(x).item() - exact) < 1e-6
    tanh = torch.nn.functional.gelu(torch.tensor([1.0]), approximate="tanh").item()  # 0.841192
    for layer in (mn.GELU(approx="tanh"), mn.activation("gelu_approx"), mn.activation("gelu_tanh")):
        assert abs(layer(x).item() - tanh) < 1e-6


# -- one way to do each thing --------------------------------------------------------------------
def test_composite_layers_are_made_of_layers():
    gdn = mn.GatedDeltaNet(2, head_k_dim=8, conv_kernel=4)
    gdn(mx.zeros((1, 3, 16)))
    assert isinstance(gdn.conv1d, mn.Conv1D) and gdn.conv1d.groups == gdn.conv_dim
    assert isinstance(gdn.norm, mn.GatedRMSNorm)
    assert set(gdn.named_parameters()) >= {"conv1d.weight", "norm.weight", "A_log", "dt_bias"}
    assert not hasattr(mn, "SwiGluFfn") and not hasattr(mn, "Embeddings")
    assert mn.Sequential is mn.Layers
    seq = mn.Sequential(mn.Linear(3), mn.ReLU())      # mlx.nn's varargs form
    assert len(seq.layers) == 2


def test_trainer_resume_goes_through_the_one_strict_loader(tmp_path):
    def loss_fn(model, batch, device):
        return mx.mean(model(batch, device=device) ** 2)

    model = mn.Layers(mn.Linear(3))
    trainer = mn.Trainer(model, optim.SGD(0.1), loss_fn, mn.Device(), progress=False, checkpoint_dir=tmp_path)
    trainer.fit(lambda s: mx.ones((2, 4)), 1)
    other = mn.Layers(mn.Linear(5))                    # another shape: nothing may be loaded
    other(mx.ones((2, 4)))
    before = np.array(other.layers[0].weight)
    with pytest.raises(mn.WeightLoadError, match="mismatched"):
        mn.Trainer(other, optim.SGD(0.1), loss_fn, mn.Device(), progress=False).resume(tmp_path)
    np.testing.assert_array_equal(np.array(other.layers[0].weight), before)


def test_reference_devices_run_plain_activation_formulas(monkeypatch):
    """"reference" means plain MLX ops for activations too; other choices use the fast primitives
    (for a gated MLP on the CPU: the fused gate-and-product primitive of metalnn.cpu.fused)."""
    import metalnn.functional.activations as act
    from metalnn.cpu import fused

    calls = []
    monkeypatch.setitem(act.FAST, "silu", lambda x: calls.append("fast") or act.PLAIN["silu"](x))
    real_gated = fused.gated
    monkeypatch.setattr(fused, "gated", lambda *a, **k: calls.append("fused") or real_gated(*a, **k))
    layer = mn.SwiGLU(8)
    x = mx.ones((2, 4))
    ref = layer(x, device=mn.Device(kernels="reference"))
    assert calls == []
    fast = layer(x, device=mn.Device(kernels="auto"))
    assert calls == (["fused"] if fused.available() else ["fast"])
    np.testing.assert_allclose(np.array(fast), np.array(ref), atol=1e-6)

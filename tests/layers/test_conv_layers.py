"""Conv layers (planar Data and channels-last arrays) vs torch.nn.Conv*d with copied weights, on the
"reference" and "auto" implementations; dims, init, errors; the demo."""

import numpy as np
import pytest
import torch

import metalnn as mn
import mlx.core as mx
from metalnn.errors import ShapeError


@pytest.fixture(params=["reference", "auto"])
def device(request):
    return mn.Device(kernels=request.param, seed=0)


def _copy(layer, tlayer):
    layer.weight = mx.array(tlayer.weight.detach().numpy())
    if layer.use_bias:
        layer.bias = mx.array(tlayer.bias.detach().numpy())


def test_conv2d_layer_matches_torch_and_dims(device, rng):
    x = rng.standard_normal((3, 4, 9, 7)).astype(np.float32)
    layer = mn.Conv2D(6, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2), groups=2, in_channels=4)
    out = layer.compile(device, mn.Data.from_nchw(mx.array(x)))  # builds the params
    assert layer.weight.shape == (6, 2, 3, 2) and layer.bias.shape == (6,)
    ref = torch.nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
    _copy(layer, ref)
    out = layer.compile(device, mn.Data.from_nchw(mx.array(x)))
    yt = ref(torch.tensor(x)).detach().numpy()
    assert out.dims == mn.MTLSize(yt.shape[3], yt.shape[2], 3 * 6)
    np.testing.assert_allclose(np.array(out.to_nchw(6)), yt, atol=1e-4, rtol=1e-4)


def test_conv_transposed2d_layer_matches_torch(device, rng):
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    layer = mn.ConvTransposed2D(4, 3, stride=2, padding=1, output_padding=1, in_channels=3)
    layer.compile(device, mn.Data.from_nchw(mx.array(x)))
    assert layer.weight.shape == (3, 4, 3, 3)
    ref = torch.nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1)
    _copy(layer, ref)
    out = layer.compile(device, mn.Data.from_nchw(mx.array(x)))
    yt = ref(torch.tensor(x)).detach().numpy()
    assert out.dims == mn.MTLSize(10, 8, 2 * 4)
    np.testing.assert_allclose(np.array(out.to_nchw(4)), yt, atol=1e-4, rtol=1e-4)


def test_conv1d_and_conv3d_layers(device, rng):
    x1 = rng.standard_normal((2, 3, 10)).astype(np.float32)
    l1 = mn.Conv1D(5, 3, stride=2, padding=1, in_channels=3)
    d1 = mn.Data(mx.array(x1.reshape(6, 1, 10)), (10, 1, 6))
    l1.compile(device, d1)
    r1 = torch.nn.Conv1d(3, 5, 3, stride=2, padding=1)
    _copy(l1, r1)
    o1 = l1.compile(device, d1)
    y1 = r1(torch.tensor(x1)).detach().numpy()
    assert o1.dims == mn.MTLSize(5, 1, 10)
    np.testing.assert_allclose(np.array(o1.array).reshape(y1.shape), y1, atol=1e-4, rtol=1e-4)

    x3 = rng.standard_normal((2, 2, 5, 6, 4)).astype(np.float32)  # N, C, depth, H, W
    l3 = mn.Conv3D(3, 3, padding=(0, 1, 1), in_channels=2, depth=5)
    d3 = mn.Data(mx.array(x3.reshape(2 * 2 * 5, 6, 4)), (4, 6, 20))
    l3.compile(device, d3)
    r3 = torch.nn.Conv3d(2, 3, 3, padding=(0, 1, 1))
    _copy(l3, r3)
    o3 = l3.compile(device, d3)
    y3 = r3(torch.tensor(x3)).detach().numpy()
    assert l3.out_depth(5) == 3
    assert o3.dims == mn.MTLSize(4, 6, 2 * 3 * 3)
    np.testing.assert_allclose(np.array(o3.array).reshape(y3.shape), y3, atol=1e-4, rtol=1e-4)


def test_conv_layer_gradients_match_torch(device, rng):
    x = rng.standard_normal((2, 3, 6, 5)).astype(np.float32)
    layer = mn.Conv2D(4, 3, padding=1, in_channels=3)
    layer.build_for((5, 6, 6), device=device)
    ref = torch.nn.Conv2d(3, 4, 3, padding=1)
    _copy(layer, ref)
    import mlx.nn as nn

    loss = lambda m, xx: (m.compile(device, mn.Data.from_nchw(xx)).array ** 2).sum()  # noqa: E731
    _, grads = nn.value_and_grad(layer, loss)(layer, mx.array(x))
    (ref(torch.tensor(x)) ** 2).sum().backward()
    np.testing.assert_allclose(np.array(grads["weight"]), ref.weight.grad.numpy(), atol=1e-3, rtol=1e-4)
    np.testing.assert_allclose(np.array(grads["bias"]), ref.bias.grad.numpy(), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("transposed", [False, True])
def test_channels_last_arrays_match_torch_with_gradients(device, rng, transposed):
    """The array call (channels-last in and out) and the gradients in input, weight and bias."""
    x = rng.standard_normal((2, 7, 6, 3)).astype(np.float32)  # N, H, W, C
    if transposed:
        layer = mn.ConvTransposed2D(4, 3, stride=2, padding=1, output_padding=1)
        ref = torch.nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1)
    else:
        layer = mn.Conv2D(4, 3, stride=(2, 1), padding=1, groups=1)
        ref = torch.nn.Conv2d(3, 4, 3, stride=(2, 1), padding=1)
    layer(mx.array(x), device=device)
    _copy(layer, ref)
    import mlx.nn as nn

    g = rng.standard_normal(tuple(ref(torch.zeros(1, 3, 7, 6)).permute(0, 2, 3, 1).shape[1:])).astype(np.float32)

    def loss(m, xx):
        return (m(xx, device=device) * mx.array(g)).sum()

    xm = mx.array(x)
    value, grads = nn.value_and_grad(layer, loss)(layer, xm)
    dx = mx.grad(lambda xx: loss(layer, xx))(xm)
    tx = torch.tensor(x, requires_grad=True)
    ty = ref(tx.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    (ty * torch.tensor(g)).sum().backward()
    np.testing.assert_allclose(np.array(layer(xm, device=device)), ty.detach().numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(dx), tx.grad.numpy(), atol=1e-4, rtol=1e-4)
    # weight/bias gradients sum over N * H * W (<= 168) products of O(1) terms
    np.testing.assert_allclose(np.array(grads["weight"]), ref.weight.grad.numpy(), atol=1e-3, rtol=1e-4)
    np.testing.assert_allclose(np.array(grads["bias"]), ref.bias.grad.numpy(), atol=1e-3, rtol=1e-4)


def test_default_init_is_mlx_nn_like():
    """As mlx.nn.Conv2d: weight U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = in/groups * k*k, bias 0."""
    layer = mn.Conv2D(64, 3, in_channels=32, groups=2)
    bound = 1 / np.sqrt(16 * 9)
    w = np.array(layer.weight)
    # 9216 uniform draws: the extreme is within 1% of the bound, the std within 3% of bound/sqrt(3)
    assert np.abs(w).max() <= bound + 1e-7 and np.abs(w).max() > 0.99 * bound
    assert abs(w.std() - bound / np.sqrt(3)) < 0.03 * bound / np.sqrt(3)
    assert float(mx.abs(layer.bias).max()) == 0.0
    # built at the first compile from the device's key: the same seed gives the same weights
    a, b = mn.Conv2D(8, 3), mn.Conv2D(8, 3)
    for layer in (a, b):
        layer(mx.zeros((1, 5, 5, 4)), device=mn.Device(seed=3))
    np.testing.assert_array_equal(np.array(a.weight), np.array(b.weight))


def test_layer_errors_name_the_layer(device):
    model = mn.Layers([mn.Conv2D(4, 3, in_channels=2), mn.ReLU(), mn.Conv2D(8, 3)])
    with pytest.raises(ShapeError, match=r"layers\.2 \(Conv2D\).*in_channels="):
        model.compile(device, mn.Data(mx.zeros((4, 8, 8))))
    bad = mn.Layers([mn.Conv2D(4, 3, in_channels=3)])
    with pytest.raises(ShapeError, match=r"layers\.0 \(Conv2D\).*D divisible by in_channels=3"):
        bad.compile(device, mn.Data(mx.zeros((4, 8, 8))))
    small = mn.Layers([mn.Conv2D(4, 5, in_channels=1)])
    with pytest.raises(ShapeError, match=r"layers\.0 \(Conv2D\).*output \(-1, -1\)"):
        small.compile(device, mn.Data(mx.zeros((1, 3, 3))))
    with pytest.raises(ValueError, match="Conv2D: out_channels=5 not divisible by groups=2"):
        mn.Conv2D(5, 3, groups=2)


def test_chained_convs_and_pooling_shapes(device):
    model = mn.Layers([
        mn.Conv2D(8, 3, padding=1, in_channels=3), mn.ReLU(), mn.MaxPool2D(2),
        mn.Conv2D(16, 3, stride=2, in_channels=8), mn.ReLU(), mn.GlobalAvgPool(channels=16), mn.Linear(10),
    ])
    out = model.compile(device, mn.Data.from_nchw(mx.zeros((5, 3, 17, 15))))
    assert out.dims == mn.MTLSize(10, 1, 5)
    assert model.layers[3].weight.shape == (16, 8, 3, 3)

"""Initializer statistics. Each draws 256x512 = 131072 samples, so the sample std is within ~0.5%
of the target (std of the estimate ~ 1/sqrt(2n) = 0.2%); we allow 2%."""

import math

import mlx.core as mx
import numpy as np
import pytest

import metalnn as mn
from metalnn import init

SHAPE = (256, 512)  # [out, in]: fan_in 512, fan_out 256


@pytest.mark.parametrize("initializer,std", [
    (init.KaimingNormal(), math.sqrt(2 / 512)),
    (init.KaimingUniform(), math.sqrt(2 / 512)),
    (init.XavierNormal(), math.sqrt(2 / (512 + 256))),
    (init.XavierUniform(), math.sqrt(2 / (512 + 256))),
    (init.Normal(0.02), 0.02),
])
def test_std_matches_formula(initializer, std):
    w = np.array(initializer(SHAPE, key=mx.random.key(0)))
    assert w.shape == SHAPE
    assert abs(w.mean()) < 0.02 * std * 5
    assert abs(w.std() / std - 1) < 0.02


@pytest.mark.parametrize("initializer,bound", [
    (init.KaimingUniform(), math.sqrt(6 / 512)),
    (init.XavierUniform(), math.sqrt(6 / 768)),
])
def test_uniform_bounds(initializer, bound):
    w = np.array(initializer(SHAPE, key=mx.random.key(1)))
    assert w.max() <= bound and w.min() >= -bound
    assert w.max() > 0.99 * bound and w.min() < -0.99 * bound


def test_constants_and_fixed():
    assert np.all(np.array(init.zeros((3, 4))) == 0)
    assert np.all(np.array(init.ones((3,))) == 1)
    np.testing.assert_array_equal(np.array(init.Fixed([[1, 2]])((1, 2))), [[1, 2]])
    with pytest.raises(ValueError, match="expected values of shape"):
        init.Fixed([1, 2, 3])((2, 2))


def test_seeded_and_by_name():
    a = init.get("kaiming_normal")((4, 4), key=mx.random.key(7))
    b = init.get("kaiming_normal")((4, 4), key=mx.random.key(7))
    np.testing.assert_array_equal(np.array(a), np.array(b))
    with pytest.raises(ValueError, match="unknown initializer"):
        init.get("nope")


def test_conv_fans():
    assert init.fans((64, 32, 3, 3)) == (32 * 9, 64 * 9)


def test_layer_uses_its_initializer():
    layer = mn.Linear(4, init=init.Constant(0.5))
    layer.compile(mn.Device(), mn.Data(mx.zeros((1, 3))))
    assert np.all(np.array(layer.weight) == 0.5)

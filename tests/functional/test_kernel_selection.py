"""How a Device's ``kernels`` is chosen and what each choice runs."""

import mlx.core as mx
import pytest

import metalnn as mn
from metalnn import functional as F
from metalnn.kernels import launch, rms_norm as rms_norm_kernels

from kernel_cases import close, emulate, random, reference, spy_launches

NO_METAL = not mx.metal.is_available()


def test_auto_stays_auto_without_the_variable():
    assert mn.Device().kernels == "auto"
    assert mn.Device(kernels="emulate").kernels == "emulate"
    assert mn.Device(kernels="reference").kernels == "reference"


@pytest.mark.parametrize("value", ["auto", "reference", "emulate"] + ([] if NO_METAL else ["metal"]))
def test_variable_resolves_only_auto(value, monkeypatch):
    monkeypatch.setenv("METALNN_KERNELS", value)
    assert mn.Device().kernels == value
    assert mn.Device(kernels="auto").kernels == value
    # an explicit choice wins, so the test helpers get what they ask for
    assert mn.Device(kernels="reference").kernels == "reference"
    assert mn.Device(kernels="emulate").kernels == "emulate"
    assert emulate().kernels == "emulate" and reference().kernels == "reference"


@pytest.mark.parametrize("value", ["auto", "reference", "emulate"])
def test_kernel_checks_hold_whatever_the_variable_says(value, monkeypatch):
    monkeypatch.setenv("METALNN_KERNELS", value)
    launches = spy_launches(monkeypatch)
    x, w = random((3, 40), mx.float32, 1), random((40,), mx.float32, 2)
    got = F.rms_norm(x, w, device=emulate())
    assert launches.names() == {"rms_norm_forward"}
    launches.clear()
    want = F.rms_norm(x, w, device=reference())
    assert not launches
    close(got, want, mx.float32)


def test_variable_picks_the_default_implementation(monkeypatch):
    launches = spy_launches(monkeypatch)
    x = random((2, 16), mx.float32)
    F.rms_norm(x, None, device=mn.Device())
    assert not launches
    monkeypatch.setenv("METALNN_KERNELS", "emulate")
    F.rms_norm(x, None, device=mn.Device())
    assert launches.names() == {"rms_norm_forward"}


def test_bad_choices_are_reported(monkeypatch):
    with pytest.raises(ValueError, match=r"kernels must be one of \('auto', 'reference', 'metal', 'emulate'\), "
                                         r"got 'fast'"):
        mn.Device(kernels="fast")
    monkeypatch.setenv("METALNN_KERNELS", "bogus")
    with pytest.raises(ValueError, match="METALNN_KERNELS must be one of .*got 'bogus'"):
        mn.Device()
    assert mn.Device(kernels="reference").kernels == "reference"


@pytest.mark.skipif(not NO_METAL, reason="checks the errors raised where Metal is missing")
def test_metal_unavailable_is_clear(monkeypatch):
    with pytest.raises(RuntimeError, match="kernels='metal' needs Metal"):
        mn.Device(kernels="metal")
    monkeypatch.setenv("METALNN_KERNELS", "metal")
    with pytest.raises(RuntimeError, match="needs Metal"):
        mn.Device()
    with pytest.raises(RuntimeError, match="kernel rms_norm.rms_norm_forward: backend 'metal' needs Metal"):
        launch.run("rms_norm", "rms_norm_forward", "metal", [mx.ones((1, 4)), mx.ones((4,)), 1e-5, 4], [(1, 4)],
                   [mx.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                   template=[("T", mx.float32), ("WT", mx.float32)])


def test_custom_functions_are_built_once():
    device = emulate()
    x = random((3, 24), mx.float32)
    F.rms_norm(x, None, 1e-5, device=device)
    before = rms_norm_kernels._function.cache_info()
    for rows in (1, 2, 5):                       # other shapes, same static configuration
        F.rms_norm(random((rows, 24), mx.float32), None, 1e-5, device=device)
    after = rms_norm_kernels._function.cache_info()
    assert after.currsize == before.currsize and after.hits == before.hits + 3

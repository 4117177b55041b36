"""F.rope on the emulated Metal kernel and the reference path, against mx.fast.rope."""

import mlx.core as mx
import pytest

from metalnn import functional as F

from kernel_cases import close, emulate, random, reference

CASES = [  # (shape [..., T, D], dims)
    ((1, 1, 8), 8),
    ((3, 5, 31), 30),
    ((2, 2, 7, 33), 32),
    ((1, 3, 64), 48),
    ((1, 1, 4096), 4096),
    ((2, 4, 1, 128), 128),
]


def vjp(fn, x, cot):
    return mx.vjp(fn, [x], [cot])[1][0]


@pytest.mark.parametrize("path", ["emulate", "reference"])
@pytest.mark.parametrize("shape,dims", CASES)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_matches_mlx(path, shape, dims, traditional, dtype):
    device = emulate() if path == "emulate" else reference()
    x = random(shape, dtype, 1)
    cot = random(shape, dtype, 2)
    kw = dict(traditional=traditional, base=10000.0, scale=0.5, offset=3)
    y = F.rope(x, dims, device=device, **kw)
    assert y.dtype == dtype and y.shape == x.shape
    close(y, mx.fast.rope(x, dims, **kw), dtype)
    g = vjp(lambda v: F.rope(v, dims, device=device, **kw), x, cot)
    r = vjp(lambda v: mx.fast.rope(v, dims, **kw), x, cot)
    close(g, r, dtype)


@pytest.mark.parametrize("path", ["emulate", "reference"])
def test_offset_as_array_and_custom_freqs(path):
    device = emulate() if path == "emulate" else reference()
    x = random((2, 5, 16), mx.float32)
    freqs = mx.array([1.0, 2.0, 4.0, 9.0, 20.0, 50.0, 100.0, 1000.0])
    y = F.rope(x, 16, offset=mx.array(7), freqs=freqs, device=device)
    close(y, mx.fast.rope(x, 16, traditional=False, base=None, scale=1.0, offset=7, freqs=freqs), mx.float32)


def test_non_contiguous_input():
    base = random((8, 6, 4), mx.float32)
    x = base.transpose(2, 1, 0)  # (4, 6, 8), not row-contiguous
    for device in (emulate("reversed"), reference()):
        close(F.rope(x, 8, offset=2, device=device), mx.fast.rope(x, 8, traditional=False, base=10000.0,
                                                                  scale=1.0, offset=2), mx.float32)


def test_kv_cache_offset_equals_slice_of_full():
    x = random((1, 9, 16), mx.float32)
    full = F.rope(x, 16, device=emulate())
    tail = F.rope(x[:, 6:], 16, offset=6, device=emulate())
    close(tail, full[:, 6:], mx.float32)


def test_bad_dims_are_reported():
    with pytest.raises(ValueError, match="dims must be even"):
        F.rope(mx.zeros((2, 8)), 7, device=reference())

"""F.rope on each implementation (emulated Metal kernel, "auto", reference) against mx.fast.rope.

Tolerances: `kernel_cases.TOL` per dtype (float32 1e-4: sin/cos of the emulator's libm and of
MLX differ by a few ulps of angles up to ~4e3 rad; float16/bfloat16: a few roundings of 10/7-bit
mantissas). The backward is the inverse rotation of the cotangent, checked the same way.
"""

import mlx.core as mx
import pytest

import metalnn as mn
from metalnn import functional as F
from metalnn.kernels import rope as rope_kernels

from kernel_cases import ROPE_CASES as CASES, close, emulate, mlx_rope, random, reference, spy_launches, vjp

@pytest.mark.parametrize("path", ["emulate", "reference", "auto"])
@pytest.mark.parametrize("shape,dims", CASES)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_matches_mlx(path, shape, dims, traditional, dtype, monkeypatch):
    launches = spy_launches(monkeypatch)
    device = {"emulate": emulate, "reference": reference, "auto": mn.Device}[path]()
    x = random(shape, dtype, 1)
    cot = random(shape, dtype, 2)
    kw = dict(traditional=traditional, base=10000.0, scale=0.5, offset=3)
    y = F.rope(x, dims, device=device, **kw)
    assert y.dtype == dtype and y.shape == x.shape
    close(y, mlx_rope(x, dims, **kw), dtype)
    g = vjp(lambda v: F.rope(v, dims, device=device, **kw), x, cot)
    close(g, vjp(lambda v: mlx_rope(v, dims, **kw), x, cot), dtype)
    # y, then mx.vjp's forward and its backward (the inverse rotation)
    expected = [True, True, False] if path == "emulate" else []
    assert [launch.template["FORWARD"] for launch in launches] == expected


@pytest.mark.parametrize("path", ["emulate", "reference", "auto"])
def test_offset_as_array_and_custom_freqs(path, monkeypatch):
    launches = spy_launches(monkeypatch)
    device = {"emulate": emulate, "reference": reference, "auto": mn.Device}[path]()
    x = random((2, 5, 16), mx.float32)
    freqs = mx.array([1.0, 2.0, 4.0, 9.0, 20.0, 50.0, 100.0, 1000.0])
    y = F.rope(x, 16, offset=mx.array(7), freqs=freqs, device=device)
    close(y, mlx_rope(x, 16, offset=7, freqs=freqs), mx.float32)
    assert bool(launches) == (path == "emulate")


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_auto_on_the_cpu_is_fused_or_cached_tables_and_mlx_for_array_offsets(dtype, monkeypatch):
    """"auto" on the CPU backend with an int offset: metalnn.cpu.fused.rope for float32 (checked against
    torch in test_fused.py), the cached tables of metalnn.functional.rope_table otherwise, both equal
    to mx.fast.rope within the dtype's rounding; an array offset runs mx.fast.rope itself (bit for bit)."""
    launches = spy_launches(monkeypatch)
    calls = []
    real = mx.fast.rope
    monkeypatch.setattr(mx.fast, "rope", lambda *a, **k: (calls.append(a[0].shape), real(*a, **k))[1])
    x = random((5, 8), dtype)           # 2-D: mx.fast.rope itself wants 3 axes
    want = real(x[None], 8, traditional=False, base=10000.0, scale=1.0, offset=2)[0]
    y = F.rope(x, 8, offset=2, device=mn.Device())
    assert not launches
    if mx.default_device() == mx.cpu:
        assert calls == []
        close(y, want, dtype)
    y = F.rope(x, 8, offset=mx.array(2), device=mn.Device())
    assert calls[-1] == (1, 5, 8) and not launches
    assert mx.array_equal(y, want)

def test_non_contiguous_input(monkeypatch):
    launches = spy_launches(monkeypatch)
    base = random((8, 6, 4), mx.float32)
    x = base.transpose(2, 1, 0)  # (4, 6, 8), not row-contiguous
    for device in (emulate("reversed"), reference(), mn.Device()):
        close(F.rope(x, 8, offset=2, device=device), mlx_rope(x, 8, offset=2), mx.float32)
    assert [launch.options["lane_order"] for launch in launches] == ["reversed"]


def test_kv_cache_offset_equals_slice_of_full_and_reuses_one_function():
    x = random((1, 9, 16), mx.float32)
    full = F.rope(x, 16, device=emulate())
    before = rope_kernels._function.cache_info().currsize
    tails = [F.rope(x[:, t:t + 1], 16, offset=t, device=emulate()) for t in range(6, 9)]
    assert rope_kernels._function.cache_info().currsize == before  # the offset is an input, not a key
    close(mx.concatenate(tails, axis=1), full[:, 6:], mx.float32)


def test_bad_dims_are_reported():
    with pytest.raises(ValueError, match="dims must be even"):
        F.rope(mx.zeros((2, 8)), 7, device=reference())
    with pytest.raises(ValueError, match=r"x must be \[..., T, D\]"):
        F.rope(mx.zeros((8,)), 8, device=mn.Device())

"""F.attention on the emulated fused attention kernels (metal_kernels/attention.metal).

Forward output and the gradients for q, k and v are compared with `F.attention_reference` (plain
MLX ops, explicit float32 softmax) and with torch's ``scaled_dot_product_attention``; one case also
with ``mx.fast.scaled_dot_product_attention``. A spy on the emulator checks which kernels ran (and
that the calls the kernels do not take ran none).

Tolerances: float32 uses 1e-4 (absolute and relative; `kernel_cases.TOL`). The kernel sums the
same terms as the references in another order (tiles of keys, per-lane partial dot products
reduced by simd_sum, an online softmax that rescales by exp(m_old - m_new)), and the backward
recomputes P from the stored log-sum-exp. With unit-normal inputs, head_dim <= 256 and at most
130 keys, each of those sums carries a rounding error of a few ulps times sqrt(terms); the
largest difference measured over CASES is 5e-6 (on gradients of magnitude ~9, against torch),
so 1e-4 leaves a wide margin and still catches any masking, indexing or rescaling mistake
(those give errors of order 1e-1). Gradients sum over up to 4 query heads and 130 queries
(dk, dv), so they get twice that. float16 / bfloat16 round q, k, v, dO and every output to 10 /
7 mantissa bits (`TOL` = 1e-2 / 5e-2, with a factor 2-3 on the gradients, which are rounded once
more through dO); those cases compare with the float32 reference on the same rounded inputs.

Cost: the emulator spends about 5 µs per emulated thread plus a few seconds to compile each
(kernel, dtype, head_dim) variant; the cases below cover every listed value (T = 1, 7, 64, 130;
head_dim 32, 64, 80, 128; causal or not; GQA 1:1 and 4:1; Tq < Tk with the default and an
explicit offset; float16, bfloat16; head_dim 256) without taking the full cross-product.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
import torch

import metalnn as mn
from metalnn.cpu import fused
from metalnn import functional as F
from metalnn.kernels import attention as attention_kernels

from kernel_cases import ATTENTION_CASES as CASES, close, emulate, f32, random, reference, spy_launches

KERNELS = {"attention_forward", "attention_backward_dq", "attention_backward_dkv"}

def make(case, dtype=mx.float32, seed=0):
    _, B, Hq, Hkv, Tq, Tk, D, _, _ = case
    q = random((B, Hq, Tq, D), dtype, seed)
    k = random((B, Hkv, Tk, D), dtype, seed + 1)
    v = random((B, Hkv, Tk, D), dtype, seed + 2)
    cot = random((B, Hq, Tq, D), mx.float32, seed + 3)
    return q, k, v, cot


def value_and_grads(fn, q, k, v, cot):
    def loss(q, k, v):
        return (fn(q, k, v).astype(mx.float32) * cot).sum()

    out = fn(q, k, v)
    return (out, *mx.grad(loss, argnums=(0, 1, 2))(q, k, v))


def torch_value_and_grads(q, k, v, cot, scale, causal, offset):
    """torch SDPA in float32; GQA through enable_gqa, the causal offset as a boolean mask."""
    tq, tk, tv = (torch.tensor(f32(a), requires_grad=True) for a in (q, k, v))
    mask = None
    if causal:
        Tq, Tk = q.shape[2], k.shape[2]
        off = Tk - Tq if offset is None else offset
        mask = torch.arange(Tk)[None, :] <= torch.arange(Tq)[:, None] + off
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=scale,
                                                           enable_gqa=q.shape[1] != k.shape[1])
    (out * torch.tensor(f32(cot))).sum().backward()
    return [t.detach().numpy() for t in (out, tq.grad, tk.grad, tv.grad)]


def check(got, want, dtype, grad_scale=2.0):
    """Output within the dtype's tolerance, gradients within grad_scale times it."""
    want = [mx.array(w) if isinstance(w, np.ndarray) else w for w in want]
    close(got[0], want[0], dtype)
    for g, w in zip(got[1:], want[1:]):
        close(g, w, dtype, scale=grad_scale)


def naive(q, k, v, **kw):
    return F.attention(q, k, v, device=reference(), **kw)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_and_torch(case, monkeypatch):
    launches = spy_launches(monkeypatch)
    _, B, Hq, Hkv, Tq, Tk, D, causal, offset = case
    q, k, v, cot = make(case)
    scale = 1.0 / math.sqrt(D)
    got = value_and_grads(lambda q, k, v: F.attention(q, k, v, causal=causal, offset=offset, device=emulate()),
                          q, k, v, cot)
    assert got[0].shape == q.shape and got[0].dtype == mx.float32
    assert got[1].shape == q.shape and got[2].shape == k.shape and got[3].shape == v.shape
    assert launches.names() == KERNELS
    want = value_and_grads(lambda q, k, v: naive(q, k, v, causal=causal, offset=offset), q, k, v, cot)
    check(got, want, mx.float32)
    check(got, torch_value_and_grads(q, k, v, cot, scale, causal, offset), mx.float32)


def test_float16_matches_float32_reference():
    case = ("f16", 1, 4, 1, 64, 64, 64, True, None)
    q, k, v, cot = make(case, mx.float16, seed=4)
    got = value_and_grads(lambda q, k, v: F.attention(q, k, v, device=emulate()), q, k, v, cot)
    assert all(g.dtype == mx.float16 for g in got)
    up = [a.astype(mx.float32) for a in (q, k, v)]
    want = value_and_grads(lambda q, k, v: naive(q, k, v), *up, cot)
    check(got, want, mx.float16, grad_scale=3.0)


def test_bfloat16_matches_float32_reference():
    case = ("bf16", 1, 2, 1, 7, 40, 64, True, None)
    q, k, v, cot = make(case, mx.bfloat16, seed=5)
    got = value_and_grads(lambda q, k, v: F.attention(q, k, v, device=emulate()), q, k, v, cot)
    assert all(g.dtype == mx.bfloat16 for g in got)
    up = [a.astype(mx.float32) for a in (q, k, v)]
    want = value_and_grads(lambda q, k, v: naive(q, k, v), *up, cot)
    check(got, want, mx.bfloat16, grad_scale=2.0)


def test_matches_mlx_fast_with_explicit_scale(monkeypatch):
    launches = spy_launches(monkeypatch)
    case = ("ref", 1, 2, 2, 7, 7, 80, True, None)
    q, k, v, cot = make(case, seed=7)
    got = value_and_grads(lambda q, k, v: F.attention(q, k, v, scale=0.3, device=emulate()), q, k, v, cot)
    assert launches.names() == KERNELS
    want = value_and_grads(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask="causal"),
                           q, k, v, cot)
    check(got, want, mx.float32)


@pytest.mark.parametrize("lane_order", ["reversed", "shuffled"])
def test_lane_order_does_not_change_result(lane_order, monkeypatch):
    launches = spy_launches(monkeypatch)
    # Several key tiles (D = 80 -> 32-key tiles, Tk = 64) and a partial row block (Tq = 7).
    case = ("lanes", 1, 4, 1, 7, 64, 80, True, None)
    q, k, v, cot = make(case, seed=9)

    def run(device):
        return value_and_grads(lambda q, k, v: F.attention(q, k, v, device=device), q, k, v, cot)

    a = run(emulate())
    b = run(emulate(lane_order, seed=5))
    for x, y in zip(a, b):
        close(x, y, mx.float32)
    orders = {(launch.name, launch.options["lane_order"]) for launch in launches}
    assert orders == {(name, order) for name in KERNELS for order in ("forward", lane_order)}


@pytest.mark.parametrize("rows", [1, 8])
def test_other_rows_per_threadgroup(monkeypatch, rows):
    # The kernels take the number of rows (SIMD groups) per threadgroup from the launch.
    monkeypatch.setattr(attention_kernels, "ROWS_PER_THREADGROUP", rows)
    launches = spy_launches(monkeypatch)
    case = ("rows", 1, 4, 2, 13, 21, 64, True, None)
    q, k, v, cot = make(case, seed=19)
    got = value_and_grads(lambda q, k, v: F.attention(q, k, v, device=emulate()), q, k, v, cot)
    assert launches.names() == KERNELS and {launch.threadgroup for launch in launches} == {(32 * rows, 1, 1)}
    check(got, value_and_grads(lambda q, k, v: naive(q, k, v), q, k, v, cot), mx.float32)


def test_rows_that_see_no_key_give_zero():
    # offset < 0: query 0 sits before every key. The kernels give output 0 and zero gradients
    # for such a row (softmax over an empty set; the references give NaN there). The other rows
    # are ordinary: they match the references run on queries 1.. alone (offset 0).
    case = ("empty", 1, 1, 1, 3, 3, 32, True, -1)
    q, k, v, cot = make(case, seed=11)
    got = value_and_grads(lambda q, k, v: F.attention(q, k, v, offset=-1, device=emulate()), q, k, v, cot)
    assert np.all(f32(got[0])[:, :, 0] == 0) and np.all(f32(got[1])[:, :, 0] == 0)
    rest = value_and_grads(lambda q, k, v: naive(q, k, v, offset=0), q[:, :, 1:], k, v, cot[:, :, 1:])
    check([got[0][:, :, 1:], got[1][:, :, 1:], got[2], got[3]], rest, mx.float32)


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_explicit_mask_runs_mlx_attention(mask_kind, monkeypatch):
    # The kernels take no mask array: the call runs the "auto" implementation, MLX's fused attention.
    launches = spy_launches(monkeypatch)
    calls = []
    real = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    case = ("mask", 1, 2, 1, 5, 9, 32, True, None)
    q, k, v, cot = make(case, seed=13)
    keep = mx.array(np.random.default_rng(0).random((5, 9)) > 0.3)
    mask = keep if mask_kind == "bool" else mx.where(keep, 0.0, -1e9).astype(mx.float32)
    got = value_and_grads(lambda q, k, v: F.attention(q, k, v, mask=mask, device=emulate()), q, k, v, cot)
    assert calls and not launches
    want = value_and_grads(lambda q, k, v: naive(q, k, v, mask=mask), q, k, v, cot)
    check(got, want, mx.float32)


def test_head_dim_over_256_runs_auto(monkeypatch):
    launches = spy_launches(monkeypatch)
    case = ("d264", 1, 2, 1, 3, 5, 264, True, None)
    q, k, v, cot = make(case, seed=15)
    assert not attention_kernels.supports(q, k, v, None)
    got = value_and_grads(lambda q, k, v: F.attention(q, k, v, device=emulate()), q, k, v, cot)
    assert not launches
    auto = value_and_grads(lambda q, k, v: F.attention(q, k, v, device=mn.Device()), q, k, v, cot)
    for a, b in zip(got, auto):
        assert mx.array_equal(a, b)
    check(got, value_and_grads(lambda q, k, v: naive(q, k, v), q, k, v, cot), mx.float32)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[6]], ids=["decode_gqa4", "full_gqa4", "offset"])
def test_auto_matches_torch(case, monkeypatch):
    """"auto" on the CPU: the fused-softmax form (float32, no mask array) or MLX's fused attention."""
    _, B, Hq, Hkv, Tq, Tk, D, causal, offset = case
    softmax_calls = []
    real = fused.scaled_softmax
    monkeypatch.setattr(fused, "scaled_softmax", lambda *a, **k: (softmax_calls.append(1), real(*a, **k))[1])
    q, k, v, cot = make(case, seed=21)
    got = value_and_grads(lambda q, k, v: F.attention(q, k, v, causal=causal, offset=offset, device=mn.Device()),
                          q, k, v, cot)
    check(got, torch_value_and_grads(q, k, v, cot, 1.0 / math.sqrt(D), causal, offset), mx.float32)
    # An offset other than Tk - Tq needs a mask array: MLX's attention then, not the fused form.
    assert bool(softmax_calls) == (fused.available() and offset is None)


def test_tiling_fits_threadgroup_memory():
    for d in (1, 32, 64, 80, 96, 128, 200, 256):
        dl, bk = attention_kernels.tiling(d)
        assert 32 * dl >= d and dl <= 8 and 1 <= bk <= 32
        assert (2 * bk * 32 * dl + 2 * bk) * 4 <= 32 * 1024


def test_attention_kernel_with_default_arguments(monkeypatch):
    # F.attention with kernels="emulate" and its defaults (causal=True, scale=D^-1/2).
    launches = spy_launches(monkeypatch)
    q, k, v, _ = make(("d", 1, 2, 2, 7, 7, 32, True, None), seed=17)
    close(F.attention(q, k, v, device=mn.Device(kernels="emulate")), naive(q, k, v), mx.float32)
    assert launches.names() == {"attention_forward"}


def test_decoding_offsets_reuse_one_function():
    q, k, v, _ = make(("dec", 1, 2, 1, 1, 9, 32, True, None), seed=23)
    F.attention(q, k[:, :, :5], v[:, :, :5], device=emulate())
    before = attention_kernels._function.cache_info().currsize
    for t in range(6, 10):
        out = F.attention(q, k[:, :, :t], v[:, :, :t], device=emulate())
        close(out, naive(q, k[:, :, :t], v[:, :, :t]), mx.float32)
    assert attention_kernels._function.cache_info().currsize == before

"""metalnn's kernels with inputs of 1, 2 and 7 elements, forward and backward, on the strict emulator.

MLX passes an input of fewer than 8 elements as ``const constant T*`` (8 or more: ``const device
T*``), and Metal converts no constant pointer into a device one: a kernel that derives a
``const device T*`` from such an input does not compile on a Mac. The strict emulator checks the
same rule, so every case below is a compile check as well as a numerical one, against the
reference path (``Device(kernels="reference")``, plain MLX ops), MLX's fused ops and torch.

Tolerances: float32 1e-4 (kernel_cases.TOL: a different summation order over at most a handful of
terms), float16 / bfloat16 per kernel_cases.TOL; gated delta as tests/functional/test_gated_delta.py (fla's
relative RMS criterion, float32 throughout).
"""

import mlx.core as mx
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import metalnn as mn
from metalnn import functional as F
from metalnn import ggml
from metalnn.kernels import gated_delta as gd_kernels
from metalnn.kernels import ggml as ggml_kernels

from ggml_blocks import random_blocks
from kernel_cases import close, emulate, random, reference


def grads(fn, args, cot):
    def loss(*a):
        return (fn(*a).astype(mx.float32) * cot).sum()

    out = mx.grad(loss, argnums=tuple(range(len(args))))(*args)
    return tuple(out) if isinstance(out, (list, tuple)) else (out,)


# ------------------------------------------------------------------ RMSNorm
# (rows, D): x, dy hold rows * D elements, w holds D, the backward's rstd holds `rows`
RMS_CASES = [(rows, D, mx.float32) for rows, D in [(1, 1), (1, 2), (1, 7), (2, 1), (7, 1), (2, 3)]] + [
    (rows, D, dtype) for rows, D in [(1, 7), (7, 1)] for dtype in (mx.float16, mx.bfloat16)]


@pytest.mark.parametrize("rows,D,dtype", RMS_CASES)
def test_rms_norm_small(rows, D, dtype):
    x = random((rows, D), dtype, 1)
    w = (random((D,), mx.float32, 2) * 0.3 + 1).astype(dtype)
    cot = random((rows, D), mx.float32, 3)
    eps = 1e-5
    y = F.rms_norm(x, w, eps, device=emulate())
    close(y, F.rms_norm(x, w, eps, device=reference()), dtype)
    close(y, mx.fast.rms_norm(x, w, eps), dtype)
    got = grads(lambda a, b: F.rms_norm(a, b, eps, device=emulate()), (x, w), cot)
    want = grads(lambda a, b: mx.fast.rms_norm(a, b, eps), (x, w), cot)
    for g, r in zip(got, want):
        close(g, r, dtype, scale=2)


# ------------------------------------------------------------------ RoPE
# (shape [..., T, D], dims): x of 2, 7 and 14 elements, inv_freq of 1, 3 and 7
ROPE_CASES = [((1, 1, 2), 2), ((1, 1, 7), 6), ((1, 1, 14), 14), ((2, 1, 2), 2)]


@pytest.mark.parametrize("shape,dims", ROPE_CASES)
@pytest.mark.parametrize("traditional", [False, True])
def test_rope_small(shape, dims, traditional):
    x = random(shape, mx.float32, 1)
    cot = random(shape, mx.float32, 2)
    kw = dict(traditional=traditional, base=10000.0, scale=1.0, offset=mx.array(5))
    y = F.rope(x, dims, device=emulate(), **kw)
    close(y, F.rope(x, dims, device=reference(), **kw), mx.float32)
    close(y, mx.fast.rope(x, dims, traditional=traditional, base=10000.0, scale=1.0, offset=5), mx.float32)
    (g,) = grads(lambda a: F.rope(a, dims, device=emulate(), **kw), (x,), cot)
    (r,) = grads(lambda a: mx.fast.rope(a, dims, traditional=traditional, base=10000.0, scale=1.0, offset=5), (x,), cot)
    close(g, r, mx.float32)


# ------------------------------------------------------------------ attention
# (B, Hq, Hkv, Tq, Tk, D): q, k, v of 1, 2 and 7 elements; the backward's lse and delta of Tq
ATTN_CASES = [(1, 1, 1, 1, 1, 1), (1, 1, 1, 1, 1, 2), (1, 1, 1, 1, 1, 7), (1, 1, 1, 2, 2, 1),
              (1, 1, 1, 7, 7, 1), (1, 2, 1, 1, 3, 2)]


def _torch_attention(q, k, v, cot, causal):
    qt, kt, vt = (torch.tensor(np.array(a), dtype=torch.float64, requires_grad=True) for a in (q, k, v))
    rep = qt.shape[1] // kt.shape[1]
    tq, tk = qt.shape[2], kt.shape[2]
    mask = None
    if causal:  # query i sees keys j <= (tk - tq) + i
        mask = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
    y = TF.scaled_dot_product_attention(qt, kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1),
                                        attn_mask=mask)
    (y * torch.tensor(np.array(cot), dtype=torch.float64)).sum().backward()
    return [a.detach().numpy() for a in (y, qt.grad, kt.grad, vt.grad)]


@pytest.mark.parametrize("case", ATTN_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_small(case, causal):
    B, Hq, Hkv, Tq, Tk, D = case
    q = random((B, Hq, Tq, D), mx.float32, 1)
    k = random((B, Hkv, Tk, D), mx.float32, 2)
    v = random((B, Hkv, Tk, D), mx.float32, 3)
    cot = random((B, Hq, Tq, D), mx.float32, 4)
    y = F.attention(q, k, v, causal=causal, device=emulate())
    close(y, F.attention(q, k, v, causal=causal, device=reference()), mx.float32)
    got = grads(lambda a, b, c: F.attention(a, b, c, causal=causal, device=emulate()), (q, k, v), cot)
    want = _torch_attention(q, k, v, cot, causal)
    close(y, mx.array(want[0]), mx.float32)
    for g, r in zip(got, want[1:]):
        close(g, mx.array(r), mx.float32, scale=2)


# ------------------------------------------------------------------ gated delta rule
# (B, T, Hk, Hv, K, V): q, k of B*T*Hk*K elements, v of B*T*Hv*V, g and beta of B*T*Hv, h0 of K*V
GDN_CASES = [(1, 1, 1, 1, 1, 1), (1, 1, 1, 1, 2, 2), (1, 1, 1, 1, 7, 1), (1, 1, 1, 1, 1, 7),
             (1, 2, 1, 1, 1, 1), (1, 7, 1, 1, 1, 1)]
GDN_TOL = {"o": 0.002, "ht": 0.002, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02, "dh0": 0.008}


def _gdn_inputs(B, T, Hk, Hv, K, V, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, Hk, K))
    k = rng.normal(size=(B, T, Hk, K))
    q, k = (a / np.linalg.norm(a, axis=-1, keepdims=True) for a in (q, k))
    v = rng.normal(size=(B, T, Hv, V))
    g = np.log(1 / (1 + np.exp(-rng.uniform(size=(B, T, Hv)))))  # logsigmoid
    beta = 1 / (1 + np.exp(-rng.uniform(size=(B, T, Hv))))
    h0 = rng.normal(size=(B, Hv, K, V))
    do = rng.normal(size=(B, T, Hv, V))
    dht = rng.normal(size=(B, Hv, K, V))
    return [mx.array(a.astype(np.float32)) for a in (q, k, v, g, beta, h0, do, dht)]


def _gdn_run(inputs, device):
    q, k, v, g, beta, h0, do, dht = inputs

    def loss(*a):
        o, ht = F.gated_delta_rule(*a[:5], initial_state=a[5], device=device)
        return (o * do).sum() + (ht * dht).sum(), (o, ht)

    (_, (o, ht)), gr = mx.value_and_grad(loss, argnums=tuple(range(6)))(q, k, v, g, beta, h0)
    return dict(zip(("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"), (np.array(a) for a in (o, ht, *gr))))


def _gdn_close(ref, got):
    for name, tol in GDN_TOL.items():
        r, x = np.asarray(ref[name], np.float64), np.asarray(got[name], np.float64)
        assert r.shape == x.shape and np.all(np.isfinite(x)), name
        if np.abs(r - x).max() <= 1e-6:
            continue
        err = np.linalg.norm(r - x) / max(np.linalg.norm(r), 1e-30)
        assert err < tol, f"{name}: relative RMS error {err:.3g} >= {tol}"


@pytest.mark.parametrize("shape", GDN_CASES)
def test_gated_delta_small(shape):
    inputs = _gdn_inputs(*shape, seed=sum(shape))
    _gdn_close(_gdn_run(inputs, reference()), _gdn_run(inputs, emulate()))


def test_gated_delta_threadgroup_memory_sizes_the_backward():
    # K = 512: 8 SIMD groups of the backward would need 8 * 4104 bytes > 32 KiB; 4 fit
    assert gd_kernels._backward_simdgroups(512, 8) == 4
    assert gd_kernels._backward_simdgroups(480, 8) == 8  # 8 * 3848 bytes fit
    assert gd_kernels._backward_simdgroups(gd_kernels.MAX_K, 8) == 8  # every supported K keeps 8
    with pytest.raises(ValueError, match=r"key head dimension of 4100 needs 33032 bytes of threadgroup memory per "
                       r"SIMD group, more than the 32768 bytes"):
        gd_kernels._backward_simdgroups(4100, 8)


def test_gated_delta_wide_keys_take_another_path_before_launch(monkeypatch):
    """K beyond MAX_K never reaches the kernels (register and threadgroup-memory limits): the
    emulate device runs the MLX-op form, equal to the reference; mode="kernel" is refused."""
    from kernel_cases import spy_launches

    launches = spy_launches(monkeypatch)
    inputs = _gdn_inputs(1, 2, 1, 1, 512, 8, seed=11)
    _gdn_close(_gdn_run(inputs, reference()), _gdn_run(inputs, emulate()))
    assert not launches
    with pytest.raises(ValueError, match="kernel"):
        F.gated_delta_rule(*inputs[:5], initial_state=inputs[5], mode="kernel", device=emulate())


# ------------------------------------------------------------------ SSD (Mamba2)
# (B, T, H, P, G, N): xd of B*T*H*P elements, g of B*T*H, B and C of B*T*G*N, h0 of H*P*N
SSD_CASES = [(1, 1, 1, 1, 1, 1), (1, 1, 1, 2, 1, 2), (1, 1, 1, 7, 1, 1), (1, 1, 1, 1, 1, 7), (1, 2, 1, 1, 1, 1),
             (1, 7, 1, 1, 1, 1), (1, 1, 2, 1, 1, 3)]


@pytest.mark.parametrize("shape", SSD_CASES)
def test_ssd_small(shape):
    """Forward and every gradient of the SSD kernels equal the reference (float32, 1e-4: at most a
    handful of terms per element)."""
    B, T, H, P, G, N = shape
    rng = np.random.default_rng(sum(shape))
    x, b, c = (mx.array(rng.normal(size=s).astype(np.float32)) for s in ((B, T, H, P), (B, T, G, N), (B, T, G, N)))
    dt = mx.array(rng.uniform(0.05, 0.8, (B, T, H)).astype(np.float32))
    A, D = mx.array(-rng.uniform(0.5, 2, (H,)).astype(np.float32)), mx.array(rng.normal(size=(H,)).astype(np.float32))
    h0 = mx.array(rng.normal(size=(B, H, P, N)).astype(np.float32))

    def run(device):
        def loss(*a):
            y, ht = F.ssd_scan(*a[:6], initial_state=a[6], device=device)
            return (y * y).sum() + (ht * a[6]).sum(), (y, ht)
        (_, outs), grads = mx.value_and_grad(loss, argnums=tuple(range(7)))(x, dt, A, b, c, D, h0)
        return [*outs, *grads]

    for got, want in zip(run(emulate()), run(reference())):
        close(got, want, mx.float32)


# ------------------------------------------------------------------ convolution
# (x shape, w shape): x and w of 1, 2 and 7 elements (the 23 sizes travel in one device buffer)
CONV_CASES = [((1, 1, 1), (1, 1, 1)), ((1, 1, 2), (1, 1, 2)), ((1, 1, 7), (1, 1, 7)), ((1, 7, 1), (1, 7, 1)),
              ((1, 2, 1), (7, 2, 1)), ((1, 1, 2, 1), (2, 1, 1, 1))]


@pytest.mark.parametrize("xs,ws", CONV_CASES)
def test_conv_small(xs, ws):
    rng = np.random.default_rng(len(xs) + sum(xs) + sum(ws))
    x, w = rng.normal(size=xs).astype(np.float32), rng.normal(size=ws).astype(np.float32)
    conv_mx = F.conv1d if len(xs) == 3 else F.conv2d
    conv_t = TF.conv1d if len(xs) == 3 else TF.conv2d
    xt, wt = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (x, w))
    yt = conv_t(xt, wt)
    cot = rng.normal(size=tuple(yt.shape)).astype(np.float32)
    (yt * torch.tensor(cot, dtype=torch.float64)).sum().backward()
    device = mn.Device(kernels="emulate")
    xm, wm = mx.array(x), mx.array(w)
    y = conv_mx(xm, wm, device=device)
    np.testing.assert_allclose(np.array(y), yt.detach().numpy(), rtol=1e-4, atol=1e-4)
    gx, gw = grads(lambda a, b: conv_mx(a, b, device=device), (xm, wm), mx.array(cot))
    np.testing.assert_allclose(np.array(gx), xt.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(gw), wt.grad.numpy(), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ GGML products
# (x shape, type): W is one row of the type; x of 1, 2, 7 and 9 elements, W of 2 bytes (F16 1 x 1),
# 4 (F32 1 x 1), 2 (BF16 1 x 1), 28 (F32 1 x 7) and 18 (Q4_0 1 x 32); y of 1, 2, 7 and 9 elements.
# Each on both products (matvec, matmul), forward and the input gradient (the dequantize kernel),
# against x @ W.T and g @ W with W decoded by the type's MLX decoder.
GGML_CASES = [((1, 1), "F32"), ((2, 1), "F16"), ((7, 1), "BF16"), ((9, 1), "F32"), ((1, 7), "F32"),
              ((1, 32), "Q4_0")]


@pytest.mark.parametrize("xs,qtype", GGML_CASES)
@pytest.mark.parametrize("kernel", ["matvec", "matmul"])
def test_ggml_small(xs, qtype, kernel):
    cls = ggml.get_type(qtype)
    w = mx.array(random_blocks(qtype, xs[-1] // cls.block_size, np.random.default_rng(sum(xs))).reshape(1, -1))
    W = cls.decode(w)
    x = random(xs, mx.float32, 1)
    cot = random((xs[0], 1), mx.float32, 2)
    fn = lambda a: ggml_kernels.ggml_matmul(a, w, cls, "emulate", kernel=kernel)  # noqa: E731
    close(fn(x), x @ W.T, mx.float32)
    (g,) = grads(fn, (x,), cot)
    close(g, cot @ W, mx.float32)

"""Tests for metalnn.cpu.fused (fused, multi-threaded CPU primitives of a training step).

Every value and gradient is checked against PyTorch in float64 (an independent reference) on
each code path: the AVX2+FMA kernels, the portable kernels and the MLX-op forms used without the
extension. That the native primitives ran is checked on the graph (``mx.export_to_dot`` names the
primitives). JVP, vmap, second derivatives and ``mx.compile`` are checked against the same
references.

Tolerances (float32 against float64): rows of up to a few hundred terms of order 1 summed in
another order differ by ~sqrt(n) * 6e-8 relative; the exp polynomial is within ~2 ulps; RoPE's
cos/sin of angles up to ~300 rad are rounded in float32 (as MLX does: ~3e-5 absolute for the
largest angles). Values: rtol 1e-5, atol 1e-5 (RoPE: 1e-4); gradients chain one more product:
rtol 2e-5, atol 2e-5. A wrong index, sign or missing term changes results by O(0.1) or more.
"""

import io
import platform
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import metalnn as mn
import metalnn.cpu.fused as fu
import mlx.core as mx
from metalnn import functional as F
from metalnn.cpu.im2col import get_num_threads, set_num_threads

NATIVE_PLATFORM = sys.platform.startswith("linux") and platform.machine() == "x86_64"
native = pytest.mark.skipif(not NATIVE_PLATFORM, reason="the native extension is built on Linux x86_64 only")

RTOL = ATOL = 1e-5
GRAD_RTOL = GRAD_ATOL = 2e-5
ROPE_ATOL = 1e-4


def test_extension_is_built_here():
    if NATIVE_PLATFORM:
        assert fu.available(), f"extension unavailable: {fu.unavailable_reason()}"
    else:
        assert not fu.available() and fu.unavailable_reason()


# ----------------------------------------------------------------------------- helpers


def _rand(shape, scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.float64))


def _close(a, b, rtol=RTOL, atol=ATOL, what=""):
    b = b.detach().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
    np.testing.assert_allclose(np.array(a, dtype=np.float64), b, rtol=rtol, atol=atol, err_msg=what)


def primitives(*arrays) -> set[str]:
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return {line.split('label ="', 1)[1].split('"', 1)[0] for line in buf.getvalue().splitlines() if 'label ="' in line}


@pytest.fixture(params=["avx2", "portable", "mlx_ops"])
def path(request, monkeypatch):
    """Run a test on the AVX2 kernels, the portable kernels and the MLX-op forms."""
    if request.param == "mlx_ops":
        monkeypatch.setattr(fu, "_ext", None)
        yield request.param
        return
    if not fu.available():
        if NATIVE_PLATFORM:
            pytest.fail(f"extension unavailable: {fu.unavailable_reason()}")
        pytest.skip(f"no native kernels on this platform ({fu.unavailable_reason()})")
    ext = fu._ext
    if request.param == "avx2" and not ext.has_avx2():
        pytest.skip("the CPU has no AVX2/FMA")
    old = ext.get_force_scalar()
    ext.set_force_scalar(request.param == "portable")
    try:
        yield request.param
    finally:
        ext.set_force_scalar(old)


def _expect(path, make, names):
    """``make()`` (fresh, unevaluated arrays) has the primitives ``names`` exactly on native paths."""
    found = primitives(*make())
    if path == "mlx_ops":
        assert not any(p.startswith("Metalnn") for p in found), found
    else:
        assert set(names) <= found, f"expected {names} in the graph, found {found}"


# ----------------------------------------------------------------------------- torch references


def t_rms_norm(x, w, eps):
    y = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def t_rope(x, dims, traditional, base, scale, offset, freqs=None):
    T = x.shape[-2]
    if freqs is None:
        inv = base ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    else:
        inv = 1.0 / torch.tensor(freqs, dtype=torch.float64)
    theta = ((torch.arange(T, dtype=torch.float64) + offset) * scale)[:, None] * inv[None, :]
    c, s = torch.cos(theta), torch.sin(theta)
    rot, rest = x[..., :dims], x[..., dims:]
    if traditional:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).reshape(rot.shape)
    else:
        x1, x2 = rot[..., : dims // 2], rot[..., dims // 2:]
        out = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)
    return torch.cat([out, rest], -1)


T_ACT = {"silu": TF.silu, "gelu_tanh": lambda a: TF.gelu(a, approximate="tanh"), "sigmoid": torch.sigmoid,
         "tanh": torch.tanh}


def t_scaled_softmax(x, scale, causal, q_len, offset):
    z = x * scale
    if causal:
        n = x.shape[-1]
        keep = torch.arange(n)[None, :] <= (torch.arange(q_len)[:, None] + offset)
        zz = z.reshape(*x.shape[:-2], x.shape[-2] // q_len, q_len, n)
        z = zz.masked_fill(~keep, float("-inf")).reshape(x.shape)
    return torch.softmax(z, -1)


def _value_and_grads(fn, inputs, cot, argnums):
    """``(fn(*inputs), grads)`` of ``sum(fn(*inputs) * cot)``; grads a tuple, one per argnum."""
    out, grads = mx.vjp(fn, list(inputs), [cot])
    return out[0], tuple(grads[i] for i in argnums)


def _torch_grads(fn, inputs, cot):
    ts = [_t(a).requires_grad_(True) for a in inputs]
    y = fn(*ts)
    grads = torch.autograd.grad((y * _t(cot)).sum(), ts)
    return y, grads


# ----------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 33), (4, 256), (130, 64), (2, 3, 1000)])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm(shape, weight, path):
    x = _rand(shape, seed=1)
    w = _rand(shape[-1:], 0.3, seed=2) + 1 if weight else None
    cot = _rand(shape, seed=3)
    y = fu.rms_norm(x, w, 1e-5)
    inputs = [x, w] if weight else [x]
    fn = (lambda a, b: fu.rms_norm(a, b, 1e-5)) if weight else (lambda a: fu.rms_norm(a, None, 1e-5))
    _, grads = _value_and_grads(fn, inputs, cot, tuple(range(len(inputs))))
    ty, tgrads = _torch_grads(lambda *a: t_rms_norm(a[0], a[1] if weight else None, 1e-5), inputs, cot)
    _close(y, ty, what="y")
    for name, g, tg in zip(("dx", "dw"), grads, tgrads):
        # dw sums g * x * r over up to 390 rows of O(1) terms
        _close(g, tg, GRAD_RTOL, GRAD_ATOL * (10 if name == "dw" else 1), what=name)
    _expect(path, lambda: [fn(*inputs), *_value_and_grads(fn, inputs, cot, (0,))[1]],
            {"MetalnnRMSNorm", "MetalnnRMSNormVJP"})


def test_rms_norm_non_contiguous_and_zero_rows(path):
    x = _rand((40, 6), seed=4).T[:, :33]  # (6, 33) with strides (1, 6)
    x = mx.concatenate([x, mx.zeros((1, 33))])  # a zero row: y = 0, finite gradients
    g = mx.grad(lambda a: (fu.rms_norm(a, None, 1e-5) ** 2).sum())(x)
    tx = _t(x).requires_grad_(True)
    ty = t_rms_norm(tx, None, 1e-5)
    (tg,) = torch.autograd.grad((ty ** 2).sum(), tx)
    _close(fu.rms_norm(x, None, 1e-5), ty)
    _close(g, tg, GRAD_RTOL, GRAD_ATOL)


# ----------------------------------------------------------------------------- rope


ROPE_CASES = [  # (shape [..., T, D], dims, traditional, base, scale, offset, freqs)
    ((2, 3, 9, 16), 16, False, 10000.0, 1.0, 0, None),
    ((2, 3, 9, 16), 16, True, 10000.0, 1.0, 5, None),
    ((1, 4, 17, 40), 24, False, 500.0, 0.5, 3, None),   # partial rotation, scaled positions
    ((1, 4, 17, 40), 24, True, 500.0, 0.5, 3, None),
    ((3, 7, 12), 12, False, None, 1.0, 2, [1.0, 3.0, 7.0, 20.0, 90.0, 400.0]),  # custom periods
    ((5, 8), 8, False, 10000.0, 1.0, 260, None),        # 2-D, large offset
]


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"{c[0]}-d{c[1]}-{'trad' if c[2] else 'half'}")
def test_rope(case, path):
    shape, dims, trad, base, scale, offset, freqs = case
    x = _rand(shape, seed=5)
    cot = _rand(shape, seed=6)
    kw = dict(traditional=trad, base=base, scale=scale, offset=offset, freqs=freqs)
    y, (g,) = _value_and_grads(lambda a: fu.rope(a, dims, **kw), [x], cot, (0,))
    ty, (tg,) = _torch_grads(lambda a: t_rope(a, dims, trad, base, scale, offset, freqs), [x], cot)
    _close(fu.rope(x, dims, **kw), ty, atol=ROPE_ATOL, what="y")
    _close(g, tg, atol=ROPE_ATOL, what="dx")
    _expect(path, lambda: _value_and_grads(lambda a: fu.rope(a, dims, **kw), [x], cot, (0,))[1], {"MetalnnRoPE"})


def test_rope_reads_transposed_views(path):
    """The split-heads view [B, T, H, D] -> [B, H, T, D] goes in without a copy; out comes a
    row-contiguous array with the same values."""
    base = _rand((2, 11, 3, 16), seed=7)
    x = base.transpose(0, 2, 1, 3)
    y = fu.rope(x, 16, offset=1)
    _close(y, t_rope(_t(x), 16, False, 10000.0, 1.0, 1), atol=ROPE_ATOL)
    if path != "mlx_ops":
        assert "Contiguous" not in primitives(y) and "Copy" not in primitives(y)


def test_layout_aware_gradients_through_split_heads(path):
    """rope and contiguous on the transposed view of split heads, then the heads merged back: the
    gradient in the un-split input (which the primitives store in that input's memory order)."""
    base = _rand((2, 11, 3, 16), seed=17)  # [B, T, H, D]
    cot = _rand((2, 11, 48), seed=18)

    def fn(b):
        h = b.transpose(0, 2, 1, 3)  # [B, H, T, D] view
        q = fu.rope(h, 16, offset=2)
        v = fu.contiguous(h)
        o = fu.contiguous((q * v).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        return o.transpose(0, 2, 1, 3).reshape(2, 11, 48)

    def tfn(b):
        h = b.permute(0, 2, 1, 3)
        return (t_rope(h, 16, False, 10000.0, 1.0, 2) * h).permute(0, 2, 1, 3).reshape(2, 11, 48)

    y, (g,) = _value_and_grads(fn, [base], cot, (0,))
    ty, (tg,) = _torch_grads(tfn, [base], cot)
    _close(y, ty, atol=ROPE_ATOL)
    _close(g, tg, GRAD_RTOL, ROPE_ATOL)
    _expect(path, lambda: _value_and_grads(fn, [base], cot, (0,))[1], {"MetalnnRoPE", "MetalnnLayoutCopy"})


# ----------------------------------------------------------------------------- gated


@pytest.mark.parametrize("act", fu.GATED_ACTIVATIONS)
@pytest.mark.parametrize("shape", [(3,), (5, 77), (2, 9, 130)])
def test_gated(act, shape, path):
    a, b, cot = _rand(shape, 3.0, seed=8), _rand(shape, seed=9), _rand(shape, seed=10)
    y, grads = _value_and_grads(lambda p, q: fu.gated(p, q, act), [a, b], cot, (0, 1))
    ty, tgrads = _torch_grads(lambda p, q: T_ACT[act](p) * q, [a, b], cot)
    _close(fu.gated(a, b, act), ty, what="y")
    for name, g, tg in zip(("da", "db"), grads, tgrads):
        _close(g, tg, GRAD_RTOL, GRAD_ATOL, what=name)
    _expect(path, lambda: [fu.gated(a, b, act), *_value_and_grads(lambda p, q: fu.gated(p, q, act), [a, b], cot,
                                                                  (0, 1))[1]], {"MetalnnGated", "MetalnnGatedVJP"})


def test_gated_rejects_bad_arguments():
    with pytest.raises(ValueError, match="activation must be one of"):
        fu.gated(mx.zeros((2,)), mx.zeros((2,)), "relu")
    if fu.available():
        with pytest.raises(ValueError, match=r"a and b must have the same shape"):
            fu.gated(mx.zeros((2, 3)), mx.zeros((3,)), "silu")


# ----------------------------------------------------------------------------- cross entropy


@pytest.mark.parametrize("shape", [(1, 2), (7, 5), (3, 4, 37), (64, 300)])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy(shape, smoothing, path):
    rng = np.random.default_rng(11)
    logits = _rand(shape, 3.0, seed=12)
    targets = mx.array(rng.integers(0, shape[-1], shape[:-1]).astype(np.int32))
    cot = _rand(shape[:-1], seed=13)
    loss, (g,) = _value_and_grads(lambda z: fu.cross_entropy(z, targets, smoothing), [logits], cot, (0,))
    tl = _t(logits).requires_grad_(True)
    tt = torch.from_numpy(np.array(targets).astype(np.int64))
    ref = TF.cross_entropy(tl.reshape(-1, shape[-1]), tt.reshape(-1), reduction="none",
                           label_smoothing=smoothing).reshape(shape[:-1])
    (tg,) = torch.autograd.grad((ref * _t(cot)).sum(), tl)
    _close(fu.cross_entropy(logits, targets, smoothing), ref, what="loss")
    _close(g, tg, GRAD_RTOL, GRAD_ATOL, what="dlogits")
    _expect(path, lambda: _value_and_grads(lambda z: fu.cross_entropy(z, targets, smoothing), [logits], cot, (0,))[1],
            {"MetalnnCrossEntropy", "MetalnnCrossEntropyVJP"})


@native
def test_cross_entropy_extremes():
    """-inf logits (masked classes) and huge ones: finite losses, the exact softmax gradient."""
    logits = mx.array([[0.0, -mx.inf, 2.0, 1e4 * 0], [80.0, -80.0, 0.0, 50.0]])
    targets = mx.array([2, 0], dtype=mx.int32)
    loss = fu.cross_entropy(logits, targets)
    ref = TF.cross_entropy(_t(logits), torch.tensor([2, 0]), reduction="none")
    _close(loss, ref)
    g = mx.grad(lambda z: fu.cross_entropy(z, targets).sum())(logits)
    tl = _t(logits).requires_grad_(True)
    (tg,) = torch.autograd.grad(TF.cross_entropy(tl, torch.tensor([2, 0]), reduction="sum"), tl)
    _close(g, tg, GRAD_RTOL, GRAD_ATOL)


# ----------------------------------------------------------------------------- scaled softmax


SOFTMAX_CASES = [  # (shape, scale, causal, q_len, offset)
    ((2, 3, 10, 10), 0.125, True, 10, 0),
    ((2, 1, 3 * 7, 12), 0.3, True, 7, 5),     # 3 query heads grouped per key head, keys ahead
    ((4, 33), 1.0, False, 1, 0),
    ((2, 2, 9, 130), 0.5, True, 9, 121),      # the last 9 positions of 130 (decoding a chunk)
]


@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=lambda c: f"{c[0]}-{'causal' if c[2] else 'full'}")
def test_scaled_softmax(case, path):
    shape, scale, causal, q_len, offset = case
    x, cot = _rand(shape, 2.0, seed=14), _rand(shape, seed=15)
    kw = dict(causal=causal, q_len=q_len, offset=offset)
    y, (g,) = _value_and_grads(lambda a: fu.scaled_softmax(a, scale, **kw), [x], cot, (0,))
    ty, (tg,) = _torch_grads(lambda a: t_scaled_softmax(a, scale, causal, q_len, offset), [x], cot)
    y = fu.scaled_softmax(x, scale, **kw)
    _close(y, ty, what="y")
    _close(g, tg, GRAD_RTOL, GRAD_ATOL, what="dx")
    if causal and path != "mlx_ops":
        keep = (t_scaled_softmax(_t(x), scale, causal, q_len, offset) > 0).numpy()
        assert (np.array(y)[~keep] == 0).all() and (np.array(g)[~keep] == 0).all()
    _expect(path, lambda: _value_and_grads(lambda a: fu.scaled_softmax(a, scale, **kw), [x], cot, (0,))[1],
            {"MetalnnScaledSoftmax", "MetalnnScaledSoftmaxVJP"})


# ----------------------------------------------------------------------------- transforms


def _ops():
    """(name, fn of one float32 array, input shape) for the transform tests."""
    w = _rand((6,), 0.2, seed=20) + 1
    b = _rand((3, 4, 6), seed=21)
    t = mx.array([[1, 0, 5, 2], [3, 3, 0, 1], [5, 4, 2, 0]], dtype=mx.int32)
    return [
        ("rms_norm", lambda x: fu.rms_norm(x, w, 1e-5)),
        ("rope", lambda x: fu.rope(x, 6, offset=2)),
        ("gated", lambda x: fu.gated(x, b, "gelu_tanh")),
        ("cross_entropy", lambda x: fu.cross_entropy(x, t, 0.1)),
        ("scaled_softmax", lambda x: fu.scaled_softmax(x, 0.7, causal=True, q_len=2, offset=3)),
    ]


OPS = [name for name, _ in _ops()]


def _op(name):
    return dict(_ops())[name]


def _mlx_form(name, monkeypatch):
    monkeypatch.setattr(fu, "_ext", None)
    fn = _op(name)
    monkeypatch.undo()
    return fn


@native
@pytest.mark.parametrize("name", OPS)
def test_jvp_vmap_second_order_and_compile(name, monkeypatch):
    """Against the MLX-op form of the same op (itself checked against torch above)."""
    x, tangent = _rand((3, 4, 6), seed=22), _rand((3, 4, 6), seed=23)
    fn = _op(name)
    ref = _mlx_form(name, monkeypatch)
    # JVP
    _close(mx.jvp(fn, [x], [tangent])[1][0], mx.jvp(ref, [x], [tangent])[1][0], GRAD_RTOL, GRAD_ATOL)
    # vmap over the leading axis (the op applied to each [4, 6] slice)
    if name not in ("gated", "cross_entropy"):  # these close over full-shape arrays
        _close(mx.vmap(fn)(x), mx.vmap(ref)(x))
    # second derivative (through the backward primitive's definition)
    def hess(f):
        return mx.grad(lambda a: (mx.grad(lambda z: (f(z) ** 2).sum())(a) * tangent).sum())(x)
    _close(hess(fn), hess(ref), 1e-4, 1e-4)
    # compiled forward and backward
    cot = _rand(fn(x).shape, seed=24)
    g = mx.compile(mx.grad(lambda a: (fn(a) * cot).sum()))
    _close(g(x), mx.grad(lambda a: (ref(a) * cot).sum())(x), GRAD_RTOL, GRAD_ATOL)


@native
def test_results_do_not_depend_on_thread_count():
    x = _rand((300, 64), seed=24)
    w = _rand((64,), seed=25)
    cot = _rand((300, 64), seed=26)
    old = get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            set_num_threads(n)
            outs.append(mx.vjp(lambda a, b: fu.rms_norm(a, b, 1e-5), [x, w], [cot]))
            mx.eval(outs[-1])
    finally:
        set_num_threads(old)
    (y1, (dx1, dw1)), (y2, (dx2, dw2)) = [(o[0][0], o[1]) for o in outs]
    for a, b in ((y1, y2), (dx1, dx2), (dw1, dw2)):
        assert mx.array_equal(a, b)


@native
def test_other_dtypes_use_the_mlx_ops():
    """float16 inputs are not native: the same formula in MLX ops, in the input dtype."""
    x = _rand((4, 8), seed=27).astype(mx.float16)
    y = fu.rms_norm(x, None, 1e-5)
    assert y.dtype == mx.float16 and not any(p.startswith("Metalnn") for p in primitives(y))
    _close(y, t_rms_norm(_t(x.astype(mx.float32)), None, 1e-5), 1e-2, 1e-2)


# ----------------------------------------------------------------------------- the functional ops


@native
def test_auto_ops_use_the_fused_primitives_and_reference_does_not():
    x = _rand((2, 3, 8, 16), seed=30)
    w = _rand((16,), seed=31)
    logits, tg = _rand((6, 9), seed=32), mx.array([0, 3, 8, 1, 1, 2], dtype=mx.int32)
    auto, ref = mn.Device(kernels="auto"), mn.Device(kernels="reference")
    for device, want in ((auto, True), (ref, False)):
        outs = [F.rms_norm(x, w, device=device), F.rope(x, 16, device=device),
                F.attention(x, x, x, device=device), F.gated_activation(x, x, "silu", device=device),
                mn.losses.cross_entropy(logits, tg, device=device)]
        names = primitives(*outs)
        for p in ("MetalnnRMSNorm", "MetalnnRoPE", "MetalnnScaledSoftmax", "MetalnnGated", "MetalnnCrossEntropy"):
            assert (p in names) == want, (device.kernels, p, names)


@pytest.mark.parametrize("rep", [1, 3])
def test_attention_auto_matches_torch_with_gqa(rep):
    q = _rand((2, 2 * rep, 13, 16), seed=33)
    k, v = _rand((2, 2, 13, 16), seed=34), _rand((2, 2, 13, 16), seed=35)
    cot = _rand((2, 2 * rep, 13, 16), seed=36)
    y, grads = _value_and_grads(lambda a, b, c: F.attention(a, b, c, device=mn.Device()), [q, k, v], cot, (0, 1, 2))
    ty, tgrads = _torch_grads(lambda a, b, c: TF.scaled_dot_product_attention(
        a, b.repeat_interleave(rep, 1), c.repeat_interleave(rep, 1), is_causal=True), [q, k, v], cot)
    _close(F.attention(q, k, v, device=mn.Device()), ty)
    for g, tg in zip(grads, tgrads):
        _close(g, tg, GRAD_RTOL, GRAD_ATOL)


# ----------------------------------------------------------------------------- AdamW


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_update_matches_torch(weight_decay, path):
    """With bias correction, mlx's AdamW formula is torch.optim.AdamW's: five steps agree."""
    rng = np.random.default_rng(40)
    p0 = rng.standard_normal((7, 33)).astype(np.float32)
    grads = [rng.standard_normal((7, 33)).astype(np.float32) for _ in range(5)]
    tp = torch.tensor(p0.astype(np.float64), requires_grad=True)
    topt = torch.optim.AdamW([tp], lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    p, m, v = mx.array(p0), mx.zeros((7, 33)), mx.zeros((7, 33))
    for t, g in enumerate(grads, 1):
        tp.grad = torch.tensor(g.astype(np.float64))
        topt.step()
        p, m, v = fu.adamw_update(p, mx.array(g), m, v, 0.05, t, betas=(0.8, 0.95), eps=1e-6,
                                  weight_decay=weight_decay, bias_correction=True)
    # five float32 steps of size ~lr: a few ulps of the parameters each
    _close(p, tp, 1e-5, 1e-6)
    _expect(path, lambda: fu.adamw_update(p, mx.array(grads[0]), m, v, 0.05, 6, bias_correction=True),
            {"MetalnnAdamW"})


@pytest.mark.parametrize("bias_correction", [False, True])
def test_adamw_optimizer_is_mlx_adamw(bias_correction, path):
    """metalnn.optimizers.AdamW gives mlx.optimizers.AdamW's parameters and state (same keys)."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_map

    mx.random.seed(3)
    a = nn.Sequential(nn.Linear(9, 16), nn.Linear(16, 4))
    b = nn.Sequential(nn.Linear(9, 16), nn.Linear(16, 4))
    b.update(tree_map(lambda x: x, a.parameters()))
    oa = optim.AdamW(0.02, bias_correction=bias_correction)
    ob = mn.optimizers.AdamW(0.02, bias_correction=bias_correction)
    loss = lambda m, x: (m(x) ** 2).mean()  # noqa: E731
    for i in range(4):
        x = _rand((5, 9), seed=50 + i)
        oa.update(a, nn.value_and_grad(a, loss)(a, x)[1])
        ob.update(b, nn.value_and_grad(b, loss)(b, x)[1])
    for (ka, va), (kb, vb) in zip(tree_flatten(a.parameters()), tree_flatten(b.parameters())):
        assert ka == kb
        _close(vb, np.array(va), 1e-5, 1e-6, what=ka)
    sa, sb = dict(tree_flatten(oa.state)), dict(tree_flatten(ob.state))
    assert sa.keys() == sb.keys()
    for k in sa:
        _close(sb[k], np.array(sa[k]), 1e-5, 1e-6, what=k)


# ----------------------------------------------------------------------------- a compiled training step


def test_compiled_training_step_matches_the_reference():
    """A Llama with custom RoPE periods (llama3 scaling: the periods are a traced array under the
    Trainer's mx.compile), SwiGLU, GQA and metalnn's AdamW: "auto" (the fused CPU primitives) and
    "reference" (plain MLX ops) give the same losses. The first loss (same parameters) within
    float32 rounding of sums in another order: 1e-5 relative. Later ones within 1e-4: Adam's
    first updates are about lr * sign(g), so a gradient component within rounding of 0 can move
    its weight by 2 lr in one implementation and not the other."""
    cfg = mn.models.llama_config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=96,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    batch = np.random.default_rng(60).integers(0, 64, (2, 17)).astype(np.int32)
    losses = {}
    for kernels in ("auto", "reference"):
        model = mn.models.from_config(cfg, seed=0)
        device = mn.Device(seed=0, kernels=kernels)

        def loss_fn(model, b, device):
            return mn.losses.cross_entropy(model.compile(device, mn.Data(b[0])).array, b[1], device=device)

        trainer = mn.Trainer(model, mn.optimizers.AdamW(3e-3), loss_fn, device=device, progress=False)
        losses[kernels] = [trainer.step((mx.array(batch[:, :-1]), mx.array(batch[:, 1:]))) for _ in range(4)]
    np.testing.assert_allclose(losses["auto"][0], losses["reference"][0], rtol=1e-5)
    np.testing.assert_allclose(losses["auto"], losses["reference"], rtol=1e-4)
    assert losses["auto"][-1] < losses["auto"][0]

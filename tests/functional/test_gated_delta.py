"""F.gated_delta_rule (reference recurrent and chunked forms, the native CPU form, emulated Metal
kernels) against transformers' ``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule``.

Inputs follow fla's test recipe: q, k L2-normalised, ``g = logsigmoid(rand)``, ``beta = sigmoid(rand)``,
a random initial state; gradients of ``(o * do).sum() + (ht * dht).sum()``.

Two oracles:

* a float64 copy of the recurrence (`naive64`, torch autograd): every output and gradient
  elementwise within rtol 1e-4, atol 1e-5. The float32 paths sum at most a few hundred terms of
  order 1 per element (T <= 37 tokens, K <= 40), so their rounding error is ~1e-6; 1e-4 relative
  still catches a wrong decay, index or sign (errors of order 1e-1).
* transformers' float32 functions (which compute in float32 whatever the input dtype): their own
  rounding is of the same order as ours, so the comparison uses fla's ``assert_close`` rule
  (max |diff| <= 1e-6, else relative RMS error ``||ref - x|| / ||ref||`` below 0.002 for o and the
  final state, 0.008 for dq, dk, dv, dh0, 0.02 for dbeta, dg).
"""

import importlib

import mlx.core as mx
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import metalnn as mn
from metalnn import functional as F
from metalnn.cpu import gated_delta as native_gd

from kernel_cases import GATED_DELTA_SHAPES, emulate, reference, spy_launches
from native_platform import require_native

import transformers.models.qwen3_next.modeling_qwen3_next as hf  # noqa: E402

TOLS = {"o": 0.002, "ht": 0.002, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02, "dh0": 0.008}
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def assert_close(name, ref, got, ratio):
    ref = np.asarray(ref, np.float64)
    got = np.asarray(got, np.float64)
    assert ref.shape == got.shape, (name, ref.shape, got.shape)
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    diff = np.abs(ref - got).max()
    if diff <= 1e-6:
        return
    err = np.linalg.norm(ref - got) / max(np.linalg.norm(ref), 1e-30)
    assert err < ratio, f"{name}: max |diff| {diff:.3g}, relative RMS error {err:.3g} >= {ratio}"


def make_inputs(B, T, Hk, Hv, K, V, seed=0, h0=True):
    gen = torch.Generator().manual_seed(seed)
    q = TF.normalize(torch.randn(B, T, Hk, K, generator=gen), dim=-1)
    k = TF.normalize(torch.randn(B, T, Hk, K, generator=gen), dim=-1)
    v = torch.randn(B, T, Hv, V, generator=gen)
    g = TF.logsigmoid(torch.rand(B, T, Hv, generator=gen))
    beta = torch.rand(B, T, Hv, generator=gen).sigmoid()
    state = torch.randn(B, Hv, K, V, generator=gen) if h0 else None
    do = torch.randn(B, T, Hv, V, generator=gen)
    dht = torch.randn(B, Hv, K, V, generator=gen)
    return [q, k, v, g, beta, state], do, dht


def naive64(q, k, v, g, beta, h0, l2=False):
    """The recurrence of transformers' torch_recurrent_gated_delta_rule, in float64 throughout."""
    q, k, v, g, beta = (x.transpose(1, 2) for x in (q, k, v, g, beta))
    r = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(r, 1), k.repeat_interleave(r, 1)
    if l2:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q / q.shape[-1] ** 0.5
    B, H, T, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=q.dtype) if h0 is None else h0
    outs = []
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        kv = (S * k[:, :, t, :, None]).sum(-2)
        S = S + k[:, :, t, :, None] * ((v[:, :, t] - kv) * beta[:, :, t, None])[..., None, :]
        outs.append((S * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, 2).transpose(1, 2), S


def torch_reference(fn, inputs, do, dht, **kw):
    """Outputs and gradients of ``fn`` (a transformers function or naive64) on float64 leaves."""
    leaves = [None if x is None else x.double().requires_grad_() for x in inputs]
    o, ht = fn(*leaves, **kw)
    ((o * do.double()).sum() + (ht * dht.double()).sum()).backward()
    grads = [None if x is None else x.grad.numpy() for x in leaves]
    return o.detach().numpy(), ht.detach().numpy(), grads


def metalnn_run(inputs, do, dht, device, mode="auto", chunk_size=64, **kw):
    arrays = [None if x is None else mx.array(x.numpy()) for x in inputs]
    do_m, dht_m = mx.array(do.numpy()), mx.array(dht.numpy())
    has_h0 = arrays[5] is not None

    def loss(*a):
        h0 = a[5] if has_h0 else None
        o, ht = F.gated_delta_rule(*a[:5], initial_state=h0, chunk_size=chunk_size, mode=mode, device=device, **kw)
        return (o * do_m).sum() + (ht * dht_m).sum(), (o, ht)

    args = arrays if has_h0 else arrays[:5]
    (_, (o, ht)), grads = mx.value_and_grad(loss, argnums=tuple(range(len(args))))(*args)
    return np.array(o), np.array(ht), [np.array(x) for x in grads]


def check_all(ref, got):
    """fla's rule, for references computed in float32 (transformers)."""
    o_r, ht_r, g_r = ref
    o_g, ht_g, g_g = got
    assert_close("o", o_r, o_g, TOLS["o"])
    assert_close("ht", ht_r, ht_g, TOLS["ht"])
    for name, a, b in zip(GRAD_NAMES, g_r, g_g):
        if a is not None:
            assert_close(name, a, b, TOLS[name])


def check_elementwise(ref64, got):
    """Against the float64 recurrence: every output and gradient elementwise (see the module docstring)."""
    o_r, ht_r, g_r = ref64
    o_g, ht_g, g_g = got
    pairs = [("o", o_r, o_g), ("ht", ht_r, ht_g)] + [(n, a, b) for n, a, b in zip(GRAD_NAMES, g_r, g_g)
                                                      if a is not None]
    assert len(pairs) == 2 + len([a for a in g_r if a is not None])
    for name, a, b in pairs:
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5, err_msg=name)


def hf_recurrent(q, k, v, g, beta, h0, **kw):
    return hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)


def hf_chunk(chunk_size):
    def fn(q, k, v, g, beta, h0, **kw):
        return hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=h0,
                                               output_final_state=True, **kw)
    return fn


SHAPES = GATED_DELTA_SHAPES[:2]   # the third, wide heads: test_kernel_wide_heads_and_several_checkpoints
PATHS = [("reference", "recurrent"), ("reference", "chunk"), ("auto", "native"), ("emulate", "kernel")]


def device_of(kernels):
    return {"reference": reference, "emulate": emulate}.get(kernels, mn.Device)()


KERNELS = {"gated_delta_forward", "gated_delta_backward"}


@pytest.mark.parametrize("kernels,mode", PATHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_transformers(kernels, mode, shape, monkeypatch):
    if mode == "native":
        require_native(native_gd.available(), "the native gated delta rule")
    launches = spy_launches(monkeypatch)
    inputs, do, dht = make_inputs(*shape, seed=sum(shape))
    device = device_of(kernels)
    got = metalnn_run(inputs, do, dht, device, mode=mode, chunk_size=16)
    assert launches.names() == (KERNELS if kernels == "emulate" else set())
    check_elementwise(torch_reference(naive64, inputs, do, dht), got)
    hf_fn = hf_chunk(16) if mode == "chunk" else hf_recurrent
    check_all(torch_reference(hf_fn, inputs, do, dht), got)


@pytest.mark.parametrize("kernels,mode", PATHS)
def test_l2norm_in_kernel_no_initial_state(kernels, mode):
    """Unnormalised q/k with use_qk_l2norm_in_kernel=True (as Qwen3-Next calls it), h0 = None."""
    if mode == "native":
        require_native(native_gd.available(), "the native gated delta rule")
    inputs, do, dht = make_inputs(1, 9, 1, 2, 8, 4, seed=3, h0=False)
    inputs[0] = inputs[0] * 3.0
    inputs[1] = inputs[1] * 0.5 + 0.1
    device = device_of(kernels)
    got = metalnn_run(inputs, do, dht, device, mode=mode, chunk_size=4, use_qk_l2norm_in_kernel=True)
    check_elementwise(torch_reference(naive64, inputs, do, dht, l2=True), got)
    check_all(torch_reference(hf_recurrent, inputs, do, dht, use_qk_l2norm_in_kernel=True), got)


def test_kernel_wide_heads_and_several_checkpoints(monkeypatch):
    """K = 40 (two registers per lane, lanes past K idle), V = 6 (six SIMD groups), T = 35 (3 checkpoints)."""
    launches = spy_launches(monkeypatch)
    inputs, do, dht = make_inputs(*GATED_DELTA_SHAPES[2], seed=7)
    got = metalnn_run(inputs, do, dht, emulate())
    assert launches.names() == KERNELS
    assert {launch.template["NK"] for launch in launches} == {2}
    assert {launch.template.get("SG") for launch in launches} == {None, 6}
    check_elementwise(torch_reference(naive64, inputs, do, dht), got)


@pytest.mark.parametrize("lane_order", ["reversed", "shuffled"])
def test_kernel_lane_order_does_not_change_result(lane_order, monkeypatch):
    launches = spy_launches(monkeypatch)
    inputs, do, dht = make_inputs(1, 12, 2, 2, 16, 8, seed=1)
    a = metalnn_run(inputs, do, dht, emulate())
    b = metalnn_run(inputs, do, dht, emulate(lane_order, seed=5))
    for x, y in zip([a[0], a[1], *a[2]], [b[0], b[1], *b[2]]):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
    orders = {(launch.name, launch.options["lane_order"]) for launch in launches}
    assert orders == {(name, order) for name in KERNELS for order in ("forward", lane_order)}


@pytest.mark.parametrize("native", [True, False])
def test_auto_mode_picks_by_device_and_length(native, monkeypatch):
    """mode="auto": the kernels on an emulate device; the recurrence on "reference"; on "auto" the
    native form on the CPU backend with the extension, else the recurrence below 16 tokens and
    the chunked form from there."""
    gd = importlib.import_module("metalnn.functional.gated_delta")
    if native:
        require_native(gd._native_takes(mx.zeros((1, 1, 1, 8)), mx.zeros((1, 1, 1, 4))),
                       "the native gated delta rule (on the CPU backend)")
    if not native:
        monkeypatch.setattr(gd.native, "available", lambda: False)
    calls = []
    for name in ("gated_delta_recurrent", "gated_delta_chunk"):
        real = getattr(gd, name)
        monkeypatch.setattr(gd, name, lambda *a, _r=real, _n=name, **k: (calls.append(_n), _r(*a, **k))[1])
    real_native = gd.native.gated_delta
    monkeypatch.setattr(gd.native, "gated_delta", lambda *a, **k: (calls.append("native"), real_native(*a, **k))[1])
    launches = spy_launches(monkeypatch)
    auto_short, auto_long = ("native", "native") if native else ("gated_delta_recurrent", "gated_delta_chunk")
    for T, device, expected in [(20, reference(), "gated_delta_recurrent"), (8, mn.Device(), auto_short),
                                (20, mn.Device(), auto_long), (20, emulate(), None)]:
        calls.clear()
        launches.clear()
        q, k, v, g, beta, h0 = (mx.array(x.numpy()) for x in make_inputs(1, T, 1, 1, 8, 4, seed=T)[0])
        F.gated_delta_rule(q, k, v, g, beta, initial_state=h0, device=device)
        assert calls == ([expected] if expected else [])
        assert launches.names() == (set() if expected else {"gated_delta_forward"})


@pytest.mark.parametrize("T", [1, 5, 16, 37, 70])
def test_chunk_matches_recurrent(T):
    """T below, equal to and not a multiple of the chunk size; default chunk 64 and chunk 16."""
    inputs, do, dht = make_inputs(2, T, 1, 2, 8, 4, seed=T)
    rec = metalnn_run(inputs, do, dht, reference(), mode="recurrent")
    for cs in (16, 64):
        chk = metalnn_run(inputs, do, dht, reference(), mode="chunk", chunk_size=cs)
        np.testing.assert_allclose(chk[0], rec[0], atol=1e-5, rtol=1e-4)
        np.testing.assert_allclose(chk[1], rec[1], atol=1e-5, rtol=1e-4)
        for a, b in zip(chk[2], rec[2]):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("mode", ["recurrent", "chunk"])
@pytest.mark.parametrize("T", [1, 37, 70])
def test_forward_matches_mlx_fast_gated_delta_update(mode, T):
    """MLX's own op (``mx.fast.gated_delta_update``: decay in linear space, state stored [B, Hv, V, K],
    q taken as given) as a second, independent oracle of the forward pass: grouped heads, an initial
    state, lengths below and across the chunk size. Both are float32 sums of a few hundred terms of
    order 1 per element, so 1e-5 absolute / 1e-4 relative leaves room for rounding only."""
    inputs, _, _ = make_inputs(2, T, 2, 4, 32, 16, seed=T)
    q, k, v, g, beta, h0 = (mx.array(x.numpy()) for x in inputs)
    o, ht = F.gated_delta_rule(q, k, v, g, beta, initial_state=h0, mode=mode, scale=1.0, device=reference())
    o_mlx, ht_mlx = mx.fast.gated_delta_update(q, k, v, mx.exp(g), beta, h0.transpose(0, 1, 3, 2))
    np.testing.assert_allclose(np.array(o), np.array(o_mlx), atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(np.array(ht), np.array(ht_mlx.transpose(0, 1, 3, 2)), atol=1e-5, rtol=1e-4)


def test_state_carries_across_calls():
    """Running two halves with the state passed along equals one call (reference and kernel)."""
    inputs, _, _ = make_inputs(1, 10, 1, 1, 8, 4, seed=11)
    q, k, v, g, beta, h0 = (mx.array(x.numpy()) for x in inputs)
    for device in (reference(), emulate()):
        o, ht = F.gated_delta_rule(q, k, v, g, beta, initial_state=h0, device=device)
        o1, h1 = F.gated_delta_rule(q[:, :6], k[:, :6], v[:, :6], g[:, :6], beta[:, :6], h0, device=device)
        o2, h2 = F.gated_delta_rule(q[:, 6:], k[:, 6:], v[:, 6:], g[:, 6:], beta[:, 6:], h1, device=device)
        np.testing.assert_allclose(np.array(mx.concatenate([o1, o2], axis=1)), np.array(o), atol=1e-5)
        np.testing.assert_allclose(np.array(h2), np.array(ht), atol=1e-5)


def test_dtypes_and_options():
    inputs, _, _ = make_inputs(1, 20, 1, 1, 8, 4, seed=2)
    q, k, v, g, beta, h0 = (mx.array(x.numpy()) for x in inputs)
    o, ht = F.gated_delta_rule(q.astype(mx.bfloat16), k.astype(mx.bfloat16), v.astype(mx.bfloat16), g, beta,
                               device=reference())
    assert o.dtype == mx.bfloat16 and ht.dtype == mx.float32
    o32, _ = F.gated_delta_rule(q, k, v, g, beta, device=reference())
    np.testing.assert_allclose(np.array(o.astype(mx.float32)), np.array(o32), atol=5e-2)
    o, ht = F.gated_delta_rule(q, k, v, g, beta, output_final_state=False, device=reference())
    assert ht is None
    o_s, _ = F.gated_delta_rule(q, k, v, g, beta, scale=1.0, device=reference())
    o_d, _ = F.gated_delta_rule(q * 8 ** 0.5, k, v, g, beta, device=reference())
    np.testing.assert_allclose(np.array(o_s), np.array(o_d), atol=1e-5)


@pytest.mark.parametrize("mode", ["recurrent", "chunk", "native"])
def test_plain_forms_compile(mode):
    if mode == "native":
        require_native(native_gd.available(), "the native gated delta rule")
    inputs, _, _ = make_inputs(1, 20, 1, 1, 8, 4, seed=4)
    args = [mx.array(x.numpy()) for x in inputs]

    def f(*a):
        return F.gated_delta_rule(*a[:5], initial_state=a[5], chunk_size=8, mode=mode, device=mn.Device())

    eager = f(*args)
    compiled = mx.compile(f)(*args)
    for a, b in zip(eager, compiled):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-6)


def test_bad_arguments_are_reported():
    q = mx.zeros((1, 4, 2, 8))
    v = mx.zeros((1, 4, 3, 4))
    g = mx.zeros((1, 4, 3))
    with pytest.raises(ValueError, match="multiple of key heads"):
        F.gated_delta_rule(q, q, v, g, g, device=reference())
    v = mx.zeros((1, 4, 2, 4))
    with pytest.raises(ValueError, match="g must have shape"):
        F.gated_delta_rule(q, q, v, g, mx.zeros((1, 4, 2)), device=reference())
    g = mx.zeros((1, 4, 2))
    with pytest.raises(ValueError, match="initial_state must have shape"):
        F.gated_delta_rule(q, q, v, g, g, initial_state=mx.zeros((1, 2, 4, 8)), device=reference())
    with pytest.raises(ValueError, match="mode must be one of"):
        F.gated_delta_rule(q, q, v, g, g, mode="fast", device=reference())
    with pytest.raises(ValueError, match="needs a device with kernels"):
        F.gated_delta_rule(q, q, v, g, g, mode="kernel", device=reference())
    with pytest.raises(ValueError, match="value head dimension of at most"):
        F.gated_delta_rule(q, q, mx.zeros((1, 4, 2, 1025)), g, g, mode="native", device=mn.Device())
    assert isinstance(F.gated_delta_rule(q, q, v, g, g, device=mn.Device(kernels="reference"))[0], mx.array)

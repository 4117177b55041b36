"""F.ssd_scan (Mamba2's SSD scan: the reference recurrent and chunked forms, the emulated Metal
kernels) against a float64 per-step recurrence and against transformers' ``mamba2_chunk_scan`` /
``mamba2_selective_state_update`` (the torch code of ``GraniteMoeHybridMambaLayer`` /
``Mamba2Mixer``).

Inputs: x, B, C, h0 standard normal, ``dt`` in [0.05, 0.8], ``A`` in [-2, -0.5], random D;
gradients of ``(y * dy).sum() + (ht * dht).sum()`` in every input.

Tolerance: 1e-4 relative to the largest entry of each reference output or gradient. The float32
paths sum at most a few hundred terms of order 1 per element (T <= 37, N <= 40), so their rounding
error is ~1e-6 relative; a wrong decay, index, group or sign gives errors of order 1e-1.
"""

import mlx.core as mx
import numpy as np
import pytest
import torch

from metalnn import functional as F
from metalnn.kernels import ssd as ssd_kernels

from kernel_cases import emulate, reference, spy_launches

from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf  # noqa: E402

TOL = 1e-4
NAMES = ("x", "dt", "A", "B", "C", "D", "h0")
#: (B, T, H, P, G, N): one token; heads sharing groups, T not a multiple of the chunk or checkpoint;
#: several checkpoints; P not a multiple of the SIMD groups, N over one register (N > 32); one group
SHAPES = [(1, 1, 1, 1, 1, 1), (2, 19, 4, 6, 2, 5), (1, 37, 2, 3, 1, 7), (1, 17, 3, 5, 3, 40), (2, 2, 2, 8, 1, 33)]


def inputs(b, t, h, p, g, n, seed=0):
    rng = np.random.default_rng(seed)
    arrays = dict(x=rng.normal(size=(b, t, h, p)), dt=rng.uniform(0.05, 0.8, (b, t, h)), A=-rng.uniform(0.5, 2, (h,)),
                  B=rng.normal(size=(b, t, g, n)), C=rng.normal(size=(b, t, g, n)), D=rng.normal(size=(h,)),
                  h0=rng.normal(size=(b, h, p, n)), dy=rng.normal(size=(b, t, h, p)),
                  dht=rng.normal(size=(b, h, p, n)))
    return {k: v.astype(np.float32) for k, v in arrays.items()}


def naive64(a):
    """The recurrence in float64 torch, differentiated by torch: outputs and gradients."""
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k not in ("dy", "dht")) for k, v in a.items()}
    h, g = t["x"].shape[2], t["B"].shape[2]
    Bh = t["B"].repeat_interleave(h // g, dim=2)
    Ch = t["C"].repeat_interleave(h // g, dim=2)
    S = t["h0"]
    ys = []
    for i in range(t["x"].shape[1]):
        dt = t["dt"][:, i]                                                  # [b, h]
        S = torch.exp(dt * t["A"])[..., None, None] * S + (dt[..., None] * t["x"][:, i])[..., None] * Bh[:, i][:, :, None]
        ys.append((S @ Ch[:, i][..., None])[..., 0] + t["D"][:, None] * t["x"][:, i])
    y = torch.stack(ys, 1)
    ((y * t["dy"]).sum() + (S * t["dht"]).sum()).backward()
    out = {"y": y.detach().numpy(), "ht": S.detach().numpy()}
    out.update({"d" + k: t[k].grad.numpy() for k in NAMES})
    return out


def run(a, device, mode="auto", chunk_size=8):
    def loss(*args):
        y, ht = F.ssd_scan(*args[:6], initial_state=args[6], mode=mode, chunk_size=chunk_size, device=device)
        return (y * mx.array(a["dy"])).sum() + (ht * mx.array(a["dht"])).sum(), (y, ht)

    (_, (y, ht)), grads = mx.value_and_grad(loss, argnums=tuple(range(7)))(*(mx.array(a[k]) for k in NAMES))
    out = {"y": np.array(y), "ht": np.array(ht)}
    out.update({"d" + k: np.array(gr) for k, gr in zip(NAMES, grads)})
    return out


def rel_close(got, want, name):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
    assert err < TOL, f"{name}: max error {err:.3g} relative to max |ref|"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", ["recurrent", "chunk", "kernel"])
def test_forms_match_float64_recurrence(shape, form):
    a = inputs(*shape, seed=sum(shape))
    want = naive64(a)
    got = run(a, emulate() if form == "kernel" else reference(), mode=form)
    for name in want:
        rel_close(got[name], want[name], name)


@pytest.mark.parametrize("T,chunk", [(19, 8), (16, 16), (5, 256)])
def test_chunk_and_step_match_transformers(T, chunk):
    """Forward and final state against ``mamba2_chunk_scan``; then one more token through the cache
    against ``mamba2_selective_state_update``."""
    b, h, p, g, n = 2, 4, 6, 2, 5
    a = inputs(b, T + 1, h, p, g, n, seed=T)
    t = {k: torch.tensor(v) for k, v in a.items()}
    y_t, s_t = hf.mamba2_chunk_scan(t["x"][:, :T], t["dt"][:, :T], t["A"], t["B"][:, :T], t["C"][:, :T],
                                    chunk_size=chunk, D=t["D"], initial_states=t["h0"], return_final_states=True)
    m = {k: mx.array(v) for k, v in a.items()}
    y, s = F.ssd_scan(m["x"][:, :T], m["dt"][:, :T], m["A"], m["B"][:, :T], m["C"][:, :T], m["D"],
                      initial_state=m["h0"], mode="chunk", chunk_size=chunk, device=reference())
    rel_close(y, y_t.numpy(), "y")
    rel_close(s, s_t.numpy(), "state")

    # the step: transformers takes dt before softplus with a bias; softplus^-1(dt) with no bias gives our dt
    state = s_t.clone()
    dt_raw = torch.log(torch.expm1(t["dt"][:, T]))[..., None].expand(b, h, p)
    y1_t = hf.mamba2_selective_state_update(
        state, t["x"][:, T], dt_raw, t["A"][:, None, None].expand(h, p, n), t["B"][:, T], t["C"][:, T],
        t["D"][:, None].expand(h, p), dt_softplus=True)
    y1, s1 = F.ssd_scan(m["x"][:, T:], m["dt"][:, T:], m["A"], m["B"][:, T:], m["C"][:, T:], m["D"],
                        initial_state=s, device=reference())
    rel_close(y1[:, 0], y1_t.numpy(), "y step")
    rel_close(s1, state.numpy(), "state step")


@pytest.mark.parametrize("lane_order", ["forward", "reversed", "shuffled"])
def test_kernel_atomics_in_any_lane_order(lane_order):
    """The backward kernel's atomic sums do not depend on the order the lanes run in."""
    a = inputs(1, 9, 4, 8, 2, 6, seed=3)
    want = run(a, reference(), mode="recurrent")
    got = run(a, emulate(lane_order=lane_order, seed=1), mode="kernel")
    for name in want:
        rel_close(got[name], want[name], name)


def test_auto_choice(monkeypatch):
    launches = spy_launches(monkeypatch)
    a = inputs(1, 3, 2, 4, 1, 4)
    run(a, emulate())
    assert {"ssd_forward", "ssd_backward"} <= launches.names()
    launches.clear()
    run(a, reference())
    assert not launches


def test_wide_states_take_another_path(monkeypatch):
    """N beyond MAX_N never reaches the kernels: the emulate device runs the MLX-op form."""
    launches = spy_launches(monkeypatch)
    a = inputs(1, 3, 1, 2, 1, ssd_kernels.MAX_N + 1, seed=4)
    got, want = run(a, emulate()), run(a, reference())
    assert not launches
    for name in want:
        rel_close(got[name], want[name], name)
    with pytest.raises(ValueError, match="state size of at most 256"):
        F.ssd_scan(*(mx.array(a[k]) for k in NAMES[:6]), mode="kernel", device=emulate())


def test_empty_sequence_keeps_the_state():
    a = inputs(1, 0, 2, 3, 1, 4)
    for device, mode in ((reference(), "chunk"), (reference(), "recurrent"), (emulate(), "kernel")):
        y, s = F.ssd_scan(*(mx.array(a[k]) for k in NAMES[:6]), initial_state=mx.array(a["h0"]), mode=mode,
                          device=device)
        assert y.shape == (1, 0, 2, 3)
        np.testing.assert_array_equal(np.array(s), a["h0"])


@pytest.mark.parametrize("bad,match", [
    (dict(dt=np.zeros((1, 3, 3), np.float32)), r"dt must have shape \(1, 3, 2\)"),
    (dict(B=np.zeros((1, 3, 3, 4), np.float32), C=np.zeros((1, 3, 3, 4), np.float32)),
     r"heads \(2\) must be a multiple of groups \(3\)"),
    (dict(A=np.zeros((3,), np.float32)), r"A must have shape \(2,\)"),
])
def test_shape_errors_name_the_tensor(bad, match):
    a = inputs(1, 3, 2, 3, 1, 4)
    a.update(bad)
    with pytest.raises(ValueError, match=match):
        F.ssd_scan(*(mx.array(a[k]) for k in NAMES[:6]), device=reference())
    with pytest.raises(ValueError, match="mode must be one of"):
        F.ssd_scan(*(mx.array(inputs(1, 3, 2, 3, 1, 4)[k]) for k in NAMES[:6]), mode="fast")

"""metalnn.functional.attention and the attention layers, checked against PyTorch, on the
"reference" and the "auto" implementations.

References: torch.nn.functional.scaled_dot_product_attention (independent implementation, with
enable_gqa) and a float64 NumPy softmax written out here. Tolerance: float32 inputs of unit scale;
scores are dot products of <= 128 terms, so 2e-5 abs/rel covers rounding of two fp32 paths.
"""

import math

import mlx.core as mx
import numpy as np
import pytest
import torch

import metalnn as mn
import metalnn.functional as F

ATOL = RTOL = 2e-5


@pytest.fixture(params=["reference", "auto"])
def device(request):
    device = mn.Device(kernels=request.param, seed=0)
    assert device.kernels == request.param
    return device


def _qkv(rng, b, hq, hkv, tq, tk, d):
    q = rng.standard_normal((b, hq, tq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, tk, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, tk, d)).astype(np.float32)
    return q, k, v


def naive(q, k, v, scale, causal, offset=None, mask=None):
    """float64 NumPy attention; query i sits at position offset + i (default Tk - Tq)."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    tq, tk = q.shape[2], k.shape[2]
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    if causal:
        off = tk - tq if offset is None else offset
        allowed = np.arange(tk)[None, :] <= (np.arange(tq)[:, None] + off)
        s = np.where(allowed, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return p @ v


CASES = [(t, d, causal, rep) for t in (1, 7, 64, 130) for d in (32, 64, 80, 128) for causal in (True, False)
         for rep in (1, 4)]


@pytest.mark.parametrize("t,d,causal,rep", CASES)
def test_attention_matches_torch_forward_and_grads(t, d, causal, rep, device):
    rng = np.random.default_rng(t * 1000 + d + rep)
    hkv = 2
    q, k, v = _qkv(rng, 2, hkv * rep, hkv, t, t, d)
    scale = 1.0 / math.sqrt(d)
    cot = rng.standard_normal(q.shape).astype(np.float32)

    def f(q_, k_, v_):
        return (F.attention(q_, k_, v_, causal=causal, device=device) * mx.array(cot)).sum()

    out = F.attention(mx.array(q), mx.array(k), mx.array(v), causal=causal, device=device)
    gq, gk, gv = mx.grad(f, argnums=(0, 1, 2))(mx.array(q), mx.array(k), mx.array(v))

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal and t > 1, scale=scale,
                                                           enable_gqa=rep > 1)
    (ref * torch.tensor(cot)).sum().backward()

    np.testing.assert_allclose(np.array(out), ref.detach().numpy(), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(np.array(out), naive(q, k, v, scale, causal), atol=ATOL, rtol=RTOL)
    for g, r in ((gq, tq), (gk, tk), (gv, tv)):
        np.testing.assert_allclose(np.array(g), r.grad.numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rep", [1, 4])
def test_attention_decoding_offset(rep, device):
    """Queries that are the last Tq of Tk positions (KV-cache decoding), default and explicit offset."""
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 1, 2 * rep, 2, 3, 11, 32)
    scale = 1 / math.sqrt(32)
    ref = naive(q, k, v, scale, True)
    for off in (None, 8):
        out = F.attention(mx.array(q), mx.array(k), mx.array(v), offset=off, device=device)
        np.testing.assert_allclose(np.array(out), ref, atol=ATOL, rtol=RTOL)
    # A smaller offset hides the keys after each query (unused slots of a preallocated cache).
    out = F.attention(mx.array(q), mx.array(k), mx.array(v), offset=4, device=device)
    np.testing.assert_allclose(np.array(out), naive(q, k, v, scale, True, offset=4), atol=ATOL, rtol=RTOL)
    # The same as attending over only the first 7 keys.
    np.testing.assert_allclose(np.array(out), naive(q, k[:, :, :7], v[:, :, :7], scale, True), atol=ATOL,
                               rtol=RTOL)


def test_attention_mask_and_scale(device):
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, 2, 4, 4, 9, 9, 16)
    mask = rng.random((2, 1, 9, 9)) > 0.3
    mask[..., 0] = True  # every row keeps at least one key
    for causal in (True, False):
        out = F.attention(mx.array(q), mx.array(k), mx.array(v), scale=0.5, causal=causal, mask=mx.array(mask),
                          device=device)
        np.testing.assert_allclose(np.array(out), naive(q, k, v, 0.5, causal, mask=mask), atol=ATOL, rtol=RTOL)
    additive = np.where(mask, 0.0, -1e9).astype(np.float32)
    out = F.attention(mx.array(q), mx.array(k), mx.array(v), causal=True, mask=mx.array(additive), device=device)
    np.testing.assert_allclose(np.array(out), naive(q, k, v, 0.25, True, mask=mask), atol=ATOL, rtol=RTOL)
    out_naive = F.attention_reference(mx.array(q), mx.array(k), mx.array(v), causal=True, mask=mx.array(mask))
    np.testing.assert_allclose(np.array(out_naive), naive(q, k, v, 0.25, True, mask=mask), atol=ATOL, rtol=RTOL)


def test_attention_shape_errors(device):
    q = mx.zeros((1, 3, 4, 8))
    with pytest.raises(ValueError, match="multiple"):
        F.attention(q, mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)), device=device)
    with pytest.raises(ValueError, match="head_dim"):
        F.attention(q, mx.zeros((1, 3, 4, 4)), mx.zeros((1, 3, 4, 4)), device=device)
    with pytest.raises(ValueError, match=r"\[B, heads, T, head_dim\]"):
        F.attention(q[0], q[0], q[0], device=device)


def _torch_self_attention(x, p, n_heads, n_kv, hd, base, rope=True):
    """Llama attention spelled out in torch (rotate-half RoPE unless ``rope`` is False, GQA by
    repeat_interleave)."""
    b, t, _ = x.shape
    q = (x @ p["q_proj.weight"].T).view(b, t, n_heads, hd).transpose(1, 2)
    k = (x @ p["k_proj.weight"].T).view(b, t, n_kv, hd).transpose(1, 2)
    v = (x @ p["v_proj.weight"].T).view(b, t, n_kv, hd).transpose(1, 2)
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rot(a):
        a1, a2 = a[..., :hd // 2], a[..., hd // 2:]
        return a * cos + torch.cat([-a2, a1], -1) * sin

    if rope:
        q, k = rot(q), rot(k)
    k = k.repeat_interleave(n_heads // n_kv, dim=1)
    v = v.repeat_interleave(n_heads // n_kv, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(b, t, -1) @ p["o_proj.weight"].T


@pytest.mark.parametrize("n_kv", [4, 1])
def test_self_attention_layer_matches_torch(n_kv, device):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 13, 32)).astype(np.float32)
    layer = mn.SelfAttention(4, num_kv_heads=n_kv, rope_base=1000.0)
    out = layer.compile(device, mn.Data(mx.array(x)))
    assert out.dims == mn.MTLSize(32, 13, 2)
    params = {k: torch.tensor(np.array(v)) for k, v in layer.for_update().items()}
    assert params["k_proj.weight"].shape == (n_kv * 8, 32)
    ref = _torch_self_attention(torch.tensor(x), params, 4, n_kv, 8, 1000.0)
    np.testing.assert_allclose(np.array(out.array), ref.numpy(), atol=1e-5, rtol=1e-5)


def test_transformer_block_without_rope(device):
    """``TransformerBlock(rope=False)`` (SmolLM3's NoPE layers): attention without position
    embeddings, as the torch reference without its rotation; cached decoding equals the full pass."""
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 9, 32)).astype(np.float32)
    block = mn.TransformerBlock(4, 48, num_kv_heads=2, rope=False)
    full = block.compile(device, mn.Data(mx.array(x))).array
    attn = block.self_attn
    assert not attn.use_rope
    params = {k: torch.tensor(np.array(v)) for k, v in attn.for_update().items()}
    n1 = np.array(block.input_layernorm.compile(device, mn.Data(mx.array(x))).array)
    ref = _torch_self_attention(torch.tensor(n1), params, 4, 2, 8, 10000.0, rope=False)
    np.testing.assert_allclose(np.array(attn.compile(device, mn.Data(mx.array(n1))).array), ref.numpy(), atol=1e-5,
                               rtol=1e-5)
    rotated = _torch_self_attention(torch.tensor(n1), params, 4, 2, 8, 10000.0)
    assert np.abs(rotated.numpy() - ref.numpy()).max() > 1e-3  # (RoPE would have changed it)
    cache = mn.KVCache()
    parts = [block.compile(device, mn.Data(mx.array(x[:, :5])), cache=cache).array]
    parts += [block.compile(device, mn.Data(mx.array(x[:, i:i + 1])), cache=cache).array for i in range(5, 9)]
    np.testing.assert_allclose(np.array(mx.concatenate(parts, axis=1)), np.array(full), atol=1e-5, rtol=1e-5)


def test_self_attention_kv_cache_equals_full(device):
    rng = np.random.default_rng(8)
    x = mx.array(rng.standard_normal((2, 10, 32)).astype(np.float32))
    layer = mn.SelfAttention(4, num_kv_heads=2, bias=True)
    full = layer.compile(device, mn.Data(x)).array
    cache = mn.KVCache()
    parts = [layer.compile(device, mn.Data(x[:, :6]), cache=cache).array]
    for i in range(6, 10):
        parts.append(layer.compile(device, mn.Data(x[:, i:i + 1]), cache=cache).array)
    assert cache.offset == 10
    np.testing.assert_allclose(np.array(mx.concatenate(parts, axis=1)), np.array(full), atol=1e-5, rtol=1e-5)


def test_kv_cache_grows_past_block():
    cache = mn.KVCache()
    cache.step = 4
    chunks = [mx.full((1, 1, n, 2), float(i)) for i, n in enumerate([3, 1, 2, 5])]
    for c in chunks:
        k, v = cache.update_and_fetch(c, -c)
    np.testing.assert_array_equal(np.array(k), np.array(mx.concatenate(chunks, axis=2)))
    np.testing.assert_array_equal(np.array(v), -np.array(mx.concatenate(chunks, axis=2)))
    assert cache.offset == 11 and cache.keys.shape[2] == 12


def test_kv_cache_room_doubles_from_first_then_grows_by_step():
    """A short sequence holds 16, 32, ... positions, not 256; from ``step`` on, multiples of it; the
    positions written before each growth are kept."""
    cache = mn.KVCache()
    rooms, written = [], []
    for i in range(600):
        x = mx.full((1, 2, 1, 4), float(i))
        k, _ = cache.update_and_fetch(x, x)
        written.append(i)
        if not rooms or cache.keys.shape[2] != rooms[-1]:
            rooms.append(cache.keys.shape[2])
    assert rooms == [16, 32, 64, 128, 256, 512, 768]
    np.testing.assert_array_equal(np.array(k)[0, 1, :, 0], np.array(written, dtype=np.float32))
    assert [cache.capacity(n) for n in (1, 16, 17, 200, 256, 257, 700)] == [16, 16, 32, 256, 256, 512, 768]
    prompt = mn.KVCache()
    prompt.update_and_fetch(mx.zeros((1, 2, 300, 4)), mx.zeros((1, 2, 300, 4)))
    assert prompt.keys.shape[2] == 512


def test_self_attention_errors(device):
    with pytest.raises(ValueError, match="multiple"):
        mn.SelfAttention(6, num_kv_heads=4)
    layer = mn.SelfAttention(5)
    with pytest.raises(mn.ShapeError, match="SelfAttention"):
        layer.compile(device, mn.Data(mx.zeros((1, 3, 32))))
    layer = mn.SelfAttention(4)
    layer.compile(device, mn.Data(mx.zeros((1, 3, 32))))
    with pytest.raises(mn.ShapeError, match="W=32"):
        layer.compile(device, mn.Data(mx.zeros((1, 3, 16))))


def test_transformer_block_trains(device):
    """A block's parameters all receive gradients and a few SGD steps lower a regression loss."""
    rng = np.random.default_rng(9)
    x = mx.array(rng.standard_normal((4, 8, 32)).astype(np.float32))
    y = mx.array(rng.standard_normal((4, 8, 32)).astype(np.float32))
    block = mn.TransformerBlock(4, 64, num_kv_heads=2)
    block.compile(device, mn.Data(x))
    import mlx.nn as nn
    import mlx.optimizers as optim

    loss_and_grad = nn.value_and_grad(block, lambda a, b: mx.mean((block(a, device=device) - b) ** 2))
    opt = optim.Adam(1e-2)
    first, grads = loss_and_grad(x, y)
    from mlx.utils import tree_flatten

    assert all(float(mx.abs(g).sum()) > 0 for _, g in tree_flatten(grads))
    for _ in range(20):
        loss, grads = loss_and_grad(x, y)
        opt.update(block, grads)
        mx.eval(block.parameters(), opt.state)
    assert float(loss) < 0.7 * float(first)


def test_softcapped_attention_matches_numpy(device):
    """Gemma 2's soft cap: scores ``cap * tanh(s / cap)`` before the mask; gradients agree with torch."""
    rng = np.random.default_rng(12)
    q, k, v = _qkv(rng, 2, 4, 2, 9, 9, 16)
    q *= 3.0  # scores of several units: the cap of 2 bites
    mask = rng.random((2, 1, 9, 9)) > 0.3
    mask[..., 0] = True

    def capped(q, k, v, scale, causal, mask=None):
        q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
        k64, v64 = np.repeat(k64, 2, axis=1), np.repeat(v64, 2, axis=1)
        s = np.tanh(q64 @ k64.swapaxes(-1, -2) * scale / 2.0) * 2.0
        allowed = np.tril(np.ones((9, 9), bool)) if causal else np.ones((9, 9), bool)
        s = np.where(allowed & (True if mask is None else mask), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v64

    for causal, m in ((True, None), (False, mask)):
        out = F.attention(mx.array(q), mx.array(k), mx.array(v), scale=0.25, causal=causal,
                          mask=None if m is None else mx.array(m), softcap=2.0, device=device)
        np.testing.assert_allclose(np.array(out), capped(q, k, v, 0.25, causal, m), atol=ATOL, rtol=RTOL)
    uncapped = F.attention(mx.array(q), mx.array(k), mx.array(v), scale=0.25, device=device)
    assert np.abs(np.array(uncapped) - capped(q, k, v, 0.25, True)).max() > 1e-2  # the cap matters here
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    s = torch.tanh(tq @ torch.repeat_interleave(tk, 2, 1).transpose(-1, -2) * 0.25 / 2.0) * 2.0
    s = s.masked_fill(~torch.tril(torch.ones(9, 9, dtype=torch.bool)), float("-inf"))
    (torch.softmax(s, -1) @ torch.repeat_interleave(tv, 2, 1)).square().sum().backward()
    grads = mx.grad(lambda a, b, c: mx.sum(F.attention(a, b, c, scale=0.25, softcap=2.0, device=device) ** 2),
                    argnums=(0, 1, 2))(mx.array(q), mx.array(k), mx.array(v))
    for got, want in zip(grads, (tq.grad, tk.grad, tv.grad)):
        np.testing.assert_allclose(np.array(got), want.numpy(), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="softcap must be positive"):
        F.attention(mx.array(q), mx.array(k), mx.array(v), softcap=0.0, device=device)


def test_sandwich_block_caches_and_declines_the_fused_step(device):
    """`SandwichBlock`: norms around both branches' outputs (zero-centred gains), decoding through a
    `KVCache` gives the full pass's outputs; a block with soft-capped attention is not planned for the
    fused decoding step."""
    rng = np.random.default_rng(13)
    x = mx.array(rng.standard_normal((2, 7, 32)).astype(np.float32))
    attn = mn.SelfAttention(4, num_kv_heads=2, head_dim=16, softcap=5.0, sliding_window=3, qk_norm=True,
                            norm_offset=1.0)
    block = mn.SandwichBlock(attn, mn.SwiGLU(48, activation="gelu_tanh"), eps=1e-6, norm_offset=1.0)
    block.compile(device, mn.Data(x))  # builds the layers
    for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        norm = block[name]
        assert norm.offset == 1.0 and float(mx.abs(norm.weight).max()) == 0.0  # gain 1 + 0
        norm.weight = mx.array(rng.uniform(-0.5, 0.5, 32).astype(np.float32))
    full = block.compile(device, mn.Data(x)).array
    h = x + block.post_attention_layernorm(block.self_attn(block.input_layernorm(x, device=device), device=device),
                                           device=device)
    want = h + block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(h, device=device),
                                                          device=device), device=device)
    np.testing.assert_allclose(np.array(full), np.array(want), atol=1e-5)
    cache = mn.KVCache()
    steps = [block.compile(device, mn.Data(x[:, :4]), cache=cache).array]
    steps += [block.compile(device, mn.Data(x[:, i:i + 1]), cache=cache).array for i in range(4, 7)]
    np.testing.assert_allclose(np.array(mx.concatenate(steps, axis=1)), np.array(full), atol=1e-5)
    capped = mn.DecoderBlock(mn.SelfAttention(4, head_dim=8, softcap=5.0), mn.SwiGLU(48))
    plain = mn.DecoderBlock(mn.SelfAttention(4, head_dim=8), mn.SwiGLU(48))
    for b in (capped, plain):
        b.compile(device, mn.Data(x))
    assert capped._step_plan() is None and plain._step_plan() is not None

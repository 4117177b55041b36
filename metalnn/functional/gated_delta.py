"""The gated delta rule (Gated DeltaNet linear attention, as in Qwen3-Next).

Conventions follow Hugging Face transformers' ``torch_recurrent_gated_delta_rule`` /
``torch_chunk_gated_delta_rule`` (which follow flash-linear-attention):

* ``q``, ``k``: ``[B, T, Hk, K]``; ``v``: ``[B, T, Hv, V]``; ``g`` (log-decay, ``<= 0``) and ``beta``:
  ``[B, T, Hv]``; the recurrent state is ``[B, Hv, K, V]`` (K-first) and stays in float32.
* Grouped heads: ``Hv`` must be a multiple of ``Hk``; each q/k head serves ``Hv // Hk`` consecutive
  value heads (``repeat_interleave`` along the head axis).
* Everything is computed in float32; ``o`` comes back in ``q``'s dtype, the final state in float32.
* ``use_qk_l2norm_in_kernel=True`` L2-normalises q and k along the head dim
  (``x * rsqrt(sum(x^2) + 1e-6)``); q is always multiplied by ``scale`` (default ``K ** -0.5``).

Per head and token (``S`` is ``K x V``)::

    S = exp(g_t) * S
    S = S + k_t ((v_t - S^T k_t) * beta_t)^T
    o_t = S^T q_t

Forms (``mode``), all differentiable:

* ``"recurrent"``: the per-token loop above in plain MLX ops (cheapest for short T and decoding).
* ``"chunk"``: the chunked WY form in plain MLX ops: inside chunks of ``chunk_size`` tokens
  everything is matrix products; only the unit lower-triangular inverse and the chunk-to-chunk
  state pass are sequential. Fast for prefill and training.
* ``"native"``: the per-token recurrence as a native CPU primitive
  (`metalnn.cpu.gated_delta`: the (batch, head) pairs in parallel on metalnn's threads, the
  state in cache, checkpoints every 64 tokens for the backward pass); float32 on the CPU backend
  with the extension loaded and a value head dimension of at most 1024. Differentiable once (no
  JVP, vmap or second derivative).
* ``"kernel"``: the Metal kernels of ``metal_kernels/gated_delta.metal`` (forward recurrence with
  state checkpoints, reverse-time backward kernel); needs ``device.kernels`` ``"metal"`` or
  ``"emulate"`` and a key head dimension of at most 256.
* ``"auto"`` picks by ``device.kernels``: ``"reference"`` runs ``"recurrent"`` (the definition);
  ``"auto"`` runs ``"native"`` on the CPU backend where it can (``python
  scripts/bench_gated_delta.py``: B=1, 4 heads, 64x64 state, forward+backward, both sides at their
  default 2 threads on a shared 2-core x86_64, two runs at load average 0.6-1.1: 1.25-2.1x
  transformers' ``torch_chunk_gated_delta_rule`` at T=512, 2.7-3.9x at 2048, 8x at 8192), elsewhere
  ``"recurrent"`` for ``T < 16`` and ``"chunk"`` otherwise (MLX 0.32's own
  ``mx.fast.gated_delta_update``, forward only and the tests' second oracle, measured 7.6x slower
  than ``"chunk"`` forward and 26x forward+backward on the CPU at T=512, 4 heads, 64x64 state; it
  is unmeasured on a GPU); ``"metal"``/``"emulate"`` run ``"kernel"`` where the kernels take the
  shapes, else as ``"auto"``.

Every path is differentiable (MLX autodiff for the reference forms, a custom VJP for the kernels)
in ``q``, ``k``, ``v``, ``g``, ``beta`` and ``initial_state``.
"""

from __future__ import annotations

import mlx.core as mx

from ..cpu import gated_delta as native
from ..device import resolve
from ..kernels import gated_delta as kernels
from ._dispatch import emulator_options, kernel_backend, native_cpu

__all__ = ["gated_delta_rule", "gated_delta_recurrent", "gated_delta_chunk", "l2norm"]

MODES = ("auto", "recurrent", "chunk", "native", "kernel")
_RECURRENT_BELOW = 16


def l2norm(x, axis: int = -1, eps: float = 1e-6):
    """``x * rsqrt(sum(x^2, axis) + eps)`` (fla's and transformers' ``l2norm``)."""
    return x * mx.rsqrt((x * x).sum(axis=axis, keepdims=True) + eps)


# ----------------------------------------------------------------------------------------------
# argument handling
# ----------------------------------------------------------------------------------------------
def _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, scale):
    """Check shapes; return float32 ``q, k, v, g, beta, h0`` with q/k heads repeated to ``Hv``."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"gated_delta_rule: q, k, v must be 4-D [B, T, H, D], got shapes {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, T, Hk, K = k.shape
    if tuple(q.shape) != (B, T, Hk, K):
        raise ValueError(f"gated_delta_rule: q must have k's shape {(B, T, Hk, K)}, got {tuple(q.shape)}")
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"gated_delta_rule: v must be [B={B}, T={T}, Hv, V], got {tuple(v.shape)}")
    Hv, V = v.shape[2], v.shape[3]
    if Hv % Hk:
        raise ValueError(f"gated_delta_rule: value heads ({Hv}) must be a multiple of key heads ({Hk})")
    for name, a in (("g", g), ("beta", beta)):
        if tuple(a.shape) != (B, T, Hv):
            raise ValueError(f"gated_delta_rule: {name} must have shape {(B, T, Hv)}, got {tuple(a.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, Hv, K, V):
        raise ValueError(f"gated_delta_rule: initial_state must have shape {(B, Hv, K, V)}, "
                         f"got {tuple(initial_state.shape)}")
    f32 = mx.float32
    q, k, v, g, beta = (a.astype(f32) for a in (q, k, v, g, beta))
    if Hv != Hk:
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    if use_qk_l2norm_in_kernel:
        q = l2norm(q)
        k = l2norm(k)
    q = q * (K ** -0.5 if scale is None else float(scale))
    h0 = mx.zeros((B, Hv, K, V), f32) if initial_state is None else initial_state.astype(f32)
    return q, k, v, g, beta, h0


# ----------------------------------------------------------------------------------------------
# reference forms (MLX ops, autodiff), on prepared float32 inputs in [B, T, H, D] layout
# ----------------------------------------------------------------------------------------------
def gated_delta_recurrent(q, k, v, g, beta, h0):
    """The per-token recurrence on prepared inputs (q already scaled). Returns ``(o, state)``."""
    T = q.shape[1]
    S = h0
    outs = []
    for t in range(T):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]                       # [B, H, K|V]
        S = S * mx.exp(g[:, t])[..., None, None]
        kv = (k_t[..., None, :] @ S)[..., 0, :]                          # S^T k  [B, H, V]
        delta = (v_t - kv) * beta[:, t][..., None]
        S = S + k_t[..., :, None] * delta[..., None, :]
        outs.append((q_t[..., None, :] @ S)[..., 0, :])
    o = mx.stack(outs, axis=1) if outs else mx.zeros(v.shape, mx.float32)
    return o, S


@mx.custom_function
def _unit_lower_inverse(n):
    """``(I + n)^-1`` for strictly lower-triangular ``n`` (``[..., C, C]``)."""
    eye = mx.eye(n.shape[-1], dtype=n.dtype)
    return mx.linalg.tri_inv(eye + n, upper=False, stream=mx.cpu)


@_unit_lower_inverse.vjp
def _unit_lower_inverse_vjp(primals, cotangent, output):
    # d(A^-1) = -A^-1 dA A^-1  =>  dN = -A^-T dX A^-T, restricted to the strictly lower triangle.
    a_inv = output
    a_t = mx.swapaxes(a_inv, -1, -2)
    return mx.tril(-(a_t @ cotangent @ a_t), -1)


def _halves(a, axis):
    """``a`` cut into its single entries along ``axis`` by repeated halving.

    MLX differentiates a cut into n pieces (by indexing, or one ``mx.split`` into n) with work and
    memory of order n times the whole array, which makes a chunk loop's backward quadratic in the
    number of chunks; halving keeps it at ``log2(n)`` times.
    """
    size = a.shape[axis]
    if size == 1:
        return [a]
    left, right = mx.split(a, [size // 2], axis=axis)
    return _halves(left, axis) + _halves(right, axis)


def gated_delta_chunk(q, k, v, g, beta, h0, chunk_size: int = 64):
    """The chunked (WY) form on prepared inputs (q already scaled). Returns ``(o, state)``.

    Same algorithm as transformers' ``torch_chunk_gated_delta_rule``: T is zero-padded to a multiple
    of ``chunk_size`` (padded tokens have ``g = beta = 0`` and ``k = 0``, so they leave the state as is).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = int(chunk_size)
    if C <= 0:
        raise ValueError(f"gated_delta_rule: chunk_size must be positive, got {chunk_size}")
    if T == 0:
        return mx.zeros(v.shape, mx.float32), h0
    # [B, T, H, D] -> [B, H, T, D]
    q, k, v = (mx.swapaxes(a, 1, 2) for a in (q, k, v))
    g, beta = (mx.swapaxes(a, 1, 2) for a in (g, beta))
    pad = (-T) % C
    if pad:
        q, k, v = (mx.pad(a, [(0, 0), (0, 0), (0, pad), (0, 0)]) for a in (q, k, v))
        g, beta = (mx.pad(a, [(0, 0), (0, 0), (0, pad)]) for a in (g, beta))
    n = (T + pad) // C
    q, k, v = (a.reshape(B, H, n, C, a.shape[-1]) for a in (q, k, v))
    g, beta = (a.reshape(B, H, n, C) for a in (g, beta))

    gamma = mx.cumsum(g, axis=-1)                                         # [B, H, n, C]
    causal = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    diff = gamma[..., :, None] - gamma[..., None, :]
    decay = mx.exp(mx.where(causal, diff, -mx.inf))                      # exp(gamma_i - gamma_j), i >= j
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    kt = mx.swapaxes(k, -1, -2)
    a_inv = _unit_lower_inverse(mx.tril((k_beta @ kt) * decay, -1))
    u = a_inv @ v_beta                                                    # [B, H, n, C, V]
    w = a_inv @ (k_beta * mx.exp(gamma)[..., None])                       # [B, H, n, C, K]
    attn = (q @ kt) * decay                                               # [B, H, n, C, C]
    qg = q * mx.exp(gamma)[..., None]
    last = gamma[..., -1:]
    kg = k * mx.exp(last - gamma)[..., None]
    chunk_decay = mx.exp(last)[..., None]                                 # [B, H, n, 1, 1]

    u, w, qg, attn, kg, chunk_decay = (_halves(a, axis=2) for a in (u, w, qg, attn, kg, chunk_decay))
    S = h0
    outs = []
    for i in range(n):
        v_new = u[i][:, :, 0] - w[i][:, :, 0] @ S
        outs.append(qg[i][:, :, 0] @ S + attn[i][:, :, 0] @ v_new)
        S = S * chunk_decay[i][:, :, 0] + mx.swapaxes(kg[i][:, :, 0], -1, -2) @ v_new
    o = mx.stack(outs, axis=2).reshape(B, H, n * C, V)[:, :, :T]
    return mx.swapaxes(o, 1, 2), S


def _native_takes(q, v) -> bool:
    """Whether the ``"native"`` form runs these prepared (float32) inputs."""
    return native.available() and native_cpu(q, v) and v.shape[-1] <= native.MAX_V


# ----------------------------------------------------------------------------------------------
# public op
# ----------------------------------------------------------------------------------------------
def gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state: bool = True, chunk_size: int = 64,
                     mode: str = "auto", device=None, use_qk_l2norm_in_kernel: bool = False, scale=None):
    """Gated delta rule over a sequence; returns ``(o, final_state)``.

    Args:
        q, k: ``[B, T, Hk, K]``.
        v: ``[B, T, Hv, V]`` (``Hv`` a multiple of ``Hk``: grouped heads).
        g: ``[B, T, Hv]`` log-decay (``<= 0``): the state is multiplied by ``exp(g_t)`` at step t.
        beta: ``[B, T, Hv]`` write strength (usually ``sigmoid(b)``).
        initial_state: ``[B, Hv, K, V]`` or None (zeros).
        output_final_state: return the final state (``[B, Hv, K, V]``, float32), else None.
        chunk_size: chunk length of the ``"chunk"`` form.
        mode: ``"auto"``, ``"recurrent"``, ``"chunk"``, ``"native"`` or ``"kernel"`` (see the module
            docstring).
        device: a `metalnn.Device` (default: the default device).
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6) before the recurrence.
        scale: multiplier of q (default ``K ** -0.5``, as transformers always applies).
    Returns:
        ``o`` ``[B, T, Hv, V]`` in ``q.dtype``, and the final state or None.
    """
    if mode not in MODES:
        raise ValueError(f"gated_delta_rule: mode must be one of {MODES}, got {mode!r}")
    device = resolve(device)
    out_dtype = q.dtype
    qf, kf, vf, gf, bf, h0 = _prepare(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel, scale)
    T = qf.shape[1]
    backend = kernel_backend(device)
    if mode == "auto":
        if backend and kernels.supports(qf, vf):
            mode = "kernel"
        elif device.kernels == "reference":
            mode = "recurrent"
        elif T and _native_takes(qf, vf):
            mode = "native"
        else:
            mode = "recurrent" if T < _RECURRENT_BELOW else "chunk"
    if mode == "kernel":
        if not backend:
            raise ValueError(f"gated_delta_rule: mode='kernel' needs a device with kernels 'metal' or 'emulate', "
                             f"got {device.kernels!r}")
        if not kernels.supports(qf, vf):
            raise ValueError(f"gated_delta_rule: mode='kernel' takes a key head dimension of at most "
                             f"{kernels.MAX_K} and no empty batch, head or value axis; got q {tuple(q.shape)}, "
                             f"v {tuple(v.shape)}")
        o, state = kernels.gated_delta(qf, kf, vf, gf, bf, h0, backend, emulator_options(device))
    elif mode == "native":
        if not _native_takes(qf, vf):
            raise ValueError(f"gated_delta_rule: mode='native' needs the CPU backend with metalnn's native "
                             f"extension loaded and a value head dimension of at most {native.MAX_V}; got v "
                             f"{tuple(v.shape)} (extension loaded: {native.available()})")
        o, state = native.gated_delta(qf, kf, vf, gf, bf, h0)
    elif mode == "chunk":
        o, state = gated_delta_chunk(qf, kf, vf, gf, bf, h0, chunk_size)
    else:
        o, state = gated_delta_recurrent(qf, kf, vf, gf, bf, h0)
    return o.astype(out_dtype), (state if output_final_state else None)

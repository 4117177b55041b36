"""The SSD scan of Mamba2 (state-space duality): the selective state-space recurrence of Mamba2
layers (Granite 4 hybrid, Nemotron-H, Mamba2 models).

Conventions follow Hugging Face transformers' ``Mamba2Mixer`` torch path (``mamba2_chunk_scan``
and ``mamba2_selective_state_update``, which follow ``mamba_ssm``):

* ``x``: ``[B, T, H, P]`` (heads of width P); ``dt``: ``[B, T, H]``, the discretisation step
  *after* softplus and clamping (the layer does those); ``A``: ``[H]`` (negative,
  ``-exp(A_log)``); ``B``, ``C``: ``[B, T, G, N]`` with ``G`` groups (``H`` a multiple of ``G``;
  head ``h`` reads group ``h // (H // G)``); ``D``: ``[H]`` or None; the state is ``[B, H, P, N]``
  and stays in float32.
* Everything is computed in float32; ``y`` comes back in ``x``'s dtype.

Per head and token (``S`` is ``P x N``)::

    S = exp(dt_t * A) * S + dt_t * x_t B_t^T
    y_t = S C_t + D * x_t

Forms (``mode``), all differentiable:

* ``"recurrent"``: the per-token loop above in plain MLX ops (the definition; cheapest for
  decoding, where T is 1).
* ``"chunk"``: the chunked SSD form in plain MLX ops, transformers' algorithm: inside chunks of
  ``chunk_size`` tokens the output is a masked ``(C B^T) * L`` product (``L`` the decays between
  positions), the states at chunk boundaries come from one product with the decays between
  chunks (no sequential loop at all).
* ``"kernel"``: the Metal kernels of ``metal_kernels/ssd.metal`` (forward recurrence with state
  checkpoints, reverse-time backward kernel); needs ``device.kernels`` ``"metal"`` or
  ``"emulate"`` and a state size N of at most 256.
* ``"auto"`` picks by ``device.kernels``: ``"reference"`` runs ``"recurrent"``; ``"auto"`` runs
  ``"recurrent"`` for ``T < 16`` and ``"chunk"`` otherwise; ``"metal"``/``"emulate"`` run
  ``"kernel"`` where the kernels take the shapes, else as ``"auto"``.

The D skip is added outside the scan (in MLX ops) by every form.
"""

from __future__ import annotations

import mlx.core as mx

from ..device import resolve
from ..kernels import ssd as kernels
from ._dispatch import emulator_options, kernel_backend

__all__ = ["ssd_scan", "ssd_recurrent", "ssd_chunk"]

MODES = ("auto", "recurrent", "chunk", "kernel")
_RECURRENT_BELOW = 16


def _prepare(x, dt, A, B, C, D, initial_state):
    """Check shapes; return float32 ``x, dt, A, B, C, D, h0`` with B and C repeated to the H heads."""
    if x.ndim != 4:
        raise ValueError(f"ssd_scan: x must be 4-D [B, T, H, P], got shape {tuple(x.shape)}")
    b, t, h, p = x.shape
    if tuple(dt.shape) != (b, t, h):
        raise ValueError(f"ssd_scan: dt must have shape {(b, t, h)}, got {tuple(dt.shape)}")
    if tuple(A.shape) != (h,):
        raise ValueError(f"ssd_scan: A must have shape {(h,)}, got {tuple(A.shape)}")
    if B.ndim != 4 or tuple(B.shape[:2]) != (b, t) or tuple(C.shape) != tuple(B.shape):
        raise ValueError(f"ssd_scan: B and C must both be [B={b}, T={t}, G, N], got {tuple(B.shape)} and "
                         f"{tuple(C.shape)}")
    g, n = B.shape[2], B.shape[3]
    if g <= 0 or h % g:
        raise ValueError(f"ssd_scan: heads ({h}) must be a multiple of groups ({g})")
    if D is not None and tuple(D.shape) != (h,):
        raise ValueError(f"ssd_scan: D must have shape {(h,)}, got {tuple(D.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (b, h, p, n):
        raise ValueError(f"ssd_scan: initial_state must have shape {(b, h, p, n)}, got "
                         f"{tuple(initial_state.shape)}")
    f32 = mx.float32
    x, dt, A, B, C = (a.astype(f32) for a in (x, dt, A, B, C))
    if g != h:
        B = mx.repeat(B, h // g, axis=2)
        C = mx.repeat(C, h // g, axis=2)
    h0 = mx.zeros((b, h, p, n), f32) if initial_state is None else initial_state.astype(f32)
    return x, dt, A, B, C, (None if D is None else D.astype(f32)), h0


# ----------------------------------------------------------------------------------------------
# reference forms (MLX ops, autodiff), on prepared float32 inputs: x [B, T, H, P], the log-decay
# g = dt * A [B, T, H], xd = x * dt [B, T, H, P], B and C [B, T, H, N], h0 [B, H, P, N]
# ----------------------------------------------------------------------------------------------
def ssd_recurrent(xd, g, B, C, h0):
    """The per-token recurrence. Returns ``(y [B, T, H, P], state [B, H, P, N])`` (no D skip)."""
    T = xd.shape[1]
    S = h0
    outs = []
    for t in range(T):
        S = S * mx.exp(g[:, t])[..., None, None] + xd[:, t][..., :, None] * B[:, t][..., None, :]
        outs.append((S @ C[:, t][..., :, None])[..., 0])                  # [B, H, P]
    y = mx.stack(outs, axis=1) if outs else mx.zeros(xd.shape, mx.float32)
    return y, S


def _segsum(a):
    """``out[..., i, j] = sum(a[..., j+1 : i+1])`` for ``i >= j``, ``-inf`` above the diagonal
    (transformers' ``segment_sum``: a masked cumulative sum, no differences of large sums)."""
    n = a.shape[-1]
    rep = mx.broadcast_to(a[..., :, None], a.shape + (n,))                 # [..., i, j] = a_i
    strict = mx.tril(mx.ones((n, n), dtype=mx.bool_), -1)
    s = mx.cumsum(mx.where(strict, rep, 0.0), axis=-2)
    return mx.where(mx.tril(mx.ones((n, n), dtype=mx.bool_)), s, -mx.inf)


def ssd_chunk(xd, g, B, C, h0, chunk_size: int = 256):
    """The chunked SSD form (transformers' ``mamba2_chunk_scan``). Returns ``(y, state)`` (no D skip).

    T is zero-padded to a multiple of ``chunk_size`` (padded tokens have ``g = 0`` and ``xd = 0``,
    so they leave the state as is).
    """
    b, T, H, P = xd.shape
    N = B.shape[-1]
    L = int(chunk_size)
    if L <= 0:
        raise ValueError(f"ssd_scan: chunk_size must be positive, got {chunk_size}")
    if T == 0:
        return mx.zeros(xd.shape, mx.float32), h0
    pad = (-T) % L
    if pad:
        xd, B, C = (mx.pad(a, [(0, 0), (0, pad), (0, 0), (0, 0)]) for a in (xd, B, C))
        g = mx.pad(g, [(0, 0), (0, pad), (0, 0)])
    c = (T + pad) // L
    xd = xd.reshape(b, c, L, H, P)
    B = B.reshape(b, c, L, H, N)
    C = C.reshape(b, c, L, H, N)
    g = g.reshape(b, c, L, H).transpose(0, 3, 1, 2)                       # [b, H, c, L]
    g_cum = mx.cumsum(g, axis=-1)

    # 1. inside each chunk: y_diag[l] = sum_{s <= l} (C_l . B_s) exp(g_cum_l - g_cum_s) xd_s
    decay = mx.exp(_segsum(g))                                            # [b, H, c, L, L]
    scores = mx.einsum("bclhn,bcshn->bhcls", C, B) * decay
    y_diag = mx.einsum("bhcls,bcshp->bclhp", scores, xd)

    # 2. each chunk's own contribution to the state at its end
    decay_states = mx.exp(g_cum[..., -1:] - g_cum)                        # [b, H, c, L]
    states = mx.einsum("bclhn,bhcl,bclhp->bchpn", B, decay_states, xd)

    # 3. the states entering each chunk (and the final one), from the decays between chunks
    states = mx.concatenate([h0[:, None], states], axis=1)                # [b, c+1, H, P, N]
    chunk_decay = mx.exp(_segsum(mx.pad(g_cum[..., -1], [(0, 0), (0, 0), (1, 0)])))  # [b, H, c+1, c+1]
    new_states = mx.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    states, final = new_states[:, :-1], new_states[:, -1]

    # 4. the entering states' contribution to each position
    y_off = mx.einsum("bclhn,bchpn,bhcl->bclhp", C, states, mx.exp(g_cum))
    y = (y_diag + y_off).reshape(b, c * L, H, P)[:, :T]
    return y, final


# ----------------------------------------------------------------------------------------------
# public op
# ----------------------------------------------------------------------------------------------
def ssd_scan(x, dt, A, B, C, D=None, initial_state=None, output_final_state: bool = True, chunk_size: int = 256,
             mode: str = "auto", device=None):
    """The Mamba2 selective scan over a sequence; returns ``(y, final_state)``.

    Args:
        x: ``[B, T, H, P]``.
        dt: ``[B, T, H]`` discretisation steps (after softplus and clamping).
        A: ``[H]`` (negative): the state decays by ``exp(dt_t * A)`` at step t.
        B, C: ``[B, T, G, N]`` (``H`` a multiple of ``G``).
        D: ``[H]`` skip weights or None.
        initial_state: ``[B, H, P, N]`` or None (zeros).
        output_final_state: return the final state (``[B, H, P, N]``, float32), else None.
        chunk_size: chunk length of the ``"chunk"`` form.
        mode: ``"auto"``, ``"recurrent"``, ``"chunk"`` or ``"kernel"`` (see the module docstring).
        device: a `metalnn.Device` (default: the default device).
    Returns:
        ``y`` ``[B, T, H, P]`` in ``x.dtype``, and the final state or None.
    """
    if mode not in MODES:
        raise ValueError(f"ssd_scan: mode must be one of {MODES}, got {mode!r}")
    device = resolve(device)
    out_dtype = x.dtype
    xf, dtf, Af, Bf, Cf, Df, h0 = _prepare(x, dt, A, B, C, D, initial_state)
    T = xf.shape[1]
    g = dtf * Af
    xd = xf * dtf[..., None]
    backend = kernel_backend(device)
    if mode == "auto":
        if backend and kernels.supports(xd, Bf):
            mode = "kernel"
        elif device.kernels == "reference":
            mode = "recurrent"
        else:
            mode = "recurrent" if T < _RECURRENT_BELOW else "chunk"
    if mode == "kernel":
        if not backend:
            raise ValueError(f"ssd_scan: mode='kernel' needs a device with kernels 'metal' or 'emulate', got "
                             f"{device.kernels!r}")
        if not kernels.supports(xd, Bf):
            raise ValueError(f"ssd_scan: mode='kernel' takes a state size of at most {kernels.MAX_N} and no empty "
                             f"batch, head or head-width axis; got x {tuple(x.shape)}, B {tuple(B.shape)}")
        y, state = kernels.ssd(xd, g, Bf, Cf, h0, backend, emulator_options(device))
    elif mode == "chunk":
        y, state = ssd_chunk(xd, g, Bf, Cf, h0, chunk_size)
    else:
        y, state = ssd_recurrent(xd, g, Bf, Cf, h0)
    if Df is not None:
        y = y + xf * Df[:, None]
    return y.astype(out_dtype), (state if output_final_state else None)

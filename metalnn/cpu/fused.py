"""Fused, multi-threaded CPU primitives for the ops of a training step, with their backward passes.

MLX's CPU backend runs the formulas of ``mx.fast.rms_norm``, ``mx.fast.rope`` and of a softmax
cross entropy as chains of single-threaded element-wise ops (``exp`` one element at a time); these
primitives (``metalnn.cpu._fastmath``, built from ``metalnn/cpu/native/fastmath/train_ops.cpp``) compute
each forward pass, and each backward pass, in one multi-threaded, vectorised sweep over the rows
(``scripts/bench_kernels.py --ops rms_norm,rope,gated,cross_entropy,attention`` measures them):

* ``rms_norm(x, weight, eps)``: ``x * rsqrt(mean(x^2, -1) + eps) * weight``;
* ``rope(x, dims, ...)``: rotary embedding as ``mx.fast.rope`` (integer offset); reads any
  layout (the transposed view of split heads too) and returns a row-contiguous array;
* ``gated(a, b, activation)``: ``act(a) * b`` (SwiGLU / GeGLU / GLU gates);
* ``cross_entropy(logits, targets, label_smoothing)``: the per-row loss
  ``logsumexp(x) - (1 - ls) x[t] - ls mean(x)``;
* ``scaled_softmax(x, scale, causal=, q_len=, offset=)``: ``softmax(x * scale)`` over the last
  axis, optionally causal (row ``r`` is query ``i = r % q_len``, which keeps keys
  ``j <= i + offset``; masked entries are exactly 0);
* ``contiguous(x)``: a row-contiguous copy (MLX copies on one thread);
* ``adamw_update(param, grad, m, v, lr, step, ...)``: one step of ``mlx.optimizers.AdamW``'s
  update (used by `metalnn.optimizers.AdamW`).

Layouts: `rope` and `contiguous` read any strided input, and their backward passes store the
gradient in the memory order of that input when it is dense (e.g. the transposed view of split
attention heads), so the transpose back and the reshape the caller's graph applies to the
gradient need no copy.

They are ordinary MLX ops: ``mx.grad``, ``mx.vjp``, ``mx.jvp``, ``mx.vmap`` and ``mx.compile``
work on them (JVPs, vmap and second derivatives go through the ops' definitions in plain MLX
ops). Native for float32 on CPU streams; other dtypes, GPU streams, and a missing extension
(macOS, a failed build; see ``unavailable_reason()``) compute the same formulas with MLX ops.
``METALNN_NUM_THREADS`` / `metalnn.cpu.im2col.set_num_threads` set the threads.
"""

from __future__ import annotations

import mlx.core as mx

from . import native_ext as _native_ext

__all__ = ["available", "unavailable_reason", "rms_norm", "rope", "gated", "cross_entropy", "scaled_softmax",
           "contiguous", "adamw_update", "GATED_ACTIVATIONS"]

#: activations `gated` fuses (names of `metalnn.functional.activations`)
GATED_ACTIVATIONS = ("silu", "gelu_tanh", "sigmoid", "tanh")

# The loaded extension or None; read at every call (tests swap in None for the fallback).
_ext = _native_ext.extension()


def available() -> bool:
    """True when the native primitives are loaded (CPU streams use them)."""
    return _ext is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (``None`` when it is True)."""
    return None if _ext is not None else (_native_ext.unavailable_reason() or "replaced by the MLX ops")


# ----------------------------------------------------------------------------- MLX-op forms


def _rms_norm_mlx(x, weight, eps):
    y = x * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def _act_mlx(a, activation):
    if activation == "silu":
        return a * mx.sigmoid(a)
    if activation == "gelu_tanh":
        return 0.5 * a * (1 + mx.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a)))
    return mx.sigmoid(a) if activation == "sigmoid" else mx.tanh(a)


def _cross_entropy_mlx(logits, targets, label_smoothing):
    lse = mx.logsumexp(logits, axis=-1)
    picked = mx.take_along_axis(logits, targets[..., None].astype(mx.int32), axis=-1)[..., 0]
    loss = lse - (1 - label_smoothing) * picked
    if label_smoothing:
        loss = loss - label_smoothing * mx.mean(logits, axis=-1)
    return loss


def _scaled_softmax_mlx(x, scale, causal, q_len, offset):
    z = x * scale
    if causal:
        n = x.shape[-1]
        keep = mx.arange(n)[None, :] <= (mx.arange(q_len)[:, None] + offset)
        zz = z.reshape(*x.shape[:-2], x.shape[-2] // q_len, q_len, n)
        z = mx.where(keep, zz, -mx.inf).reshape(x.shape)
    return mx.softmax(z, axis=-1, precise=True)


# ----------------------------------------------------------------------------- public ops


def rms_norm(x, weight, eps: float, *, stream=None):
    """``x * rsqrt(mean(x^2, -1) + eps) * weight``; x ``[..., D]``, weight ``[D]`` or None."""
    if _ext is None:
        return _rms_norm_mlx(x, weight, eps)
    return _ext.rms_norm(x, weight, float(eps), stream=stream)


def rope(x, dims: int, *, traditional: bool = False, base: float | None = 10000.0, scale: float = 1.0,
         offset: int = 0, freqs=None, stream=None):
    """Rotary embedding of x ``[..., T, D]`` (as ``mx.fast.rope``; ``offset`` an int).

    ``freqs``: optional periods (one per rotated pair; then ``base`` is unused), an array that
    may also be an input of an ``mx.compile``-d function. As with ``mx.fast.rope``, only ``x`` is
    differentiated.
    """
    f = None if freqs is None else mx.array(freqs, dtype=mx.float32)
    if _ext is None:
        x3 = x.reshape(-1, *x.shape[-2:])
        return mx.fast.rope(x3, dims, traditional=traditional, base=None if f is not None else base, scale=scale,
                            offset=offset, freqs=f).reshape(x.shape)
    return _ext.rope(x, int(dims), traditional=bool(traditional), base=None if base is None else float(base),
                     scale=float(scale), offset=int(offset), freqs=f, stream=stream)


def gated(a, b, activation: str = "silu", *, stream=None):
    """``act(a) * b`` for ``activation`` in `GATED_ACTIVATIONS`; a and b of one shape."""
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(f"gated: activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
    if _ext is None:
        return _act_mlx(a, activation) * b
    return _ext.gated(a, b, activation, stream=stream)


def cross_entropy(logits, targets, label_smoothing: float = 0.0, *, stream=None):
    """Per-row softmax cross entropy: logits ``[..., C]``, integer targets ``[...]`` -> ``[...]``.

    The targets must lie in ``[0, C)`` (an out-of-range target gives NaN natively).
    """
    if _ext is None:
        return _cross_entropy_mlx(logits, targets, label_smoothing)
    return _ext.cross_entropy(logits, targets, float(label_smoothing), stream=stream)


def scaled_softmax(x, scale: float, *, causal: bool = False, q_len: int = 1, offset: int = 0, stream=None):
    """``softmax(x * scale)`` over the last axis; ``causal``: rows cycle through ``q_len`` query
    positions and query ``i`` keeps keys ``j <= i + offset`` (x ``[..., rows, keys]`` with
    ``rows`` a multiple of ``q_len``). A row that keeps no key is all zeros natively (NaN in
    the MLX-op form)."""
    if _ext is None:
        return _scaled_softmax_mlx(x, scale, causal, q_len, offset)
    return _ext.scaled_softmax(x, float(scale), causal=bool(causal), q_len=int(q_len), offset=int(offset),
                               stream=stream)


def contiguous(x, *, stream=None):
    """A row-contiguous copy of ``x`` (any dtype); its gradient takes ``x``'s memory order."""
    if _ext is None:
        return mx.contiguous(x)
    return _ext.contiguous(x, stream=stream)


def _adamw_mlx(param, grad, m, v, lr, step, b1, b2, eps, weight_decay, bias_correction):
    lr = mx.array(lr).astype(grad.dtype)
    p1 = param * (1 - lr * weight_decay)
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * mx.square(grad)
    if bias_correction:
        c1 = (lr / (1 - b1 ** step)).astype(grad.dtype)
        c2 = mx.rsqrt(1 - b2 ** step).astype(grad.dtype)
        return p1 - c1 * m / (mx.sqrt(v) * c2 + eps), m, v
    return p1 - lr * m / (mx.sqrt(v) + eps), m, v


def adamw_update(param, grad, m, v, lr, step, *, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, bias_correction: bool = False, stream=None):
    """One AdamW step as ``mlx.optimizers.AdamW`` computes it; returns ``(param, m, v)``.

    ``lr`` and ``step`` (the step count, for the bias correction) are scalars or 0-d arrays.
    """
    b1, b2 = (float(b) for b in betas)
    if _ext is None:
        return _adamw_mlx(param, grad, m, v, lr, step, b1, b2, eps, weight_decay, bias_correction)
    return _ext.adamw_update(param, grad, m, v, mx.array(lr), mx.array(step), b1=b1, b2=b2, eps=float(eps),
                             weight_decay=float(weight_decay), bias_correction=bool(bias_correction),
                             stream=stream)

"""`GatedDeltaNet`: the gated delta-rule linear-attention block of Qwen3-Next and Qwen3.5, with a
decoding cache.

Input and output ``Data`` dims are ``(W=hidden, H=positions, D=batch)``. Parameters carry the
Hugging Face names of ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``, so their weights load
by name:

* Qwen3-Next (default): ``in_proj_qkvz.weight`` ``[2*Hk*Dk + 2*Hv*Dv, W]`` and ``in_proj_ba.weight``
  ``[2*Hv, W]``, laid out per key-head group as transformers' ``fix_query_key_value_ordering`` reads
  them;
* Qwen3.5 (``separate_projections=True``): ``in_proj_qkv.weight`` ``[2*Hk*Dk + Hv*Dv, W]`` (all q
  heads, then all k heads, then all v heads), ``in_proj_z.weight`` ``[Hv*Dv, W]``,
  ``in_proj_b.weight`` and ``in_proj_a.weight`` ``[Hv, W]``;
* ``conv1d.weight`` ``[C, 1, kernel]``: a `Conv1D` with ``groups=C`` (causal depthwise convolution over
  q, k, v, ``C = 2*Hk*Dk + Hv*Dv``, no bias) followed by the activation (SiLU);
* ``A_log`` and ``dt_bias`` ``[Hv]``: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``;
* ``norm.weight`` ``[Dv]``: a `GatedRMSNorm`, ``rms_norm(o) * weight * silu(z)`` per value head;
* ``out_proj.weight`` ``[W, Hv*Dv]``.

q and k are L2-normalised inside the recurrence and q is scaled by ``Dk ** -0.5``
(`metalnn.functional.gated_delta_rule` with ``use_qk_l2norm_in_kernel=True``); each key head serves
``Hv // Hk`` consecutive value heads.

For decoding pass a `GatedDeltaCache` to ``compile(device, data, cache=...)``: it keeps the last
``kernel - 1`` convolution inputs and the recurrent state ``[B, Hv, Dk, Dv]``, so each new token
costs one step.
"""

from __future__ import annotations


import mlx.core as mx

from .. import functional as F
from ..data import Data, MTLSize
from .base import Layer
from .conv import Conv1D, causal_conv
from .state_cache import StateCache
from .linear import Linear, float_dtype
from .norm import GatedRMSNorm


class GatedDeltaCache(StateCache):
    """Decoding state of one `GatedDeltaNet`: ``conv_state`` ``[B, kernel - 1, C]`` (the last
    convolution inputs) and ``recurrent_state`` ``[B, Hv, Dk, Dv]`` (float32)."""

    fields = ("conv_state", "recurrent_state")


def _softplus(x):
    return mx.logaddexp(x, mx.zeros_like(x))


class GatedDeltaNet(Layer):
    """The gated delta-rule linear attention block of Qwen3-Next (and, with
    ``separate_projections=True``, of Qwen3.5).

    Args:
        num_k_heads: query/key heads (``linear_num_key_heads``).
        num_v_heads: value heads (``linear_num_value_heads``, a multiple of ``num_k_heads``; default the same).
        head_k_dim: query/key head width (``linear_key_head_dim``).
        head_v_dim: value head width (``linear_value_head_dim``, default ``head_k_dim``).
        conv_kernel: width of the causal depthwise convolution (``linear_conv_kernel_dim``).
        eps: epsilon of the gated RMSNorm (``rms_norm_eps``).
        chunk_size, mode: passed to `metalnn.functional.gated_delta_rule`.
        separate_projections: Qwen3.5's four input projections (``in_proj_qkv``, ``in_proj_z``,
            ``in_proj_b``, ``in_proj_a``) instead of Qwen3-Next's grouped ``in_proj_qkvz`` and
            ``in_proj_ba``.
        activation: activation after the convolution (the model's ``hidden_act``, SiLU).
        init: initializer of the projections (default `Linear`'s).
        dtype: parameter dtype.
    """

    fixed_axes = ("W",)
    positional_hint = "{cls}({num_k_heads}, num_v_heads={extra[0]!r})"

    def __init__(self, num_k_heads: int, *, num_v_heads: int | None = None, head_k_dim: int = 128,
                 head_v_dim: int | None = None, conv_kernel: int = 4, eps: float = 1e-6, chunk_size: int = 64,
                 mode: str = "auto", separate_projections: bool = False, activation: str = "silu", init=None,
                 dtype=None):
        super().__init__()
        self.n_k_heads = int(num_k_heads)
        self.n_v_heads = int(num_v_heads or num_k_heads)
        if self.n_k_heads <= 0 or self.n_v_heads % self.n_k_heads:
            raise ValueError(f"GatedDeltaNet: num_v_heads ({num_v_heads}) must be a positive multiple of "
                             f"num_k_heads ({num_k_heads})")
        self.head_k_dim = int(head_k_dim)
        self.head_v_dim = int(head_v_dim or head_k_dim)
        self.conv_kernel = int(conv_kernel)
        self.eps = float(eps)
        self.chunk_size = int(chunk_size)
        self.mode = mode
        self.separate_projections = bool(separate_projections)
        self.activation = F.check_activation(activation)
        self._init, self._dtype = init, dtype

    @property
    def key_dim(self):
        return self.n_k_heads * self.head_k_dim

    @property
    def value_dim(self):
        return self.n_v_heads * self.head_v_dim

    @property
    def conv_dim(self):
        return 2 * self.key_dim + self.value_dim

    def build(self, device, dims, dtype):
        dtype = self._dtype or float_dtype(dtype)
        kw = dict(bias=False, init=self._init, dtype=dtype)
        if self.separate_projections:
            self.in_proj_qkv = Linear(self.conv_dim, **kw)
            self.in_proj_z = Linear(self.value_dim, **kw)
            self.in_proj_b = Linear(self.n_v_heads, **kw)
            self.in_proj_a = Linear(self.n_v_heads, **kw)
        else:
            self.in_proj_qkvz = Linear(2 * self.key_dim + 2 * self.value_dim, **kw)
            self.in_proj_ba = Linear(2 * self.n_v_heads, **kw)
        self.out_proj = Linear(dims.W, **kw)
        self.conv1d = Conv1D(self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=False, dtype=dtype)
        self.dt_bias = mx.ones((self.n_v_heads,), dtype)
        self.A_log = mx.log(mx.random.uniform(0.01, 16.0, (self.n_v_heads,), key=device.next_key())).astype(dtype)
        self.norm = GatedRMSNorm(self.head_v_dim, eps=self.eps, dtype=dtype)

    def _conv(self, device, x, cache):
        """Causal depthwise conv + activation over ``x`` ``[B, T, C]``; updates the cache's conv tail."""
        y = causal_conv(self, device, self.conv1d, x, cache, self.conv_kernel - 1)
        return F.activation(y, self.activation, device=device)

    def _project(self, device, data):
        """Input projections -> ``mixed`` ``[B, T, C]`` (q, k, v before the conv), ``z``
        ``[B, T, Hv, Dv]``, ``b`` and ``a`` ``[B, T, Hv]``."""
        d = data.dims
        B, T = d.D, d.H
        hk, hv, dk, dv = self.n_k_heads, self.n_v_heads, self.head_k_dim, self.head_v_dim
        if self.separate_projections:
            mixed = self.compile_child(self.in_proj_qkv, device, data).array
            z = self.compile_child(self.in_proj_z, device, data).array.reshape(B, T, hv, dv)
            b = self.compile_child(self.in_proj_b, device, data).array
            a = self.compile_child(self.in_proj_a, device, data).array
            return mixed, z, b, a
        r = hv // hk
        qkvz = self.compile_child(self.in_proj_qkvz, device, data).array
        ba = self.compile_child(self.in_proj_ba, device, data).array
        # Per key-head group: [q (dk), k (dk), v (r*dv), z (r*dv)] and [b (r), a (r)].
        qkvz = qkvz.reshape(B, T, hk, 2 * dk + 2 * r * dv)
        q = qkvz[..., :dk]
        k = qkvz[..., dk:2 * dk]
        v = qkvz[..., 2 * dk:2 * dk + r * dv]
        z = qkvz[..., 2 * dk + r * dv:].reshape(B, T, hv, dv)
        ba = ba.reshape(B, T, hk, 2 * r)
        b = ba[..., :r].reshape(B, T, hv)
        a = ba[..., r:].reshape(B, T, hv)

        mixed = mx.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
        return mixed, z, b, a

    def forward(self, device, data, cache=None):
        d = data.dims
        B, T = d.D, d.H
        hk, hv, dk, dv = self.n_k_heads, self.n_v_heads, self.head_k_dim, self.head_v_dim
        mixed, z, b, a = self._project(device, data)
        mixed = self._conv(device, mixed, cache)
        q = mixed[..., :self.key_dim].reshape(B, T, hk, dk)
        k = mixed[..., self.key_dim:2 * self.key_dim].reshape(B, T, hk, dk)
        v = mixed[..., 2 * self.key_dim:].reshape(B, T, hv, dv)

        beta = F.activation(b, "sigmoid", device=device)
        g = -mx.exp(self.A_log.astype(mx.float32)) * _softplus(a.astype(mx.float32) + self.dt_bias)
        h0 = cache.recurrent_state if cache is not None else None
        o, state = F.gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=cache is not None,
                                      chunk_size=self.chunk_size, mode=self.mode, device=device,
                                      use_qk_l2norm_in_kernel=True)
        if cache is not None:
            cache.recurrent_state = state
            cache.offset += T
        o = self.compile_child(self.norm, device, Data(o.reshape(B * T, hv, dv)), gate=z).array
        o = Data(o.reshape(B, T, self.value_dim), MTLSize(self.value_dim, T, B))
        return self.compile_child(self.out_proj, device, o)

    def _extra_repr(self):
        return (f"n_k_heads={self.n_k_heads}, n_v_heads={self.n_v_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, conv_kernel={self.conv_kernel}"
                + (", separate_projections=True" if self.separate_projections else ""))

"""`Mamba2`: the Mamba2 selective state-space token mixer (Granite 4 hybrid, Nemotron-H, Mamba2
models), with a decoding cache.

Input and output ``Data`` dims are ``(W=hidden, H=positions, D=batch)``. Parameters carry the
Hugging Face names of ``Mamba2Mixer`` / ``GraniteMoeHybridMambaLayer``, so their weights load by
name (``I = num_heads * head_dim``, ``conv_dim = I + 2 * n_groups * state_size``):

* ``in_proj.weight`` ``[I + conv_dim + num_heads, W]`` (and ``in_proj.bias`` with ``bias``): the
  gate z (I), then x, B, C (``conv_dim``), then dt (``num_heads``);
* ``conv1d.weight`` ``[conv_dim, 1, conv_kernel]`` and ``conv1d.bias`` ``[conv_dim]`` (with
  ``conv_bias``): a causal depthwise convolution over x, B and C, followed by SiLU;
* ``A_log``, ``dt_bias``, ``D`` ``[num_heads]``: ``A = -exp(A_log)``,
  ``dt = clamp(softplus(dt + dt_bias), *time_step_limit)``, ``D`` the skip weight;
* ``norm.weight`` ``[I]``: a `GroupedGatedRMSNorm`, ``rms_norm(y * silu(z))`` over ``n_groups``
  groups of ``I // n_groups`` features;
* ``out_proj.weight`` ``[W, I]`` (and ``out_proj.bias`` with ``bias``).

The scan itself is `metalnn.functional.ssd_scan` (heads of width ``head_dim``, ``n_groups``
groups of B/C of size ``state_size``): chunked for prompts and training, one recurrent step per
decoded token, Metal kernels on ``kernels="metal"``/``"emulate"``.

transformers clamps dt to ``time_step_limit`` in its chunked scan but not in its one-token step;
this layer clamps in both (the default limit, ``(0, inf)``, changes nothing).

For decoding pass a `Mamba2Cache` to ``compile(device, data, cache=...)``: it keeps the last
``conv_kernel - 1`` convolution inputs and the state ``[B, num_heads, head_dim, state_size]``.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .. import functional as F
from ..data import Data, MTLSize
from .base import Layer
from .conv import Conv1D, causal_conv
from .linear import Linear, float_dtype
from .norm import GroupedGatedRMSNorm
from .state_cache import StateCache

__all__ = ["Mamba2", "Mamba2Cache"]


class Mamba2Cache(StateCache):
    """Decoding state of one `Mamba2`: ``conv_state`` ``[B, conv_kernel - 1, conv_dim]`` (the last
    convolution inputs) and ``ssm_state`` ``[B, num_heads, head_dim, state_size]`` (float32)."""

    fields = ("conv_state", "ssm_state")


def _softplus(x):
    return mx.logaddexp(x, mx.zeros_like(x))


class Mamba2(Layer):
    """The Mamba2 mixer (transformers' ``Mamba2Mixer`` torch path).

    Args:
        num_heads: SSM heads (``mamba_n_heads``).
        head_dim: width of a head (``mamba_d_head``); ``num_heads * head_dim`` is the inner width I.
        state_size: SSM state size N per head (``mamba_d_state``).
        n_groups: groups of B and C (``mamba_n_groups``; divides ``num_heads``); also the groups of
            the gated norm.
        conv_kernel: width of the causal depthwise convolution (``mamba_d_conv``).
        conv_bias: the convolution has a bias (``mamba_conv_bias``).
        bias: the input and output projections have biases (``mamba_proj_bias``).
        time_step_limit: ``(min, max)`` clamp of dt after the softplus.
        eps: epsilon of the gated RMSNorm.
        chunk_size, mode: passed to `metalnn.functional.ssd_scan`.
        activation: activation after the convolution (SiLU).
        init: initializer of the projections (default `Linear`'s).
        dtype: parameter dtype.
    """

    fixed_axes = ("W",)
    positional_hint = "{cls}({num_heads}, head_dim=..., state_size=...)"

    def __init__(self, num_heads: int, *, head_dim: int, state_size: int, n_groups: int = 1, conv_kernel: int = 4,
                 conv_bias: bool = True, bias: bool = False, time_step_limit=(0.0, math.inf), eps: float = 1e-6,
                 chunk_size: int = 256, mode: str = "auto", activation: str = "silu", init=None, dtype=None):
        super().__init__()
        self.num_heads, self.head_dim, self.state_size = int(num_heads), int(head_dim), int(state_size)
        self.n_groups = int(n_groups)
        if min(self.num_heads, self.head_dim, self.state_size, self.n_groups) <= 0 or self.num_heads % self.n_groups:
            raise ValueError(f"Mamba2: num_heads ({num_heads}), head_dim ({head_dim}), state_size ({state_size}) must "
                             f"be positive and num_heads a multiple of n_groups ({n_groups})")
        self.conv_kernel = int(conv_kernel)
        if self.conv_kernel <= 0:
            raise ValueError(f"Mamba2: conv_kernel must be positive, got {conv_kernel}")
        self.conv_bias, self.use_bias = bool(conv_bias), bool(bias)
        lo, hi = (0.0, math.inf) if time_step_limit is None else time_step_limit
        self.time_step_limit = (float(lo), float(hi))
        self.eps = float(eps)
        self.chunk_size = int(chunk_size)
        self.mode = mode
        self.activation = F.check_activation(activation)
        self._init, self._dtype = init, dtype

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner_dim + 2 * self.n_groups * self.state_size

    def build(self, device, dims, dtype):
        dtype = self._dtype or float_dtype(dtype)
        kw = dict(bias=self.use_bias, init=self._init, dtype=dtype)
        self.in_proj = Linear(self.inner_dim + self.conv_dim + self.num_heads, **kw)
        self.conv1d = Conv1D(self.conv_dim, self.conv_kernel, groups=self.conv_dim, bias=self.conv_bias, dtype=dtype)
        self.dt_bias = mx.ones((self.num_heads,), dtype)
        self.A_log = mx.log(mx.arange(1, self.num_heads + 1, dtype=mx.float32)).astype(dtype)
        self.D = mx.ones((self.num_heads,), dtype)
        self.norm = GroupedGatedRMSNorm(self.inner_dim, group_size=self.inner_dim // self.n_groups, eps=self.eps,
                                        dtype=dtype)
        self.out_proj = Linear(dims.W, **kw)

    def _conv(self, device, x, cache):
        """Causal depthwise conv + activation over ``x`` ``[B, T, C]``; updates the cache's conv tail."""
        y = causal_conv(self, device, self.conv1d, x, cache, self.conv_kernel - 1)
        return F.activation(y, self.activation, device=device)

    def forward(self, device, data, cache=None):
        d = data.dims
        B, T = d.D, d.H
        H, P, N, G, inner = self.num_heads, self.head_dim, self.state_size, self.n_groups, self.inner_dim
        proj = self.compile_child(self.in_proj, device, data).array.reshape(B, T, -1)
        z = proj[..., :inner]
        xbc = self._conv(device, proj[..., inner:inner + self.conv_dim], cache)
        dt = proj[..., inner + self.conv_dim:]
        x = xbc[..., :inner].reshape(B, T, H, P)
        b = xbc[..., inner:inner + G * N].reshape(B, T, G, N)
        c = xbc[..., inner + G * N:].reshape(B, T, G, N)

        dt = _softplus(dt.astype(mx.float32) + self.dt_bias.astype(mx.float32))
        lo, hi = self.time_step_limit
        if lo > 0.0 or hi < math.inf:
            dt = mx.clip(dt, lo, hi)
        A = -mx.exp(self.A_log.astype(mx.float32))
        h0 = cache.ssm_state if cache is not None else None
        y, state = F.ssd_scan(x, dt, A, b, c, self.D, initial_state=h0, output_final_state=cache is not None,
                              chunk_size=self.chunk_size, mode=self.mode, device=device)
        if cache is not None:
            cache.ssm_state = state
            cache.offset += T
        y = self.compile_child(self.norm, device, Data(y.reshape(B, T, inner), MTLSize(inner, T, B)), gate=z).array
        return self.compile_child(self.out_proj, device, Data(y, MTLSize(inner, T, B)))

    def _extra_repr(self):
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, state_size={self.state_size}, "
                f"n_groups={self.n_groups}, conv_kernel={self.conv_kernel}")

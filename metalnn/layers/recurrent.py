"""Recurrent layers: `RNN`, `LSTM`, `GRU`.

Input dims ``(W=features, H=T, D=batch)`` (a plain array ``[B, T, features]``); output
``(W=hidden_size, H=T, D=batch)`` (every step's hidden state) or, with ``return_sequences=False``,
``(W=hidden_size, H=1, D=batch)`` (the last one).
Parameter names and gate order follow ``torch.nn.RNN/LSTM/GRU`` (``weight_ih``, ``weight_hh``,
``bias_ih``, ``bias_hh``; LSTM gates i, f, g, o; GRU gates r, z, n with the reset gate applied to
``W_hn h + b_hn``), so weights move between the two unchanged. The input projection of all steps is
one matrix product; the recurrence runs step by step in MLX's graph (differentiable end to end).
"""

from __future__ import annotations

import math

import mlx.core as mx

from .. import init as initializers
from ..data import Data, MTLSize
from .base import Layer
from .linear import float_dtype


class _Recurrent(Layer):
    gates = 1
    fixed_axes = ("W",)
    positional_hint = ("{cls}({extra[0]}) for mlx.nn's {cls}({hidden_size}, {extra[0]}): the input size is taken "
                       "from the first input")

    def __init__(self, hidden_size: int, *, bias: bool = True, return_sequences: bool = True, init=None,
                 dtype=None):
        super().__init__()
        name = type(self).__name__
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"{name}: hidden_size must be a positive int, got {hidden_size!r}")
        self.hidden_size = int(hidden_size)
        self.use_bias = bool(bias)
        self.return_sequences = return_sequences
        bound = 1.0 / math.sqrt(self.hidden_size)  # mlx.nn's and torch's U(-1/sqrt(hidden), 1/sqrt(hidden))
        self.init = initializers.get(init, initializers.Uniform(-bound, bound))
        self._dtype = dtype

    def build(self, device, dims, dtype):
        g, h = self.gates * self.hidden_size, self.hidden_size
        dt = self._dtype or float_dtype(dtype)
        self.weight_ih = self.init((g, dims.W), dims.W, g, device.next_key(), dt)
        self.weight_hh = self.init((g, h), h, g, device.next_key(), dt)
        if self.use_bias:
            self.bias_ih = self.init((g,), dims.W, g, device.next_key(), dt)
            self.bias_hh = self.init((g,), h, g, device.next_key(), dt)

    def forward(self, device, data):
        d = data.dims
        x = data.array.astype(self.weight_ih.dtype)  # [B, T, F]
        xp = x @ self.weight_ih.T
        if self.use_bias:
            xp = xp + self.bias_ih
        state = self.initial_state(d.D, x.dtype)
        outs = []
        for t in range(d.H):
            state, h = self.step(xp[:, t], state)
            outs.append(h)
        if self.return_sequences:
            return Data(mx.stack(outs, axis=1), MTLSize(self.hidden_size, d.H, d.D))
        return Data(outs[-1][:, None], MTLSize(self.hidden_size, 1, d.D))

    def initial_state(self, batch, dtype):
        return mx.zeros((batch, self.hidden_size), dtype=dtype)

    def _hh(self, h):
        r = h @ self.weight_hh.T
        return r + self.bias_hh if self.use_bias else r


class RNN(_Recurrent):
    """Elman RNN: ``h_t = act(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)``, act ``tanh`` or ``relu``."""

    positional_hint = _Recurrent.positional_hint

    def __init__(self, hidden_size: int, *, nonlinearity: str = "tanh", bias: bool = True,
                 return_sequences: bool = True, init=None, dtype=None):
        super().__init__(hidden_size, bias=bias, return_sequences=return_sequences, init=init, dtype=dtype)
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNN: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}")
        self.nonlinearity = nonlinearity

    def step(self, xp, h):
        pre = xp + self._hh(h)
        h = mx.tanh(pre) if self.nonlinearity == "tanh" else mx.maximum(pre, 0)
        return h, h


class LSTM(_Recurrent):
    """LSTM with gates i, f, g, o: ``c_t = f*c + i*g``, ``h_t = o * tanh(c_t)``."""

    gates = 4

    def initial_state(self, batch, dtype):
        z = mx.zeros((batch, self.hidden_size), dtype=dtype)
        return (z, z)

    def step(self, xp, state):
        h, c = state
        i, f, g, o = mx.split(xp + self._hh(h), 4, axis=-1)
        c = mx.sigmoid(f) * c + mx.sigmoid(i) * mx.tanh(g)
        h = mx.sigmoid(o) * mx.tanh(c)
        return (h, c), h


class GRU(_Recurrent):
    """GRU with gates r, z, n: ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``, ``h' = (1-z)*n + z*h``."""

    gates = 3

    def step(self, xp, h):
        xr, xz, xn = mx.split(xp, 3, axis=-1)
        hr, hz, hn = mx.split(self._hh(h), 3, axis=-1)
        r = mx.sigmoid(xr + hr)
        z = mx.sigmoid(xz + hz)
        n = mx.tanh(xn + r * hn)
        h = (1 - z) * n + z * h
        return h, h

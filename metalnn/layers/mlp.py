"""Feed-forward blocks: `MLP` (plain or gated, with ``flop_count``) and `SwiGLU` (the gated one).

One implementation with Hugging Face's names: a plain MLP has ``up_proj`` ``[hidden, W]`` and
``down_proj`` ``[W, hidden]``; a gated one also ``gate_proj`` ``[hidden, W]`` and computes
``down_proj(act(gate_proj(x)) * up_proj(x))`` (Llama's, Qwen's and Mistral's MLP).
"""

from __future__ import annotations

import math

from .. import functional as F
from ..data import Data
from .base import Layer
from .dropout import Dropout
from .linear import Linear

#: gated variant name -> activation of the gate
GATED = {"swiglu": "silu", "glu": "sigmoid", "geglu": "gelu", "geglu_tanh": "gelu_tanh", "reglu": "relu"}


class MLP(Layer):
    """Position-wise two-layer MLP, the channel-mixing branch of a residual block.

    Plain (any activation name of `metalnn.functional.activations`, e.g. ``relu``, ``gelu`` (exact),
    ``gelu_approx``, ``silu``): ``y = down_proj(dropout(act(up_proj(x))))``.

    Gated (``swiglu``, ``glu``, ``geglu``, ``geglu_tanh``, ``reglu``):
    ``y = down_proj(dropout(gate(gate_proj(x)) * up_proj(x)))`` with ``gate`` SiLU, sigmoid, GELU,
    tanh-GELU or ReLU.

    Input and output width ``W = dims``; hidden width ``hidden_dims``, by default
    ``floor(expansion_factor * dims)``.

    Args:
        dims: input and output width (optional: taken from the first input).
        activation: activation or gated variant name (default ``gelu``).
        expansion_factor: hidden width multiplier when ``hidden_dims`` is not given (about 4/3 keeps
            a gated MLP at a plain one's parameter count with 2).
        hidden_dims: hidden width.
        dropout: dropout probability (training mode only), before ``down_proj``.
        bias: biases on the projections (Llama's ``mlp_bias``).
        init, init_out: initializers of the input projections and of ``down_proj`` (default:
            `Linear`'s).
        dtype: parameter dtype.
    """

    fixed_axes = ("W",)
    positional_hint = "{cls}({dims}, activation={extra[0]!r})"

    def __init__(self, dims: int | None = None, *, activation: str = "gelu", expansion_factor: float = 2.0,
                 hidden_dims: int | None = None, dropout: float = 0.0, bias: bool = False, init=None, init_out=None,
                 dtype=None):
        super().__init__()
        self.gate_activation = GATED.get(activation)
        F.check_activation(self.gate_activation or activation)
        self.activation = activation
        self.expansion_factor = float(expansion_factor)
        self.hidden_dims = None if hidden_dims is None else int(hidden_dims)
        if self.hidden_dims is not None and self.hidden_dims <= 0:
            raise ValueError(f"{type(self).__name__}: hidden_dims must be positive, got {hidden_dims}")
        self.use_bias = bool(bias)
        self._init, self._init_out, self._dtype = init, init_out, dtype
        self.dropout = Dropout(dropout)
        self.dims = None
        if dims is not None:
            self._create(int(dims), in_features=int(dims))
            self.mark_built((int(dims), 1, 1))

    @property
    def is_gated(self) -> bool:
        return self.gate_activation is not None

    def _create(self, dims, in_features=None):
        self.dims = dims
        if self.hidden_dims is None:
            self.hidden_dims = int(math.floor(self.expansion_factor * dims))
            if self.hidden_dims <= 0:
                raise ValueError(f"{type(self).__name__}: hidden width floor({self.expansion_factor} * {dims}) "
                                 "must be positive")
        kw = dict(bias=self.use_bias, dtype=self._dtype)
        if self.is_gated:
            self.gate_proj = Linear(self.hidden_dims, in_features=in_features, init=self._init, **kw)
        self.up_proj = Linear(self.hidden_dims, in_features=in_features, init=self._init, **kw)
        self.down_proj = Linear(dims, in_features=None if in_features is None else self.hidden_dims,
                                init=self._init_out, **kw)

    def build(self, device, dims, dtype):
        self._create(dims.W)

    def forward(self, device, data):
        up = self.compile_child(self.up_proj, device, data).array
        if self.is_gated:
            gate = self.compile_child(self.gate_proj, device, data).array
            h = F.gated_activation(gate, up, self.gate_activation, device=device)
        else:
            h = F.activation(up, self.activation, device=device)
        h = self.compile_child(self.dropout, device, Data(h, data.dims._replace(W=self.hidden_dims)))
        return self.compile_child(self.down_proj, device, h)

    def flop_count(self, num_tokens: int) -> int:
        """FLOPs for ``num_tokens`` positions: 2 per multiply-add in every projection, 1 per
        activation element, and 1 more per element for the gate product of gated variants."""
        if self.dims is None:
            raise ValueError(f"{type(self).__name__}.flop_count: the width is not known yet (give dims= or "
                             "compile the layer first)")
        t, d, h = int(num_tokens), self.dims, self.hidden_dims
        projections = (3 if self.is_gated else 2) * 2 * t * d * h
        return projections + t * h + (t * h if self.is_gated else 0)

    def _extra_repr(self):
        return f"dims={self.dims}, hidden_dims={self.hidden_dims}, activation={self.activation!r}"


class SwiGLU(MLP):
    """The gated feed-forward block ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (Llama's MLP).

    The same layer as ``MLP(activation="swiglu", hidden_dims=hidden_dims)``; the input width is
    taken from the first input.

    Args:
        hidden_dims: hidden width (Hugging Face's ``intermediate_size``).
        activation: the gate's activation (``silu``; ``gelu`` / ``gelu_tanh`` give GeGLU, ``sigmoid``
            GLU).
        bias, dropout, init, init_out, dtype: as `MLP`.
    """

    positional_hint = "{cls}({hidden_dims}, activation=...)"

    def __init__(self, hidden_dims: int, *, activation: str = "silu", bias: bool = False,
                 dropout: float = 0.0, init=None, init_out=None, dtype=None, dims: int | None = None):
        gated = {v: k for k, v in GATED.items()}
        if activation not in gated:
            raise ValueError(f"SwiGLU: the gate activation must be one of {sorted(gated)}, got {activation!r}")
        super().__init__(dims, activation=gated[activation], hidden_dims=hidden_dims, dropout=dropout, bias=bias,
                         init=init, init_out=init_out, dtype=dtype)

"""Feed-forward blocks: `MLP` (plain or gated, with ``flop_count``), `SwiGluFfn` (Llama names) and
`GPT2MLP` (GPT-2 names)."""

from __future__ import annotations

import math

import mlx.core as mx

from .. import fastmath
from .. import init as initializers
from ..data import Data
from ..layer import Layer
from .activations import gelu
from .dropout import Dropout
from .linear import Linear

_PLAIN = ("relu", "gelu", "gelu_tanh", "silu")
_GATED = ("glu", "swiglu")


def _act(name, x):
    if name == "relu":
        return mx.maximum(x, 0)
    if name == "gelu":
        return gelu(x, "none")
    if name in ("gelu_tanh", "gelu_new", "gelu_pytorch_tanh"):
        return gelu(x, "tanh")
    if name in ("silu", "swish", "swiglu"):
        return fastmath.silu(x)
    if name in ("glu", "sigmoid"):
        return fastmath.sigmoid(x)
    raise ValueError(f"unknown activation {name!r}")


def _torch_default_init():
    # PyTorch's nn.Linear default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    return initializers.KaimingUniform(gain=1.0 / math.sqrt(3.0))


class MLP(Layer):
    """Position-wise two-layer MLP, the channel-mixing branch of a residual block.

    Plain (``relu``, ``gelu`` (exact erf), ``gelu_tanh``, ``silu``): ``y = layer2(act(layer1(x)))``
    with ``layer1: dim -> hidden``, ``layer2: hidden -> dim``.

    Gated (``glu``, ``swiglu``): ``layer1: dim -> 2*hidden``; its output is split at the middle into
    ``[a, b]`` and ``y = layer2(gate(a) * b)`` with ``gate = sigmoid`` (glu) or ``silu`` (swiglu).

    ``hidden = floor(expansion_factor * dim)``. Dropout (while training) sits between the
    activation (or gate product) and ``layer2``.

    Args:
        dim: input and output width ``W``.
        activation: one of ``relu``, ``gelu``, ``gelu_tanh``, ``silu``, ``glu``, ``swiglu``.
        expansion_factor: hidden width multiplier (use about 4/3 for gated variants to keep the
            parameter count of a plain MLP with 2).
        dropout: dropout probability.
        bias: biases on both layers (initialised to zero).
        init_method_in, init_method_out: initializers (name, `metalnn.init.Initializer` or callable)
            for ``layer1`` / ``layer2``; default PyTorch's ``nn.Linear`` init.
    """

    fixed_axes = ("W",)

    def __init__(self, dim: int, activation: str = "gelu", expansion_factor: float = 2.0, dropout: float = 0.0,
                 bias: bool = False, init_method_in=None, init_method_out=None, seed: int | None = None):
        super().__init__()
        if activation not in _PLAIN + _GATED:
            raise ValueError(f"MLP: activation must be one of {_PLAIN + _GATED}, got {activation!r}")
        self.dim = int(dim)
        self.activation = activation
        self.expansion_factor = float(expansion_factor)
        self.hidden_dim = int(math.floor(self.expansion_factor * self.dim))
        if self.hidden_dim <= 0:
            raise ValueError(f"MLP: hidden width floor({expansion_factor} * {dim}) must be positive")
        self.is_glu_variant = activation in _GATED
        glu_factor = 2 if self.is_glu_variant else 1
        init_in = initializers.get(init_method_in) if init_method_in is not None else _torch_default_init()
        init_out = initializers.get(init_method_out) if init_method_out is not None else _torch_default_init()
        self.seed = seed
        self.layer1 = Linear(self.hidden_dim * glu_factor, bias=bias, init=init_in)
        self.layer2 = Linear(self.dim, bias=bias, init=init_out)
        self.dropout = Dropout(dropout)

    def build(self, device, dims, dtype):
        self.require(dims.W == self.dim, f"input W={self.dim}", f"W={dims.W}")
        # Create the weights now (so keys come from the device unless a seed was given).
        dtype = dtype if mx.issubdtype(dtype, mx.floating) else mx.float32
        if self.seed is not None:
            keys = mx.random.split(mx.random.key(self.seed))
        else:
            keys = (device.next_key(), device.next_key())
        for layer, key, fan_in in ((self.layer1, keys[0], self.dim), (self.layer2, keys[1], self.hidden_dim)):
            if not layer.built:
                layer._create(fan_in, dtype, key)
                layer._built = True
                layer._built_dims = dims._replace(W=fan_in)

    def forward(self, device, data):
        h = self.compile_child("layer1", self.layer1, device, data).array
        if self.is_glu_variant:
            a, b = mx.split(h, 2, axis=-1)
            h = _act(self.activation, a) * b
        else:
            h = _act(self.activation, h)
        h = Data(h, data.dims._replace(W=self.hidden_dim))
        h = self.compile_child("dropout", self.dropout, device, h)
        return self.compile_child("layer2", self.layer2, device, h)

    def flop_count(self, num_tokens: int) -> int:
        """FLOPs for ``num_tokens`` positions: 2 per multiply-add in both layers, 1 per activation
        element, and 1 more per element for the gate product of gated variants."""
        t = int(num_tokens)
        in1, out1 = self.dim, self.hidden_dim * (2 if self.is_glu_variant else 1)
        flops = 2 * t * in1 * out1
        flops += t * self.hidden_dim
        if self.is_glu_variant:
            flops += t * self.hidden_dim
        flops += 2 * t * self.hidden_dim * self.dim
        return flops

    def _extra_repr(self):
        return f"dim={self.dim}, hidden_dim={self.hidden_dim}, activation={self.activation!r}"


class SwiGluFfn(Layer):
    """Llama's gated feed-forward: ``down_proj(act(gate_proj(x)) * up_proj(x))``, act = SiLU.

    Parameters (Hugging Face names): ``gate_proj``, ``up_proj`` ``[intermediate, W]``, ``down_proj``
    ``[W, intermediate]``.

    Args:
        intermediate: hidden width.
        bias: biases on the three projections (Llama's ``mlp_bias``).
        activation: the gate activation (``silu``; ``gelu``/``gelu_tanh`` give GeGLU).
    """

    fixed_axes = ("W",)

    def __init__(self, intermediate: int, bias: bool = False, activation: str = "silu", init="xavier_normal"):
        super().__init__()
        self.intermediate = int(intermediate)
        self.use_bias = bias
        self.activation = activation
        _act(activation, mx.zeros((1,)))  # validates the name
        self.gate_proj = Linear(self.intermediate, bias=bias, init=init)
        self.up_proj = Linear(self.intermediate, bias=bias, init=init)
        self._init = init

    def build(self, device, dims, dtype):
        if "down_proj" not in self:
            self.down_proj = Linear(dims.W, bias=self.use_bias, init=self._init)

    def forward(self, device, data):
        g = self.compile_child("gate_proj", self.gate_proj, device, data).array
        u = self.compile_child("up_proj", self.up_proj, device, data).array
        h = Data(_act(self.activation, g) * u, data.dims._replace(W=self.intermediate))
        return self.compile_child("down_proj", self.down_proj, device, h)

    def flop_count(self, num_tokens: int) -> int:
        """Same convention as `MLP.flop_count` (the model width is known once built)."""
        w = self.down_proj.out_features if "down_proj" in self else None
        if w is None:
            raise ValueError("SwiGluFfn.flop_count: compile the layer first (its width is not known yet)")
        t, h = int(num_tokens), self.intermediate
        return 2 * t * w * 2 * h + 2 * t * h + 2 * t * h * w


class GPT2MLP(Layer):
    """GPT-2's feed-forward: ``c_proj(gelu_tanh(c_fc(x)))`` with biases.

    ``c_fc``: ``[intermediate, W]``, ``c_proj``: ``[W, intermediate]`` in metalnn's ``[out, in]``
    layout (Hugging Face stores GPT-2's transposed; the GPT-2 model converts).
    """

    fixed_axes = ("W",)

    def __init__(self, intermediate: int, activation: str = "gelu_tanh", bias: bool = True, init="xavier_normal"):
        super().__init__()
        self.intermediate = int(intermediate)
        self.activation = activation
        _act(activation, mx.zeros((1,)))
        self.use_bias = bias
        self.c_fc = Linear(self.intermediate, bias=bias, init=init)
        self._init = init

    def build(self, device, dims, dtype):
        if "c_proj" not in self:
            self.c_proj = Linear(dims.W, bias=self.use_bias, init=self._init)

    def forward(self, device, data):
        h = self.compile_child("c_fc", self.c_fc, device, data).array
        h = Data(_act(self.activation, h), data.dims._replace(W=self.intermediate))
        return self.compile_child("c_proj", self.c_proj, device, h)

"""GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm pre-norm blocks, fused-qkv attention.

Parameter names equal Hugging Face's (``transformer.wte.weight``, ``transformer.h.<i>.attn.c_attn.weight``,
...). Hugging Face stores GPT-2's projection weights (its ``Conv1D``) as ``[in, out]``; metalnn's
`Linear` keeps ``[out, in]``, so they are transposed on load and transposed back on save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from ... import functional as F
from ... import init as initializers
from ...data import Data
from ...layers.base import Layer
from ...layers.attention import merge_heads, split_heads
from ...layers.embedding import Embedding
from ...layers.linear import Linear
from ...layers.norm import LayerNorm
from .base import BaseModelArgs, CausalLM, refuse
from .registry import register

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
#: Hugging Face GPT-2 activation names -> metalnn's (gelu_fast is GPT-2's tanh form with other constants)
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu",
               "relu": "relu", "silu": "silu", "swish": "silu"}


@dataclass
class ModelArgs(BaseModelArgs):
    """The keys of a Hugging Face ``GPT2Config`` that metalnn reads (absent ones take these defaults).

    ``n_inner`` defaults to ``4 * n_embd``; ``activation_function`` is one of `ACTIVATIONS`;
    ``add_cross_attention`` (an encoder-decoder GPT-2) is refused.
    """

    vocab_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_positions: int = 1024
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    add_cross_attention: bool = False
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02

    def __post_init__(self):
        super().__post_init__()
        if self.add_cross_attention:
            refuse("add_cross_attention", self.add_cross_attention, "false (GPT-2 without cross-attention)")
        if self.activation_function not in ACTIVATIONS:
            refuse("activation_function", self.activation_function, ", ".join(ACTIVATIONS))
        self.n_inner = self.n_inner or 4 * self.n_embd


class GPT2Attention(Layer):
    """GPT-2's causal multi-head attention: one fused ``c_attn`` projection to q, k, v and ``c_proj``.

    No rotary embeddings (GPT-2 adds learned positions to the input). ``c_attn.weight`` is
    ``[3W, W]`` in metalnn's ``[out, in]`` layout; Hugging Face stores GPT-2's as ``[in, out]``
    (its ``Conv1D``), which the GPT-2 model transposes on load and save.

    Args:
        n_heads: attention heads (``W`` must be divisible by it).
        bias: biases on both projections (GPT-2 has them).
        scale: score scale (default ``head_dim ** -0.5``).
    """

    fixed_axes = ("W",)

    def __init__(self, n_heads: int, *, bias: bool = True, causal: bool = True, scale: float | None = None,
                 init=None):
        super().__init__()
        self.n_heads = int(n_heads)
        self.use_bias = bias
        self.causal = causal
        self.scale = scale
        self._init = init

    def build(self, device, dims, dtype):
        self.require(dims.W % self.n_heads == 0, f"a width divisible by n_heads={self.n_heads}", f"W={dims.W}")
        if "c_attn" not in self:
            self.c_attn = Linear(3 * dims.W, bias=self.use_bias, init=self._init)
            self.c_proj = Linear(dims.W, bias=self.use_bias, init=self._init)

    def forward(self, device, data, cache=None):
        d = data.dims
        b, t, n = d.D, d.H, self.n_heads
        hd = d.W // n
        qkv = self.compile_child(self.c_attn, device, data).array
        q, k, v = mx.split(qkv, 3, axis=-1)
        q, k, v = (split_heads(a, b, t, n, hd) for a in (q, k, v))
        mask = None
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
            mask = cache.key_mask(t)  # sequences of different lengths in one batch
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(hd)
        o = F.attention(q, k, v, scale=scale, causal=self.causal, mask=mask, device=device)
        o = Data(merge_heads(o, b, t), d)
        return self.compile_child(self.c_proj, device, o)


class GPT2MLP(Layer):
    """GPT-2's feed-forward: ``c_proj(act(c_fc(x)))`` with biases (``act``: the tanh GELU).

    ``c_fc``: ``[intermediate, W]``, ``c_proj``: ``[W, intermediate]`` in metalnn's ``[out, in]``
    layout (Hugging Face stores GPT-2's transposed; the model converts).
    """

    fixed_axes = ("W",)

    def __init__(self, intermediate: int, *, activation: str = "gelu_tanh", bias: bool = True, init=None):
        super().__init__()
        self.intermediate = int(intermediate)
        self.activation = F.check_activation(activation)
        self.use_bias = bias
        self.c_fc = Linear(self.intermediate, bias=bias, init=init)
        self._init = init

    def build(self, device, dims, dtype):
        self.c_proj = Linear(dims.W, bias=self.use_bias, init=self._init)

    def forward(self, device, data):
        h = self.compile_child(self.c_fc, device, data).array
        h = Data(F.activation(h, self.activation, device=device), data.dims._replace(W=self.intermediate))
        return self.compile_child(self.c_proj, device, h)


class GPT2Block(Layer):
    """``h = x + attn(ln_1(x)); out = h + mlp(ln_2(h))`` with GPT-2's names."""

    fixed_axes = ("W",)
    is_block = True

    def __init__(self, n_heads: int, intermediate: int, *, eps: float = 1e-5, scale: float | None = None,
                 activation: str = "gelu_tanh", init=None):
        super().__init__()
        self.ln_1 = LayerNorm(eps=eps)
        self.attn = GPT2Attention(n_heads, scale=scale, init=init)
        self.ln_2 = LayerNorm(eps=eps)
        self.mlp = GPT2MLP(intermediate, activation=activation, init=init)

    def forward(self, device, data, cache=None):
        h = self.compile_child(self.ln_1, device, data)
        h = self.compile_child(self.attn, device, h, cache=cache)
        x = data.array + h.array
        h = self.compile_child(self.ln_2, device, Data(x, data.dims))
        h = self.compile_child(self.mlp, device, h)
        return Data(x + h.array, data.dims)


class GPT2Model(Layer):
    """Token and position embeddings, blocks and final LayerNorm (``transformer.*`` in a checkpoint).

    Input: token ids ``(W=T, H=1, D=B)``; output: hidden states ``(W=n_embd, H=T, D=B)``. ``cache=``
    holds one `KVCache` per block; its offset gives the positions of the new tokens.
    """

    def __init__(self, vocab_size, n_positions, n_embd, blocks, eps, init_std=0.02):
        super().__init__()
        self.wte = Embedding(vocab_size, n_embd, init=initializers.Normal(init_std))
        self.wpe = Embedding(n_positions, n_embd, init=initializers.Normal(init_std))
        self.h = blocks
        self.ln_f = LayerNorm(n_embd, eps=eps)

    def forward(self, device, data, cache=None):
        x = self.compile_child(self.wte, device, data)
        # the next position: an int, or one per sequence ([B]) for a batch of different lengths
        start = cache[0].positions if cache is not None else 0
        pos = mx.arange(x.dims.H, dtype=mx.int32)[None] + (start[:, None] if isinstance(start, mx.array) else start)
        p = self.compile_child(self.wpe, device, Data(pos))
        h = Data(x.array + p.array, x.dims)
        for i, block in enumerate(self.h):
            h = self.compile_child(block, device, h, cache=cache[i] if cache is not None else None)
        return self.compile_child(self.ln_f, device, h)


@register("GPT2LMHeadModel", model_types=("gpt2",))
class GPT2LMHeadModel(CausalLM):
    """GPT-2 built from a Hugging Face ``GPT2Config`` dict (`ModelArgs` lists the keys read).

    Input token ids ``[B, T]`` with ``T`` up to ``n_positions``, logits ``[B, T, vocab_size]``;
    ``model.transformer`` is the `GPT2Model`.

    Args: see `CausalLM` (``config``, ``seed``).
    """

    args_class = ModelArgs

    def _build(self, args: ModelArgs):
        init = initializers.Normal(args.initializer_range)  # transformers' init
        head_dim = args.n_embd // args.n_head
        blocks = []
        for i in range(args.n_layer):
            scale = 1.0 / math.sqrt(head_dim) if args.scale_attn_weights else 1.0
            if args.scale_attn_by_inverse_layer_idx:
                scale /= float(i + 1)
            blocks.append(GPT2Block(args.n_head, args.n_inner, eps=args.layer_norm_epsilon, scale=scale,
                                    activation=ACTIVATIONS[args.activation_function], init=init))
        self.transformer = GPT2Model(args.vocab_size, args.n_positions, args.n_embd, blocks, args.layer_norm_epsilon,
                                     args.initializer_range)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.vocab_size, bias=False, init=init)

    @property
    def backbone(self):
        return self.transformer

    @property
    def input_embeddings(self):
        return self.transformer.wte

    @property
    def decoder_layers(self):
        return self.transformer.h

    @property
    def max_positions(self):
        return self.args.n_positions

    def rename_weight(self, name):
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
            return None  # causal-mask buffers of older checkpoints
        if name == "lm_head.weight":
            return None if self.tie_word_embeddings else name
        if not name.startswith("transformer."):
            name = "transformer." + name  # checkpoints saved from GPT2Model have no prefix
        return name

    def transform_weight(self, name, array):
        # quantized (packed uint32) weights are stored in metalnn's [out, in] layout already
        if name.endswith(_CONV1D) and array.ndim == 2 and mx.issubdtype(array.dtype, mx.floating):
            return array.T
        return array

    def export_weights(self):
        out = {}
        for name, a in self.named_parameters().items():
            out[name] = a.T if name.endswith(_CONV1D) and mx.issubdtype(a.dtype, mx.floating) else a
        return out

"""GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm pre-norm blocks, fused-qkv attention.

Parameter names equal Hugging Face's (``transformer.wte.weight``, ``transformer.h.<i>.attn.c_attn.weight``,
...). Hugging Face stores GPT-2's projection weights (its ``Conv1D``) as ``[in, out]``; metalnn's
`Linear` keeps ``[out, in]``, so they are transposed on load and transposed back on save.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .. import init as initializers
from ..data import Data, MTLSize
from ..layers.attention import CachedLayer
from ..layers.embedding import Embeddings
from ..layers.linear import Linear
from ..layers.norm import LayerNorm
from ..layers.transformer import GPT2Block
from .base import CausalLM
from .llama import UnsupportedConfigError

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu",
         "relu": "relu", "silu": "silu", "swish": "silu"}


class GPT2Model(CachedLayer):
    """Token and position embeddings, blocks and final LayerNorm (``transformer.*`` in a checkpoint)."""

    def __init__(self, vocab_size, n_positions, n_embd, blocks, eps, init_std=0.02):
        super().__init__()
        self.wte = Embeddings(vocab_size, n_embd, init=initializers.Normal(init_std))
        self.wpe = Embeddings(n_positions, n_embd, init=initializers.Normal(init_std))
        self.h = blocks
        self.ln_f = LayerNorm(eps)

    def forward(self, device, data, cache=None):
        x = self.compile_child("wte", self.wte, device, data)
        offset = cache[0].offset if cache is not None else 0
        pos = mx.arange(offset, offset + x.dims.H, dtype=mx.int32)[None]
        p = self.compile_child("wpe", self.wpe, device, Data(pos))
        h = Data(x.array + p.array, x.dims)
        for i, block in enumerate(self.h):
            h = self.compile_child(f"h.{i}", block, device, h, cache[i] if cache is not None else None)
        return self.compile_child("ln_f", self.ln_f, device, h)


class GPT2LMHeadModel(CausalLM):
    """GPT-2 built from a Hugging Face ``GPT2Config`` dict.

    Honoured config keys: ``vocab_size``, ``n_positions``, ``n_embd``, ``n_layer``, ``n_head``,
    ``n_inner``, ``activation_function``, ``layer_norm_epsilon``, ``scale_attn_weights``,
    ``scale_attn_by_inverse_layer_idx``, ``tie_word_embeddings`` (default True),
    ``initializer_range``.
    """

    architecture = "GPT2LMHeadModel"
    model_type = "gpt2"

    def __init__(self, config: dict, seed: int = 0):
        super().__init__(config)
        c = self.config
        if c.get("add_cross_attention"):
            raise UnsupportedConfigError("GPT-2 with cross-attention (add_cross_attention) is not supported")
        n_embd, n_head = int(c["n_embd"]), int(c["n_head"])
        act = c.get("activation_function", "gelu_new")
        if act not in _ACTS:
            raise UnsupportedConfigError(f"activation_function {act!r} is not supported")
        inner = int(c.get("n_inner") or 4 * n_embd)
        eps = float(c.get("layer_norm_epsilon", 1e-5))
        blocks = []
        for i in range(int(c["n_layer"])):
            scale = 1.0 / math.sqrt(n_embd // n_head) if c.get("scale_attn_weights", True) else 1.0
            if c.get("scale_attn_by_inverse_layer_idx", False):
                scale /= float(i + 1)
            blocks.append(GPT2Block(n_head, inner, eps=eps, scale=scale, activation=_ACTS[act]))
        self.tie_word_embeddings = bool(c.get("tie_word_embeddings", True))
        self.transformer = GPT2Model(int(c["vocab_size"]), int(c.get("n_positions", 1024)), n_embd, blocks, eps,
                                     float(c.get("initializer_range", 0.02)))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(int(c["vocab_size"]), bias=False)
        self._materialize(seed)

    @property
    def num_layers(self):
        return len(self.transformer.h)

    @property
    def max_positions(self):
        return int(self.config.get("n_positions", 1024))

    def forward(self, device, data, cache=None):
        ids = self._token_batch(data)
        b, t = ids.shape
        self._check_positions(cache, t)
        h = self.compile_child("transformer", self.transformer, device, Data(ids), cache)
        if self.tie_word_embeddings:
            return Data(self.transformer.wte.as_linear(h.array), MTLSize(self.vocab_size, t, b))
        return self.compile_child("lm_head", self.lm_head, device, h)

    def rename_weight(self, name):
        if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
            return None  # causal-mask buffers of older checkpoints
        if name == "lm_head.weight":
            return None if self.tie_word_embeddings else name
        if not name.startswith("transformer."):
            name = "transformer." + name  # checkpoints saved from GPT2Model have no prefix
        return name

    def transform_weight(self, name, array):
        if name.endswith(_CONV1D) and array.ndim == 2:
            return array.T
        return array

    def export_weights(self):
        out = {}
        for name, a in self.named_parameters().items():
            out[name] = a.T if name.endswith(_CONV1D) else a
        return out

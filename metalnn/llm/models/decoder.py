"""Shared pieces of the RMSNorm decoder families (Llama, Mistral, Qwen2, Qwen3, Qwen3-Next, Qwen3.5, Gemma):
the `DecoderStack` (embedding, blocks, final norm: the ``model.*`` of their checkpoints), `build_decoder`
(that stack and the untied head, from a family's layer builder) and the per-layer plans their configs
describe (`check_layer_types`, `sliding_windows`).
"""

from __future__ import annotations

import mlx.core as mx

from ... import functional as F
from ... import init as initializers
from ...data import Data
from ...errors import UnsupportedConfigError
from ...layers.attention import KVCache
from ...layers.base import Layer, parameter_epoch
from ...layers.batch_cache import BatchKVCache
from ...layers.embedding import Embedding
from ...layers.linear import Linear
from ...layers.norm import RMSNorm
from ...layers.transformer import step_gain, step_matrix
from .base import refuse

#: Qwen2 / Qwen3 ``layer_types`` entries
SLIDING = ("full_attention", "sliding_attention")


class DecoderStack(Layer):
    """Token embedding, decoder blocks and final RMSNorm (``model.embed_tokens``, ``model.layers.<i>``,
    ``model.norm`` in a checkpoint).

    Input: token ids ``(W=T, H=1, D=B)``; output: hidden states ``(W=hidden_size, H=T, D=B)``.
    ``cache=`` is a list with one entry per block (each block gets its own).

    Args:
        vocab_size, hidden_size: embedding table size and width.
        layers: the decoder blocks (each called as ``block.compile(device, h, cache=...)``).
        eps: epsilon of the final RMSNorm.
        init_std: std of the embedding initialisation.
        norm_offset: gain offset of the final RMSNorm (1 for zero-centred gains; see `RMSNorm`).
        embed_scale: multiplies the embedded tokens (Gemma's ``sqrt(hidden_size)``), rounded to the
            table's dtype first as transformers does; None: no scaling.
    """

    def __init__(self, vocab_size: int, hidden_size: int, layers: list, *, eps: float, init_std: float = 0.02,
                 norm_offset: float = 0.0, embed_scale: float | None = None):
        super().__init__()
        self.embed_scale = None if embed_scale is None else float(embed_scale)
        self.embed_tokens = Embedding(vocab_size, hidden_size, init=initializers.Normal(init_std))
        self.layers = list(layers)
        self.norm = RMSNorm(hidden_size, eps=eps, offset=norm_offset)

    def forward(self, device, data, cache=None):
        h = self._embed(device, data)
        fused = self._fused_step(device, h.array, cache) if cache is not None and h.dims.H == 1 else None
        if fused is not None:
            h = Data(fused, h.dims)
        else:
            for i, layer in enumerate(self.layers):
                h = self.compile_child(layer, device, h, cache=cache[i] if cache is not None else None)
        return self.compile_child(self.norm, device, h)

    def fused_logits(self, device, ids, cache, head, last_only: bool = False):
        """Logits ``[B, T, vocab]`` (``[B, 1, vocab]`` of each sequence's last position with
        ``last_only``) of T new positions a sequence (integer token ids ``[B, T]``, T at most
        `metalnn.functional.decode_step.STACK_POSITIONS`) through the embedding, every block, the
        final norm and ``head`` (the output head: an ``lm_head`` projection, or the token table when
        tied) as one fused node; None (nothing done) where the fused step does not run them (the
        caller then runs the model as usual)."""
        head_plan, table_plan = self._end_plans(head)
        if head_plan is None:
            return None
        if table_plan is not None:  # (the lookup inside the node too)
            return self._fused_step(device, ids, cache, head_plan, table_plan, last_only=last_only)
        return self._fused_step(device, self._embed(device, Data(ids)).array, cache, head_plan, last_only=last_only)

    def _embed(self, device, data):
        h = self.compile_child(self.embed_tokens, device, data)
        if self.embed_scale is not None:
            h = Data(h.array * mx.array(self.embed_scale, dtype=h.array.dtype), h.dims)
        return h

    def _fused_step(self, device, x, cache, head=None, embedding=None, last_only: bool = False):
        """New positions (``x`` ``[B, T, D]``, or token ids ``[B, T]`` with ``embedding``) through
        every block (then ``head``: a `metalnn.functional.StackHead`) as one fused node
        (`metalnn.functional.decoder_stack_step`) when each block is a fused-step `DecoderBlock` with
        a `KVCache` (or `BatchKVCache`); None otherwise (the blocks then run one by one)."""
        if len(cache) != len(self.layers) or type(cache[0]) not in (KVCache, BatchKVCache):
            return None  # (decoder_stack_step checks that every cache is of the first one's class)
        steps = self._step_plans()
        if steps is None:
            return None
        return F.decoder_stack_step(x, steps, cache, device=device, head=head, embedding=embedding,
                                    last_only=last_only)

    def _end_plans(self, head):
        """``(StackHead, StackEmbedding)``: the final norm and ``head``, and the token table, as the
        fused step takes them (each None where it cannot); kept until a parameter changes."""
        key = (parameter_epoch(), id(head))
        cached = self.__dict__.get("_end_plans_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        gain, projection, table = step_gain(self.norm), step_matrix(head), step_matrix(self.embed_tokens)
        head_plan = table_plan = None
        if gain is not None and projection is not None:
            head_plan = F.StackHead(gain=gain, eps=self.norm.eps, weight=projection[0], type_id=projection[1])
        if table is not None:
            table_plan = F.StackEmbedding(weight=table[0], type_id=table[1], scale=self.embed_scale)
        object.__setattr__(self, "_end_plans_cache", (key, (head_plan, table_plan)))  # (outside the parameter tree)
        return head_plan, table_plan

    def _step_plans(self):
        """Every block's `fused_step_plan`, or None when a block has none; kept until a parameter or a
        block's training mode changes (a decoding step then asks once, not once a block)."""
        key = (parameter_epoch(), tuple(layer.training for layer in self.layers))
        cached = self.__dict__.get("_step_plans_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        plans = []
        for layer in self.layers:
            plan_of = getattr(layer, "fused_step_plan", None)
            plan = plan_of() if plan_of is not None else None
            if plan is None:  # (not kept: a block that is not built yet has a plan after its first call)
                return None
            plans.append(plan)
        object.__setattr__(self, "_step_plans_cache", (key, plans))  # (outside the module's parameter tree)
        return plans


def build_decoder(lm, args, make_layer, *, eps: float | None = None, norm_offset: float = 0.0):
    """Build the common layout of a decoder family in ``lm`` (a `CausalLM`, from its ``_build``), with
    transformers' initialisation (normal, std ``args.initializer_range``, given to each layer as ``init``):

    * ``lm.model``: a `DecoderStack` of ``make_layer(i, init)`` for ``i`` in ``range(args.num_hidden_layers)``,
      its final RMSNorm of epsilon ``eps`` (default ``args.rms_norm_eps``) and gain offset ``norm_offset``;
    * ``lm.lm_head``: an untied output `Linear` ``[vocab_size, hidden_size]`` (no bias), unless
      ``args.tie_word_embeddings``.
    """
    init = initializers.Normal(args.initializer_range)
    layers = [make_layer(i, init) for i in range(args.num_hidden_layers)]
    lm.model = DecoderStack(args.vocab_size, args.hidden_size, layers, eps=args.rms_norm_eps if eps is None else eps,
                            init_std=args.initializer_range, norm_offset=norm_offset)
    if not args.tie_word_embeddings:
        lm.lm_head = Linear(args.vocab_size, bias=False, init=init)


def check_layer_types(layer_types, num_hidden_layers: int, allowed: tuple) -> list:
    """``layer_types`` (one entry per layer) checked against ``allowed``.

    Raises:
        UnsupportedConfigError: not a list of ``num_hidden_layers`` entries, or an entry outside ``allowed``.
    """
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_hidden_layers:
        raise UnsupportedConfigError(f"layer_types must list one entry per layer (num_hidden_layers="
                                     f"{num_hidden_layers}), got {layer_types!r}")
    for i, kind in enumerate(layer_types):
        if kind not in allowed:
            refuse(f"layer_types[{i}]", kind, ", ".join(allowed))
    return list(layer_types)


def sliding_windows(num_hidden_layers: int, *, use_sliding_window: bool, sliding_window: int | None,
                    max_window_layers: int, layer_types: list | None) -> list:
    """Per layer: the attention window or None, as transformers' Qwen2 / Qwen3 configs decide it: only
    when ``use_sliding_window`` is set, on the layers ``layer_types`` marks ``sliding_attention`` (by
    default those from ``max_window_layers`` on)."""
    window = sliding_window if use_sliding_window else None
    if layer_types is None:
        types = ["sliding_attention" if window is not None and i >= max_window_layers else "full_attention"
                 for i in range(num_hidden_layers)]
    else:
        types = check_layer_types(layer_types, num_hidden_layers, SLIDING)
    return [window if window is not None and kind == "sliding_attention" else None for kind in types]

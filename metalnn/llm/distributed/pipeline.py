"""Pipeline parallelism: each rank of a group holds a contiguous run of decoder blocks (rank 0 also the
token table, the last rank the final norm and the output head) and hidden states pass from rank to
rank with ``mx.distributed.send`` / ``recv_like``.

Every rank runs the same program (the same `metalnn.generate` call, the same server loop): a call of
the model on rank ``r`` receives the hidden states ``[B, T, hidden]`` from rank ``r - 1`` (rank 0
embeds the tokens), runs its blocks with its own caches and sends the result to rank ``r + 1``; the
last rank applies the norm and the head, and the logits are summed over the group with every other
rank contributing zeros (exact), so every rank gets the same logits and samples the same tokens.
Caches are per rank for its own blocks; the blocks a rank does not hold (`PipelinePeer`) keep a
one-value key per position in their attention cache, or a one-value state per row in their recurrent
cache (`StateCache`: hybrid models), so that offsets, per-row lengths, joining and dropping rows
(`metalnn.layers.batch_cache`) and the prefix cache's rules stay the same on every rank at no real cost.

Ordering of the point-to-point messages in MLX's lazy graph: a send is tied to the cache of the
rank's last block (``mx.depends``), so evaluating the caches (a prefill whose logits are never
evaluated) performs it; a receive depends on the cache of the rank's first block, so the receives
of successive calls happen in order.
"""

from __future__ import annotations

import mlx.core as mx

from ...data import Data, MTLSize
from ...errors import UnsupportedConfigError
from ...layers.attention import KVCache
from ...layers.base import Layer
from ...layers.state_cache import StateCache
from .placement import balance


def _cache_arrays(cache) -> list:
    """The arrays a layer's cache holds (none before its first tokens)."""
    if isinstance(cache, KVCache):
        return [cache.keys] if cache.keys is not None else []
    if isinstance(cache, StateCache):
        return cache.state
    return []


def _tie_to_cache(caches, sent):
    """Make evaluating the last of ``caches`` that holds an array (blocks without one: an MLP-only
    layer's empty cache) perform the send ``sent``."""
    for c in reversed(caches):
        if isinstance(c, KVCache) and c.keys is not None:
            c.keys = mx.depends(c.keys, sent)
            return
        if isinstance(c, StateCache):
            name = next((n for n in c.fields if getattr(c, n) is not None), None)
            if name is not None:
                setattr(c, name, mx.depends(getattr(c, name), sent))
                return


class PipelinePeer(Layer):
    """Stands for a decoder block another rank holds: its output is its input. With a `KVCache` it
    appends one zero key / value of width 1 per position; with a `StateCache` (a recurrent mixer) it
    holds a zero of shape ``[B, 1]`` in each field and counts the tokens. The cache's bookkeeping
    stays that of the real block's (``cache[0].offset``, ragged rows, `merge_rows` / `keep_rows`)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = int(index)

    def forward(self, device, data, cache=None):
        d = data.dims
        if isinstance(cache, KVCache):
            z = mx.zeros((d.D, 1, d.H, 1), data.array.dtype)
            cache.update_and_fetch(z, z)
        elif isinstance(cache, StateCache):
            for name in cache.fields:
                setattr(cache, name, mx.zeros((d.D, 1), data.array.dtype))
            cache.offset += d.H
        return data

    def _extra_repr(self):
        return f"index={self.index}"


class PipelineStack(Layer):
    """One rank's part of a `metalnn.llm.models.decoder.DecoderStack`: parameter names are the
    stack's (``layers.<i>.*`` for the blocks held, ``embed_tokens`` on rank 0 and, for tied heads, the
    last rank, ``norm`` on the last rank).

    Input: token ids ``(W=T, H=1, D=B)``; output ``(W=hidden, H=T, D=B)``: the final hidden states on
    the last rank, on the others the states sent on (for the caller's ordering only).

    Args:
        stack: the whole model's `DecoderStack` (its blocks outside ``[start, end)`` are dropped).
        start, end: the blocks this rank runs.
        group: the pipeline group; this rank is ``group.rank()``.
        hidden_size: the width of the hidden states passed between ranks.
        dtype: their dtype (the model's float dtype).
        keep_table: keep the token table although this is not rank 0 (a tied head on the last rank).
    """

    def __init__(self, stack, start: int, end: int, group, *, hidden_size: int, dtype, keep_table: bool = False):
        super().__init__()
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.start, self.end = int(start), int(end)
        self.hidden_size, self.act_dtype = int(hidden_size), dtype
        self.embed_scale = stack.embed_scale
        if self.rank == 0 or keep_table:
            self.embed_tokens = stack.embed_tokens
        self.layers = [stack.layers[i] if start <= i < end else PipelinePeer(i) for i in range(len(stack.layers))]
        if self.is_last:
            self.norm = stack.norm

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def forward(self, device, data, cache=None):
        b, t = data.dims.D * data.dims.H, data.dims.W
        dims = MTLSize(self.hidden_size, t, b)
        if self.rank == 0:
            h = self.compile_child(self.embed_tokens, device, data)
            x = h.array
            if self.embed_scale is not None:
                x = x * mx.array(self.embed_scale, dtype=x.dtype)
            x = x.astype(self.act_dtype)
        else:
            template = mx.zeros((b, t, self.hidden_size), self.act_dtype)
            held = [a for c in cache[self.start:self.end] for a in _cache_arrays(c)] if cache is not None else []
            if held:
                template = mx.depends(template, held)   # after the previous call's receive
            x = mx.distributed.recv_like(template, self.rank - 1, group=self.group)
        h = Data(x, dims)
        for i, layer in enumerate(self.layers):
            h = self.compile_child(layer, device, h, cache=cache[i] if cache is not None else None)
        if self.is_last:
            return self.compile_child(self.norm, device, h)
        sent = mx.distributed.send(h.array, self.rank + 1, group=self.group)
        if cache is not None:
            _tie_to_cache(cache[self.start:self.end], sent)
        return Data(sent, dims)

    def _extra_repr(self):
        return f"rank={self.rank}/{self.size}, blocks=[{self.start}, {self.end})"


def stage_ranges(model, size: int) -> list:
    """The ``(start, end)`` blocks of each of ``size`` ranks, contiguous and balanced by parameter bytes
    (rank 0 also carries the token table, the last rank the final norm and the head; a tied head
    counts its table on the last rank too). Counted on the model's (lazy) parameters: nothing is read."""
    from .placement import owner

    blocks = [0] * model.num_layers
    first = last = 0
    prefix = _blocks_prefix(model)
    tied = model.tie_word_embeddings
    for name, a in model.named_parameters().items():
        own = owner(name)
        if own.startswith(prefix) and own[len(prefix):].isdigit():
            blocks[int(own[len(prefix):])] += a.nbytes
        elif "embed_tokens" in own:
            first += a.nbytes
            if tied:
                last += a.nbytes
        else:
            last += a.nbytes
    return balance(blocks, size, first=first, last=last)


def _blocks_prefix(model) -> str:
    stack = model.backbone
    for path, m in model.named_modules():
        if m is stack:
            return (path + "." if path else "") + "layers."
    raise UnsupportedConfigError(f"{model.architecture}: its backbone is not a submodule")


def pipeline_model(model, group, dtype):
    """Cut ``model`` (built from its config, parameters not loaded) down to rank ``group.rank()``'s
    stage in place: its `PipelineStack` replaces the `DecoderStack`, the head stays on the last rank
    only. Returns ``(start, end)``, the blocks this rank holds.

    Raises:
        UnsupportedConfigError: a model whose backbone is not a `DecoderStack` with attention caches,
            or more ranks than blocks.
    """
    from ..models.decoder import DecoderStack

    stack = model.backbone
    if type(stack) is not DecoderStack or model.backbone is not model.get("model"):
        raise UnsupportedConfigError(f"{model.architecture}: pipeline parallelism runs models built on a "
                                     f"DecoderStack (model.embed_tokens, model.layers, model.norm)")
    kinds = {type(c).__name__ for c in model.make_cache() if not isinstance(c, (KVCache, StateCache))}
    if kinds:
        raise UnsupportedConfigError(f"{model.architecture}: pipeline parallelism runs models whose layers cache "
                                     f"keys and values or recurrent states, not {sorted(kinds)}")
    size, rank = group.size(), group.rank()
    if size > model.num_layers:
        raise UnsupportedConfigError(f"{model.architecture}: {size} pipeline ranks for {model.num_layers} blocks")
    start, end = stage_ranges(model, size)[rank]
    hidden = int(model.args.hidden_size)
    last = rank == size - 1
    model.model = PipelineStack(stack, start, end, group, hidden_size=hidden, dtype=dtype,
                                keep_table=last and model.tie_word_embeddings)
    if not last and "lm_head" in model:
        del model["lm_head"]
    return start, end


#: a prompt is cut into about this many micro-batches per rank (`PipelineLM.prefill_spans`) ...
MICRO_BATCHES_PER_RANK = 2
#: ... of at least this many tokens each
MIN_MICRO_BATCH = 64


class PipelineLM:
    """Mixin of a `CausalLM` cut to one pipeline stage (`pipeline_model`): the last rank's logits,
    summed over the group with the other ranks' zeros, are every rank's logits.

    A prompt's positions that only fill the caches run as micro-batches (`prefill_spans`): rank
    ``r`` works on micro-batch ``k`` while rank ``r + 1`` works on ``k - 1`` (nothing waits for the
    logits of a micro-batch, and each rank's sends and receives follow its caches), so the ranks run
    at once instead of one after another.
    """

    def prefill_spans(self, length: int) -> list:
        """``(start, end)`` micro-batches of ``length`` positions: ``MICRO_BATCHES_PER_RANK`` per rank,
        of at least ``MIN_MICRO_BATCH`` tokens, as even as whole tokens allow."""
        length = int(length)
        if length <= 0:
            return []
        parts = max(1, min(MICRO_BATCHES_PER_RANK * self.backbone.size, length // MIN_MICRO_BATCH))
        cuts = [length * i // parts for i in range(parts + 1)]
        return list(zip(cuts[:-1], cuts[1:]))

    def forward(self, device, data, cache=None, last_only: bool = False):
        stage = self.backbone
        if stage.is_last:
            logits = super().forward(device, data, cache=cache, last_only=last_only)
            x = logits.array.astype(stage.act_dtype)
        else:
            ids = self._token_batch(data)
            b, t = ids.shape
            self._check_positions(cache, t)
            h = self.compile_child(stage, device, Data(ids), cache=cache)
            x = mx.depends(mx.zeros((b, 1 if last_only else t, self.vocab_size), stage.act_dtype), h.array)
        x = mx.distributed.all_sum(x, group=stage.group)
        d = data.dims
        return Data(x, MTLSize(self.vocab_size, x.shape[1], d.H * d.D))

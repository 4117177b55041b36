"""Tensor parallelism: every rank of a group holds every block, each with a share of its attention
heads, its MLP's hidden columns and every expert's hidden columns, and a share of the vocabulary
(token table and head). The layers are `metalnn.layers.sharded`'s.

Per block (``N`` ranks, rank ``r``):

* attention: ``num_heads / N`` query heads and ``num_kv_heads / N`` key/value heads (rank ``r`` the
  ``r``-th run of each, so a query head keeps its key/value head); q/k/v rows split, ``o_proj``
  columns split and summed over the group (``num_key_value_heads`` must divide by ``N``);
  q/k norms whole; attention sinks split with their heads;
* a dense MLP: ``gate_proj`` / ``up_proj`` rows and ``down_proj`` columns split, summed over the group;
* a `SparseMoE`: every expert's columns split the same way on every rank (every rank holds a share
  of every expert, so memory and work stay balanced whatever the routing), the router whole; the
  block's output is summed once.

The runs of hidden columns are whole units of the ``down_proj`` weight's (group size, GGML block),
as even as those allow; the vocabulary splits into runs of rows as even as possible.
"""

from __future__ import annotations

import mlx.core as mx

from ...errors import UnsupportedConfigError
from ...layers.attention import SelfAttention
from ...layers.mlp import MLP, SwiGLU
from ...layers.moe import SparseMoE
from ...layers.sharded import (TABLES, ShardedSparseMoE, ShardedToAll, VocabShardedHead, VocabShardedLookup,
                               column_unit, make_sharded, shard_columns, shard_rows, shard_switch, split, take)


def _cut(axis, start, end):
    return lambda a: take(a, start, end, axis)


def _zeros(a):
    return mx.zeros(a.shape, a.dtype)


def shard_tensor(model, group) -> dict:
    """Split ``model``'s layers in place for rank ``group.rank()`` of ``group`` (see the module
    docstring). Returns ``{parameter name: function(whole checkpoint tensor) -> this rank's slice}``.

    Raises:
        UnsupportedConfigError: a block that is not attention + MLP / `SparseMoE`, recurrent caches,
            heads or widths that do not split over the group.
    """
    n, r = group.size(), group.rank()
    paths = {id(m): p for p, m in model.named_modules()}
    cuts = {}

    def record(layer, layer_cuts, bias_once=False):
        base = paths[id(layer)]
        for key, (axis, s, e) in layer_cuts.items():
            cuts[f"{base}.{key}"] = _cut(axis, s, e)
        if bias_once and "bias" in layer and r != 0:
            cuts[f"{base}.bias"] = _zeros

    for i, block in enumerate(model.decoder_layers):
        attn, mlp = block.get("self_attn"), block.get("mlp")
        if type(attn) is not SelfAttention or mlp is None:
            raise UnsupportedConfigError(f"{model.architecture}: tensor parallelism splits blocks of SelfAttention "
                                         f"and an MLP; layer {i} is a {type(block).__name__} with "
                                         f"{type(block.get('self_attn', block)).__name__}")
        _shard_attention(attn, n, r, record, group, cuts, paths, f"layer {i}")
        if type(mlp) in (MLP, SwiGLU):
            _shard_mlp(mlp, n, r, record, group, sum_here=True)
        elif type(mlp) is SparseMoE:
            _shard_moe(mlp, n, r, record, group, cuts, paths)
        else:
            raise UnsupportedConfigError(f"{model.architecture}: tensor parallelism splits MLP, SwiGLU and "
                                         f"SparseMoE feed-forward blocks; layer {i} has a {type(mlp).__name__}")
    table = model.input_embeddings
    if not isinstance(table, TABLES):
        raise UnsupportedConfigError(f"{model.architecture}: cannot split a {type(table).__name__} token table")
    vocab = table.num_embeddings
    s, e = split(vocab, n, what="vocab_size")[r]
    record(table, {k: (0, s, e) for k in ("weight", "scales", "biases") if k in table})
    for k in ("weight", "scales", "biases"):
        if k in table:
            table[k] = table[k][s:e]
    table.num_embeddings = e - s
    make_sharded(table, VocabShardedLookup, group, vocab_start=s, vocab_size=vocab)
    head = model.get("lm_head")
    if head is not None:
        record(head, shard_rows(head, s, e))
        make_sharded(head, VocabShardedHead, group, vocab_start=s, vocab_size=vocab)
    return cuts


def _shard_attention(attn, n, r, record, group, cuts, paths, where):
    if attn.num_kv_heads % n:
        raise UnsupportedConfigError(f"{where}: num_key_value_heads {attn.num_kv_heads} does not split over {n} ranks")
    hd = attn.head_dim
    q_per, kv_per = attn.num_heads // n, attn.num_kv_heads // n
    q_rows = q_per * hd * (2 if attn.output_gate else 1)
    record(attn.q_proj, shard_rows(attn.q_proj, r * q_rows, (r + 1) * q_rows))
    for proj in (attn.k_proj, attn.v_proj):
        record(proj, shard_rows(proj, r * kv_per * hd, (r + 1) * kv_per * hd))
    record(attn.o_proj, shard_columns(attn.o_proj, r * q_per * hd, (r + 1) * q_per * hd), bias_once=True)
    make_sharded(attn.o_proj, ShardedToAll, group)
    if attn.use_sinks:
        attn["sinks"] = attn["sinks"][r * q_per:(r + 1) * q_per]
        cuts[f"{paths[id(attn)]}.sinks"] = _cut(0, r * q_per, (r + 1) * q_per)
    attn.num_heads, attn.num_kv_heads = q_per, kv_per


def _shard_mlp(mlp, n, r, record, group, sum_here: bool):
    s, e = split(mlp.hidden_dims, n, column_unit(mlp.down_proj), what="the MLP's hidden width")[r]
    for proj in (mlp.get("gate_proj"), mlp.up_proj):
        if proj is not None:
            record(proj, shard_rows(proj, s, e))
    record(mlp.down_proj, shard_columns(mlp.down_proj, s, e), bias_once=sum_here)
    if sum_here:
        make_sharded(mlp.down_proj, ShardedToAll, group)
    mlp.hidden_dims = e - s


def _shard_moe(moe, n, r, record, group, cuts, paths):
    s, e = split(moe.experts.hidden_dims, n, what="the experts' hidden width")[r]
    base = paths[id(moe.experts)]
    for key, fn in shard_switch(moe.experts, s, e).items():
        cuts[f"{base}.{key}"] = fn
    if "shared_expert" in moe:
        _shard_mlp(moe.shared_expert, n, r, record, group, sum_here=False)
    moe.__class__ = ShardedSparseMoE
    object.__setattr__(moe, "group", group)

"""Llama-family decoder blocks for one new position, as native CPU primitives: one block
(`decoder_block_step`) or a run of blocks with their cache writes (`decoder_stack_step`).

``decoder_block_step`` runs, for ``x`` ``[B, 1, D]`` (one new token of each of B sequences)::

    n1 = rms_norm(x) * gain1;   q, k, v = q_proj(n1), k_proj(n1), v_proj(n1)   (+ biases, q/k norms, RoPE)
    h = x + o_proj(attention(q, [keys[..., :offset, :], k], [values[..., :offset, :], v]))
    out = h + down_proj(act(gate_proj(n2)) * up_proj(n2)),   n2 = rms_norm(h) * gain2

and returns ``(out, k, v)``: the new position's key and value ``[B, Hkv, 1, head_dim]``, for the
caller to write into the cache buffers ``[B, Hkv, capacity, head_dim]`` (which the step only
reads) at ``offset``. Built from separate MLX ops a block is ~40 graph nodes when decoding; here it is one,
and the products that read the same input run as one multi-threaded pass (built from
``metalnn/cpu/native/fastmath/decode_step.cpp``). Weights: GGML block types (the kernels of
`metalnn.cpu.ggml`) or float32 ``[N, K]``. Inference only (no gradient).

``decoder_stack_step`` runs consecutive blocks (prepared once as `StackBlocks`) the same way as one
node over one cache buffer for the whole stack (``[blocks, 2, B, Hkv, capacity, head_dim]``), and
writes every block's new key and value into it with one more node (in place when nothing else holds
the buffer): for a decoding model two nodes a token, instead of a node, two outputs and two slice
updates a block.

Use them through `metalnn.functional.decoder_block_step` and `decoder_stack_step`, which decide
when they apply.
"""

from __future__ import annotations

import mlx.core as mx

from . import native_ext as _native_ext

__all__ = ["available", "decoder_block_step", "StackBlocks", "decoder_stack_step", "ACTIVATIONS", "PROJECTIONS"]

#: the gate activations the steps run
ACTIVATIONS = ("silu", "gelu_tanh")

#: the projections, in the order ``weights`` / ``types`` / ``biases`` list them
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# The loaded extension or None; read at every call (tests swap in None).
_ext = _native_ext.extension()


def available() -> bool:
    """True when the native primitives are loaded."""
    return _ext is not None and hasattr(_ext, "decoder_stack_step")


def decoder_block_step(x, gains, weights, types, biases, keys, values, inv_freq, *, offset: int, heads: int,
                       kv_heads: int, head_dim: int, rope_dims: int, rope_traditional: bool, rope_scale: float,
                       attn_scale: float, eps: float, qk_gains=None, qk_eps: float = 1e-6, window: int | None = None,
                       activation: str = "silu", positions=None, stream=None):
    """The fused block step (see the module docstring); returns ``(out, k, v)``.

    Args:
        x: float32 ``[B, 1, D]``.
        gains: the two RMSNorm gains ``[D]`` (input, post-attention), float32.
        weights: the seven projection weights in `PROJECTIONS` order: packed ``uint8 [N, row_bytes]``
            (GGML block type) or float32 ``[N, K]``.
        types: each weight's GGUF type id, or -1 for a float32 weight.
        biases: each projection's float32 bias ``[N]`` or None.
        keys, values: float32 cache buffers ``[B, kv_heads, capacity, head_dim]`` (positions before
            ``offset`` are read), capacity > offset.
        inv_freq: float32 ``[rope_dims / 2]`` RoPE inverse frequencies.
        offset: the new token's position (cached positions before it).
        qk_gains: ``(q_norm, k_norm)`` gains ``[head_dim]`` for per-head RMSNorm of queries and keys.
        window: attend to the last ``window`` positions only (None: all).
        activation: the gate's activation, ``"silu"`` or ``"gelu_tanh"``.
        positions: int32 ``[B]``, each sequence's own position (a batch of sequences of different
            lengths, left-aligned in the cache: sequence ``b`` reads its columns before
            ``positions[b]``, and its new key and value belong at that column); None: ``offset``
            for every sequence.
    Raises:
        ValueError: an input of the wrong shape or dtype (the message names it).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"decoder_block_step: activation must be silu or gelu_tanh, got {activation!r}")
    inputs = [x, gains[0], gains[1], *weights, keys, values, inv_freq]
    inputs += [b for b in biases if b is not None]
    if qk_gains is not None:
        inputs += list(qk_gains)
    if positions is not None:
        inputs.append(positions)
    return tuple(_ext.decoder_block_step(
        inputs, heads=int(heads), kv_heads=int(kv_heads), head_dim=int(head_dim), rope_dims=int(rope_dims),
        rope_traditional=bool(rope_traditional), rope_scale=float(rope_scale), attn_scale=float(attn_scale),
        eps=float(eps), qk_eps=float(qk_eps), window=int(window or 0), qk_norm=qk_gains is not None,
        gelu=activation == "gelu_tanh", types=[int(t) for t in types], bias=[b is not None for b in biases],
        offset=int(offset), row_positions=positions is not None, stream=stream))


class StackBlocks:
    """Consecutive blocks prepared for `decoder_stack_step`: what stays the same from one step to the
    next (parameters, options), checked and held natively once (a step's node then reads only ``x``,
    the positions and the caches).

    Args:
        blocks: one dict a block with the arguments of `decoder_block_step` other than ``x``, the
            caches, ``offset`` and ``positions``: ``gains``, ``weights``, ``types``, ``biases``,
            ``inv_freq``, ``heads``, ``kv_heads``, ``head_dim``, ``rope_dims``, ``rope_traditional``,
            ``rope_scale``, ``attn_scale``, ``eps``, and optionally ``qk_gains``, ``qk_eps``,
            ``window``, ``activation``.
        head: the final RMSNorm and output head after the last block, or None (the step then
            outputs the last block's output): a dict of ``gain`` (float32 ``[D]``), ``eps``,
            ``weight`` (``[vocab, D]``: packed GGML rows, or float32) and ``type`` (its GGML type
            id, -1 for float32); the step then outputs logits ``[B, 1, vocab]``.
        embedding: the token table before the first block, or None (the step's input is then
            ``x`` ``[B, 1, D]``): a dict of ``weight`` (``[vocab, D]``, as the head's), ``type`` and
            optionally ``scale`` (multiplies the rows); the step's input is then the token ids
            int32 or uint32 ``[B, 1]`` (an id outside the table reads the nearest row).
    Raises:
        ValueError: a parameter of the wrong shape or dtype (the message names the block and the
            parameter, or the output head) or an unknown activation.
    """

    def __init__(self, blocks, head: dict | None = None, embedding: dict | None = None):
        ints, floats, params = [], [], []
        for b in blocks:
            activation = b.get("activation", "silu")
            if activation not in ACTIVATIONS:
                raise ValueError(f"decoder_stack_step: activation must be silu or gelu_tanh, got {activation!r}")
            biases, qk = b["biases"], b.get("qk_gains")
            ints += [int(b["heads"]), int(b["kv_heads"]), int(b["head_dim"]), int(b["rope_dims"]),
                     int(bool(b["rope_traditional"])), int(b.get("window") or 0), int(qk is not None),
                     int(activation == "gelu_tanh"), *[int(t) for t in b["types"]],
                     *[int(x is not None) for x in biases]]
            floats += [float(b["rope_scale"]), float(b["attn_scale"]), float(b["eps"]), float(b.get("qk_eps", 1e-6))]
            params += [b["gains"][0], b["gains"][1], *b["weights"], b["inv_freq"]]
            params += [x for x in biases if x is not None]
            if qk is not None:
                params += list(qk)
        options = {}
        if head is not None:
            options = dict(head_gain=head["gain"], head_weight=head["weight"], head_type=int(head["type"]),
                           head_eps=float(head["eps"]))
        if embedding is not None:
            scale = embedding.get("scale")
            options.update(embed_weight=embedding["weight"], embed_type=int(embedding["type"]),
                           embed_scale=None if scale is None else float(scale))
        self.params = _ext.StackParams(params, ints, floats, **options)

    def __len__(self):
        return len(self.params)


def decoder_stack_step(x, blocks: StackBlocks, cache, *, offset: int, positions=None, last_only: bool = False,
                       stream=None):
    """The blocks of ``blocks`` one after the other, each as `decoder_block_step`, for ``x``
    ``[B, T, D]`` (T new positions a sequence), as one native node, and every block's new keys and
    values written into the stack's cache at the new positions by one more node (in place when
    nothing else holds the buffer, else into a copy). Position t of a sequence attends to the cache
    and to the new positions up to its own.

    Args:
        x: float32 ``[B, T, D]``, or the token ids ``[B, T]`` when ``blocks`` has a token table.
        cache: every block's keys and values in one float32 buffer
            ``[blocks, 2, B, kv_heads, capacity, head_dim]`` (``cache[b, 0]``: block b's keys; the
            blocks must share ``kv_heads`` and ``head_dim``).
        offset, positions: the first new position, as `decoder_block_step` (the same for every
            block); ``offset + T`` must fit the capacity.
        last_only: with a head, only each sequence's last position's logits.
    Returns:
        ``(out, new_cache)``: the last block's output ``[B, T, D]`` (the logits ``[B, T, vocab]``,
        or ``[B, 1, vocab]`` with ``last_only``, when ``blocks`` has a head) and the cache buffer with
        the new positions written.
    Raises:
        ValueError: an input of the wrong shape or dtype (the message names the block or input).
    """
    out, written = _ext.decoder_stack_step(x, cache, blocks.params, offset=int(offset), positions=positions,
                                           last_only=bool(last_only), stream=stream)
    return out, written


def stack_columns_write(cache, keys, values, *, slot: int, start: int, stream=None):
    """The stack's cache ``[blocks, 2, B, kv_heads, capacity, head_dim]`` with block ``slot``'s
    ``keys`` / ``values`` ``[B, kv_heads, T, head_dim]`` (float32) written at columns ``start ..
    start + T``, always in place in a buffer MLX allocated whole (a `StackCache`'s): MLX's own slice
    update writes in place only when its donation test passes, which depends on how far the stream
    thread has got with the earlier blocks' reads, and otherwise copies the whole stack's cache.
    Readers of the buffer queued before the write read it first; a lazy array made from the buffer
    and evaluated after the write sees the new columns.

    Raises:
        ValueError: a cache, keys or values of the wrong shape or dtype, a slot or columns outside it.
    """
    return _ext.stack_columns_write(cache, keys, values, slot=int(slot), start=int(start), stream=stream)


"""`decoder_block_step`: a whole pre-norm decoder block (RMSNorm, RoPE attention over a KV cache,
RMSNorm, gated MLP) for one new position of each sequence, fused on the CPU.

Decoding a small model on the CPU is bound by the work around its products: as separate MLX ops a
block is ~40 graph nodes, each built in Python and dispatched on its own. On the CPU backend
(``device.kernels == "auto"``, the native extension loaded, float32) `metalnn.cpu.decode_step`
runs the block as one native node; elsewhere (Metal, the reference and kernel devices, other
dtypes, weight formats without a native product) this returns None and the block runs op by op
(its reference: the same formulas, which the tests compare with transformers).

`decoder_stack_step` runs a model's whole stack of such blocks as one native node (the
`metalnn.llm` decoder stacks take it when every block qualifies): building a 30-block step in
Python then costs ~1 ms instead of ~3. Every block's keys and values then live in one buffer
(`StackCache`, which the layers' caches are bound to) that one more node writes a token, and the
node can begin with the token lookup (`StackEmbedding`) and end with the final norm and output head
(`StackHead`): a Llama-family decoding step is then two graph nodes, token ids in, logits out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx

from ..cpu import decode_step as native
from ..cpu import ggml as cpu_ggml
from ..cpu.device import on_cpu
from ..device import resolve
from ..kernels.op_math import rope_frequencies

__all__ = ["BlockStep", "StackCache", "StackEmbedding", "StackHead", "decoder_block_step", "decoder_stack_step"]

_ACTIVATIONS = native.ACTIVATIONS


@dataclass
class BlockStep:
    """What the fused step needs to know of a block.

    Attributes:
        gains: the input and post-attention RMSNorm gains ``[D]`` (weight + offset).
        eps: both RMSNorms' epsilon.
        projections: seven ``(weight, gguf_type_id or -1 for float32, bias or None)``, in the order
            q, k, v, o, gate, up, down.
        heads, kv_heads, head_dim: attention shape.
        rope_dims: rotated features per head (0: no RoPE); rope_traditional, rope_base,
            rope_scale, rope_freqs: as `metalnn.functional.rope`.
        attn_scale: score scale.
        window: sliding attention window (None: all positions).
        qk_gains, qk_eps: per-head q/k RMSNorm gains and epsilon (None: no q/k norms).
        activation: the MLP gate's activation.
    """

    gains: tuple
    eps: float
    projections: tuple
    heads: int
    kv_heads: int
    head_dim: int
    rope_dims: int
    rope_traditional: bool
    rope_base: float
    rope_scale: float
    rope_freqs: object
    attn_scale: float | None
    window: int | None
    qk_gains: tuple | None
    qk_eps: float
    activation: str
    #: what depends on the plan only, worked out at its first step (see `_prepared`)
    prepared: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass(eq=False)
class StackHead:
    """The final RMSNorm and output head a decoding stack's fused step can end with (its output is
    then the logits).

    Attributes:
        gain: the final RMSNorm's gain ``[D]`` (weight + offset); eps: its epsilon.
        weight: the head ``[vocab, D]`` (packed GGML rows, or float32); type_id: its GGML type id
            (-1: float32).
    """

    gain: mx.array
    eps: float
    weight: mx.array
    type_id: int

    def runs_natively(self) -> bool:
        """Whether the native step takes it: a float32 gain and a float32 or natively supported
        GGML weight."""
        return self.gain.dtype == mx.float32 and _matrix_runs_natively(self.weight, self.type_id)


@dataclass(eq=False)
class StackEmbedding:
    """The token table a decoding stack's fused step can begin with (its input is then the token
    ids).

    Attributes:
        weight: the table ``[vocab, D]`` (packed GGML rows, or float32); type_id: its GGML type id
            (-1: float32).
        scale: multiplies the rows (Gemma's ``sqrt(hidden_size)``, as a float32), or None.
    """

    weight: mx.array
    type_id: int
    scale: float | None = None

    def runs_natively(self) -> bool:
        """Whether the native step takes it: a float32 or natively supported GGML table."""
        return _matrix_runs_natively(self.weight, self.type_id)


def _matrix_runs_natively(weight, type_id: int) -> bool:
    if type_id == -1:
        return weight.dtype == mx.float32
    return weight.dtype == mx.uint8 and type_id in cpu_ggml.native_type_ids()


_INV_FREQ = {}


def _inv_freq(dims: int, base: float, freqs):
    """RoPE inverse frequencies float32 ``[dims / 2]`` (those of a geometric series cached: they are
    the same for every block and step)."""
    if not dims:
        return mx.zeros((0,), mx.float32)
    if freqs is not None:
        return rope_frequencies(dims, base, freqs).astype(mx.float32)
    key = (dims, float(base))
    if key not in _INV_FREQ:
        inv = rope_frequencies(dims, base).astype(mx.float32)
        mx.eval(inv)
        _INV_FREQ[key] = inv
    return _INV_FREQ[key]


def _weights_run_natively(step: BlockStep) -> bool:
    """Whether the native step takes the plan's parameters: float32 gains and biases, float32 or
    natively supported GGML weights, a supported activation."""
    if step.activation not in _ACTIVATIONS:
        return False
    arrays = [*step.gains, *(step.qk_gains or ())] + [b for _, _, b in step.projections if b is not None]
    if any(a.dtype != mx.float32 for a in arrays):
        return False
    native_types = cpu_ggml.native_type_ids()
    for w, type_id, _ in step.projections:
        if type_id == -1 and w.dtype != mx.float32:
            return False
        if type_id != -1 and (type_id not in native_types or w.dtype != mx.uint8):
            return False
    return True


def _prepared(step: BlockStep) -> dict:
    """The plan's native arguments, worked out once per plan (a plan lives until the block's
    parameters change): ``ok`` (`_weights_run_natively`), the weight / type / bias lists, the
    RoPE inverse frequencies and the score scale."""
    p = step.prepared
    if not p:
        p["ok"] = _weights_run_natively(step)
        p["weights"] = [w for w, _, _ in step.projections]
        p["types"] = [t for _, t, _ in step.projections]
        p["biases"] = [b for _, _, b in step.projections]
        p["inv_freq"] = _inv_freq(step.rope_dims, step.rope_base, step.rope_freqs)
        p["scale"] = step.attn_scale if step.attn_scale is not None else 1.0 / math.sqrt(step.head_dim)
    return p


def _runs_natively(x, step: BlockStep, keys, device, ids: bool = False, positions: int = 1) -> bool:
    """Whether the native step runs ``x`` (float32 ``[B, T, D]``; with ``ids``, integer ``[B, T]``;
    T from 1 to ``positions``) with ``keys`` (a cache buffer or None) for the plan ``step`` on
    ``device``."""
    if device.kernels != "auto" or not on_cpu() or not native.available():
        return False
    if ids:
        if x.ndim != 2 or not 1 <= x.shape[1] <= positions or not mx.issubdtype(x.dtype, mx.integer):
            return False
    elif x.dtype != mx.float32 or x.ndim != 3 or not 1 <= x.shape[1] <= positions:
        return False
    if keys is not None and keys.dtype != mx.float32:
        return False
    return _prepared(step)["ok"]


def decoder_block_step(x, step: BlockStep, cache, device=None):
    """The block for ``x`` ``[B, 1, D]`` (one new position per sequence) with ``cache`` (a `KVCache`,
    or a `BatchKVCache` of sequences of different lengths; appended to), as one fused native step; returns ``[B, 1, D]``, or None (nothing done, the cache
    untouched) when the fused step does not apply (see the module docstring)."""
    device = resolve(device)
    if not _runs_natively(x, step, cache.keys, device):
        return None
    p = _prepared(step)
    keys, values = cache.buffers_for(x.shape[0], step.kv_heads, step.head_dim, 1, mx.float32)
    # a `BatchKVCache` of sequences of different lengths: each row at its own position
    positions = cache.positions if getattr(cache, "ragged", False) else None
    out, k_new, v_new = native.decoder_block_step(
        x, step.gains, p["weights"], p["types"], p["biases"], keys, values, p["inv_freq"], offset=cache.offset,
        heads=step.heads, kv_heads=step.kv_heads, head_dim=step.head_dim, rope_dims=step.rope_dims,
        rope_traditional=step.rope_traditional, rope_scale=step.rope_scale, attn_scale=p["scale"], eps=step.eps,
        qk_gains=step.qk_gains, qk_eps=step.qk_eps, window=step.window, activation=step.activation, positions=positions)
    # MLX writes into the buffers themselves once the step has read them (nothing else holds them
    # then), as the op-by-op path's cache update does
    cache.write_rows(k_new, v_new)
    return out


def _stack_blocks(steps, head: StackHead | None, embedding: StackEmbedding | None) -> native.StackBlocks | None:
    """The plans' native stack arguments (and the head's and token table's), worked out once per
    list of plans, head and table (kept with the first plan); None when a plan's parameters, the
    head or the table do not run natively, or the blocks' caches differ in layout (one stack buffer
    holds them all)."""
    p = steps[0].prepared
    cached = p.get("stack")
    if (cached is not None and cached[2] is head and cached[3] is embedding and len(cached[0]) == len(steps)
            and all(a is b for a, b in zip(cached[0], steps))):
        return cached[1]
    prepared = [_prepared(s) for s in steps]
    blocks = None
    uniform = all(s.kv_heads == steps[0].kv_heads and s.head_dim == steps[0].head_dim for s in steps)
    if (uniform and all(q["ok"] for q in prepared) and (head is None or head.runs_natively())
            and (embedding is None or embedding.runs_natively())):
        blocks = native.StackBlocks([
            dict(gains=s.gains, weights=q["weights"], types=q["types"], biases=q["biases"], inv_freq=q["inv_freq"],
                 heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim, rope_dims=s.rope_dims,
                 rope_traditional=s.rope_traditional, rope_scale=s.rope_scale, attn_scale=q["scale"], eps=s.eps,
                 qk_gains=s.qk_gains, qk_eps=s.qk_eps, window=s.window, activation=s.activation)
            for s, q in zip(steps, prepared)],
            head=None if head is None else dict(gain=head.gain, eps=head.eps, weight=head.weight, type=head.type_id),
            embedding=None if embedding is None else dict(weight=embedding.weight, type=embedding.type_id,
                                                          scale=embedding.scale))
    p["stack"] = (tuple(steps), blocks, head, embedding)
    return blocks


class StackCache:
    """Every block's keys and values of a decoding stack in one buffer ``buffer``
    ``[blocks, 2, B, kv_heads, capacity, head_dim]`` (float32), to which the blocks' caches are
    bound (`metalnn.layers.KVCache.bind`; ``keys(i)`` / ``values(i)``: block i's). One buffer lets one
    graph node a token write every block's new key and value (`decoder_stack_step`)."""

    def __init__(self, caches, buffer):
        self.caches = tuple(caches)
        self.buffer = buffer
        for i, c in enumerate(self.caches):
            c.bind(self, i)

    def keys(self, slot: int):
        return self.buffer[slot, 0]

    def values(self, slot: int):
        return self.buffer[slot, 1]

    def write(self, slot: int, start: int, keys, values) -> bool:
        """Write ``keys`` / ``values`` ``[B, kv_heads, T, head_dim]`` at columns ``start ..
        start + T`` of block ``slot`` (in place, `metalnn.cpu.decode_step.stack_columns_write`: a bound
        cache's multi-position update, e.g. verifying draft tokens, then costs only its columns); False
        (nothing written) where they do not fit: another shape or dtype, or past the capacity."""
        shape = self.buffer.shape
        t = keys.shape[2]
        want = (shape[2], shape[3], t, shape[5])
        if (keys.shape != want or values.shape != want or keys.dtype != mx.float32 or values.dtype != mx.float32
                or start + t > shape[4]):
            return False
        self.buffer = native.stack_columns_write(self.buffer, keys, values, slot=slot, start=start,
                                                 stream=mx.cpu)
        return True

    def holds(self, caches, batch: int, positions: int) -> bool:
        """Whether ``caches`` are this store's (in its order, all still bound), for ``batch`` rows and
        with room for ``positions`` positions."""
        shape = self.buffer.shape
        return (shape[2] == batch and shape[4] >= positions and len(caches) == len(self.caches)
                and all(c is d and c.store is self for c, d in zip(caches, self.caches)))

    @classmethod
    def gather(cls, caches, batch: int, kv_heads: int, head_dim: int, capacity: int) -> "StackCache":
        """A store of ``capacity`` positions holding what ``caches`` hold (their columns before the
        first cache's ``offset``, the longest row's length), the caches bound to it.

        Raises:
            ValueError: a cache holding keys or values of another batch size, head count or width.
        """
        n = caches[0].offset
        shape = (len(caches), 2, batch, kv_heads, capacity, head_dim)
        if n == 0:
            return cls(caches, mx.zeros(shape, mx.float32))
        slabs = []
        for i, c in enumerate(caches):
            for name, a in (("keys", c.keys), ("values", c.values)):
                if a is None:
                    slabs.append(mx.zeros((batch, kv_heads, n, head_dim), mx.float32))
                    continue
                if a.ndim != 4 or a.shape[:2] != (batch, kv_heads) or a.shape[3] != head_dim or a.shape[2] < n:
                    raise ValueError(f"decoder_stack_step: block {i}'s cache holds {name} of shape {tuple(a.shape)}, "
                                     f"expected [{batch}, {kv_heads}, at least {n}, {head_dim}]")
                slabs.append(a[..., :n, :].astype(mx.float32))
        # (the held positions stacked, then padded to the capacity once: not every block padded to the
        # capacity and all of them copied again by the stack)
        buffer = mx.pad(mx.stack(slabs), [(0, 0)] * 3 + [(0, capacity - n), (0, 0)])
        return cls(caches, buffer.reshape(shape))


# New positions a sequence up to which one call runs as one fused node: a short prompt, a prompt's
# rest after a cached prefix, draft tokens to verify. The node's products are those `metalnn.cpu.ggml`
# runs natively up to MATMUL_MAX_ROWS rows (beyond, dequantising into a float product wins), and
# with the rest of the block in the same node it was faster at every length measured, 2 to 128
# (`scripts/bench_prompt_rest.py`, figures in the README). Longer runs go block by block.
STACK_POSITIONS = 128


def decoder_stack_step(x, steps, caches, device=None, head: StackHead | None = None,
                       embedding: StackEmbedding | None = None, last_only: bool = False):
    """Consecutive blocks (``steps``, one `BlockStep` each) for ``x`` ``[B, T, D]`` (with
    ``embedding``: the token ids ``[B, T]``, looked up in its table first; T new positions a
    sequence, one when decoding, at most `STACK_POSITIONS`), each with its cache (``caches``: one
    `metalnn.layers.KVCache` or `metalnn.layers.BatchKVCache` a block, all of one class and at the
    same positions; each is appended to), as one fused native node; returns the last block's output
    ``[B, T, D]`` (with ``head``: the logits ``[B, T, vocab]`` of the final norm and head after it,
    ``[B, 1, vocab]`` of each sequence's last position with ``last_only``), or None (nothing done,
    the caches untouched) when the fused step does not apply to all of them, the head or the table
    (see the module docstring; the caller then runs the blocks one by one). T > 1 runs on caches
    whose rows are all at one position (one sequence, or a batch of equal lengths).

    The same as `decoder_block_step` block after block, with one graph node for the whole stack and
    one more that writes the new keys and values into the caches, kept together in one buffer
    (`StackCache`, in place: a decoding step of a small model is otherwise bound by the graph's
    size, its building in Python and its dispatch)."""
    device = resolve(device)
    ids = embedding is not None
    if (not steps or len(steps) != len(caches)
            or not _runs_natively(x, steps[0], None, device, ids=ids, positions=STACK_POSITIONS)):
        return None
    first, b, t = caches[0], x.shape[0], x.shape[1]
    kind, offset, lengths = type(first), first.offset, getattr(first, "lengths", None)
    if lengths is not None:  # (a `BatchKVCache`: the same row lengths, hence the same offset)
        same = all(type(c) is kind and c.lengths == lengths for c in caches)
    else:
        same = all(type(c) is kind and c.offset == offset for c in caches)
    if not same:
        return None
    blocks = _stack_blocks(steps, head, embedding)
    if blocks is None:
        return None
    if ids and x.dtype not in (mx.int32, mx.uint32):
        x = x.astype(mx.int32)
    ragged = lengths is not None and first.ragged
    if ragged and t > 1:
        return None
    store = first.store
    if not (isinstance(store, StackCache) and store.holds(caches, b, offset + t)):
        if any(c.keys is not None and c.keys.dtype != mx.float32 for c in caches):
            return None
        store = StackCache.gather(caches, b, steps[0].kv_heads, steps[0].head_dim, first.capacity(offset + t))
    out, store.buffer = native.decoder_stack_step(x, blocks, store.buffer, offset=offset,
                                                  positions=first.positions if ragged else None,
                                                  last_only=last_only)
    for c in caches:
        c.count_written(t)
    return out

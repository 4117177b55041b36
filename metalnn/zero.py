"""ZeRO stages 1 and 2: the optimizer's state (and, at stage 2, the gradients) sharded across the
processes of a data-parallel ``mx.distributed`` group, so that AdamW's moments cost 1/N per process.

`metalnn.Trainer` uses it when given ``zero=1`` or ``zero=2``; `ZeroSharding` is the whole mechanism.

Layout. The trainable parameters (``tree_flatten(model.trainable_parameters())`` order: the same on
every process, which builds the same model) are grouped by dtype; each group is raveled and
concatenated into one flat vector of ``P`` elements, padded with zeros to ``L = ceil(P / N) * N`` and
cut into N equal shards of ``S = L / N`` elements: rank ``r`` owns ``[r * S, (r + 1) * S)``, so the
padding (fewer than N elements) sits at the end of the last shard. The optimizer sees one "parameter"
per dtype group, that rank's shard (``optimizer.state[f"shard_{dtype}"]`` holds e.g. AdamW's ``m``
and ``v`` of S elements each). Only element-wise optimizers can run on shards (SGD, RMSprop,
Adagrad, AdaDelta, Adam, AdamW, Adamax, Lion): their update of an element depends on that element
alone, so the sharded update equals the whole one; Adafactor and Muon (which factor or
orthogonalise whole matrices) are refused.

One step, after every process computed the gradients of its part of the batch:

- stage 1: the flat gradient is summed over processes (``all_sum``) and divided by N, as data
  parallel does; each process keeps its shard of it;
- stage 2: the flat gradient is reduce-scattered (``mx.distributed.sum_scatter``) so each process
  receives only its shard of the sum. Backends without a reduce-scatter (MLX's ring backend, this
  MLX: "[ring] sum_scatter not supported") sum the whole vector and keep the shard: the same
  numbers and the same kept gradient, with the all-reduce's transient buffer;
- clipping (``clip_grad_norm``) scales by the global norm: the squared norms of the shards are
  summed over processes, and the scale is ``mlx.optimizers.clip_grad_norm``'s,
  ``min(max_norm / (norm + 1e-6), 1)``; the squares are summed in float32 whatever the gradients'
  dtype (``clip_grad_norm`` sums bfloat16 squares in bfloat16, per tensor; a shard cuts across
  tensors, so that rounding could not be reproduced anyway);
- the optimizer updates this process's shard of the parameters with its shard of the gradient, and
  the updated shards are all-gathered (``all_gather``) into every process's whole model.

MLX differentiates the whole loss at once, so each process holds its whole local gradient while the
backward pass runs (as in one process); what stage 2 saves is the reduced gradient kept for the update.

Checkpoints hold the optimizer state in the unsharded layout (``"<parameter>.<state key>"``, as
``tree_flatten(optimizer.state)`` of one process), gathered by `full_state` (a collective: every
process calls it) and written by rank 0; `load_state` cuts each process's shard back out of it. A
checkpoint is thus the same file whether it was written with or without sharding, and can be resumed
by any number of processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

ELEMENTWISE = (optim.SGD, optim.RMSprop, optim.Adagrad, optim.AdaDelta, optim.Adam, optim.Lion)  # Adam: AdamW, Adamax
STAGES = (1, 2)


@dataclass
class Bucket:
    """The trainable parameters of one dtype laid end to end, padded to ``world * shard`` elements."""

    dtype: mx.Dtype
    names: list = field(default_factory=list)
    shapes: list = field(default_factory=list)
    sizes: list = field(default_factory=list)
    shard: int = 0  # S: elements per process

    @property
    def key(self) -> str:
        """The bucket's name in the optimizer's state: ``shard_float32``, ..."""
        return "shard_" + str(self.dtype).split(".")[-1]

    @property
    def total(self) -> int:
        """P: elements of the parameters (without padding)."""
        return sum(self.sizes)

    def flatten(self, named: dict, world: int) -> mx.array:
        """The named arrays (``named[name]`` of each parameter's shape) as one padded flat vector (L,)."""
        parts = [named[n].reshape(-1) for n in self.names]
        pad = self.shard * world - self.total
        if pad:
            parts.append(mx.zeros((pad,), dtype=parts[0].dtype))
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]

    def unflatten(self, flat: mx.array) -> list:
        """``[(name, array of the parameter's shape)]`` from a flat vector of at least P elements."""
        out, offset = [], 0
        for name, shape, size in zip(self.names, self.shapes, self.sizes):
            out.append((name, flat[offset:offset + size].reshape(shape)))
            offset += size
        return out


class ZeroSharding:
    """Shard an ``mlx.optimizers`` optimizer's state (stage 1) and the gradients (stage 2) over ``group``.

    Args:
        stage: 1 or 2 (see the module docstring).
        optimizer: an element-wise ``mlx.optimizers`` optimizer; its ``state`` becomes this process's
            shard of the state.
        group: the ``mx.distributed`` group (None: a group of one, where the shard is everything).
    """

    def __init__(self, stage: int, optimizer, group=None):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
        if not isinstance(optimizer, ELEMENTWISE):
            raise ValueError(
                f"ZeRO sharding needs an element-wise optimizer ({', '.join(c.__name__ for c in ELEMENTWISE)}, "
                f"AdamW, Adamax); {type(optimizer).__name__} updates whole tensors and cannot run on shards")
        self.stage = stage
        self.optimizer = optimizer
        self.group = group
        self.world = group.size() if group is not None else 1
        self.rank = group.rank() if group is not None else 0
        self.buckets: list[Bucket] | None = None
        self._scatter = None  # does the backend reduce-scatter? (probed once, at stage 2)

    # -- layout --------------------------------------------------------------------------------
    def build(self, model):
        """Lay out ``model``'s trainable parameters (once) and create this process's optimizer state."""
        if self.buckets is None:
            buckets: dict = {}
            for name, p in tree_flatten(model.trainable_parameters()):
                b = buckets.setdefault(p.dtype, Bucket(p.dtype))
                b.names.append(name)
                b.shapes.append(tuple(p.shape))
                b.sizes.append(int(p.size))
            if not buckets:
                raise ValueError(f"ZeRO sharding: {type(model).__name__} has no trainable parameters")
            for b in buckets.values():
                b.shard = math.ceil(b.total / self.world)
            self.buckets = list(buckets.values())
            self._check_same_layout()
            if self.stage == 2 and self.world > 1:
                self._scatter = _reduce_scatter_works(self.group)
        missing = [b.key for b in self.buckets if b.key not in self.optimizer.state]
        if missing:
            self.optimizer.init(self.param_shards(model))
        return self

    def _check_same_layout(self):
        if self.world == 1:
            return
        mine = mx.array([b.total for b in self.buckets], dtype=mx.int64)
        every = mx.distributed.all_gather(mine[None], group=self.group)
        if not mx.array_equal(every, mx.broadcast_to(mine, every.shape)).item():
            raise ValueError(f"ZeRO sharding: the processes hold different trainable parameters (elements per "
                             f"dtype group on each rank: {every.tolist()}); every rank must build the same model")

    def span(self, bucket: Bucket) -> tuple:
        """This process's ``[start, stop)`` in the bucket's padded flat vector."""
        return self.rank * bucket.shard, (self.rank + 1) * bucket.shard

    def param_shards(self, model) -> dict:
        """``{bucket key: this process's shard of the flat parameters}``."""
        named = dict(tree_flatten(model.trainable_parameters()))
        out = {}
        for b in self.buckets:
            lo, hi = self.span(b)
            out[b.key] = b.flatten(named, self.world)[lo:hi]
        return out

    # -- one step ------------------------------------------------------------------------------
    def grad_shards(self, grads) -> dict:
        """Average ``grads`` (this process's gradient tree) over the group; ``{bucket key: this
        process's shard of the average}``."""
        named = dict(tree_flatten(grads))
        out = {}
        for b in self.buckets:
            flat = b.flatten(named, self.world)
            lo, hi = self.span(b)
            if self.world == 1:
                out[b.key] = flat
            elif self.stage == 2 and self._scatter:
                out[b.key] = mx.distributed.sum_scatter(flat, group=self.group) / self.world
            else:
                out[b.key] = (mx.distributed.all_sum(flat, group=self.group) / self.world)[lo:hi]
        return out

    def clip(self, shards: dict, max_norm: float) -> tuple:
        """Scale the gradient shards to a global norm of at most ``max_norm``; returns (shards, norm)."""
        if max_norm < 0:
            raise ValueError(f"clip_grad_norm should be >= 0, got {max_norm}")
        squares = sum(g.astype(mx.float32).square().sum() for g in shards.values())
        if self.world > 1:
            squares = mx.distributed.all_sum(squares, group=self.group)
        norm = mx.sqrt(squares)
        scale = mx.minimum(max_norm / (norm + 1e-6), 1.0)
        return {k: (g * scale).astype(g.dtype) for k, g in shards.items()}, norm

    def update(self, model, grads, clip_grad_norm: float | None = None):
        """The sharded optimizer step: reduce, clip, update this process's shard, all-gather the model."""
        shards = self.grad_shards(grads)
        if clip_grad_norm is not None:
            shards, _ = self.clip(shards, clip_grad_norm)
        new = self.optimizer.apply_gradients(shards, self.param_shards(model))
        params = []
        for b in self.buckets:
            flat = new[b.key] if self.world == 1 else mx.distributed.all_gather(new[b.key], group=self.group)
            params.extend(b.unflatten(flat))
        model.update(tree_unflatten(params))

    # -- what it costs -------------------------------------------------------------------------
    def state_nbytes(self) -> int:
        """Bytes of this process's sharded optimizer state (the per-element arrays; the scalars such as
        ``step`` and ``learning_rate`` left out)."""
        return sum(a.nbytes for b in self.buckets for _, a in tree_flatten(self.optimizer.state.get(b.key, {})))

    # -- checkpoints ---------------------------------------------------------------------------
    def barrier(self):
        """Return once every process of the group got here."""
        if self.world > 1:
            mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=self.group))

    def full_state(self) -> dict:
        """The optimizer state in the unsharded layout, ``{"<parameter>.<key>": array, "step": ...}``,
        gathered from every process (a collective: every process must call it)."""
        state = self.optimizer.state
        out = {k: v for k, v in tree_flatten({k: v for k, v in state.items() if not k.startswith("shard_")})}
        for b in self.buckets:
            for key, shard in tree_flatten(state[b.key]):
                flat = shard if self.world == 1 else mx.distributed.all_gather(shard, group=self.group)
                for name, value in b.unflatten(flat):
                    out[f"{name}.{key}"] = value
        mx.eval(out)
        return out

    def load_state(self, flat: dict, where: str = "checkpoint"):
        """Set this process's shard of the state from the unsharded layout (`full_state`'s)."""
        state = self.optimizer.state
        new = {k: v for k, v in flat.items() if "." not in k}
        for b in self.buckets:
            keys = [k for k, _ in tree_flatten(state[b.key])]
            shard = {}
            for key in keys:
                named = {}
                for name, shape in zip(b.names, b.shapes):
                    value = flat.get(f"{name}.{key}")
                    if value is None:
                        raise KeyError(f"{where}: no optimizer state {name}.{key} (the checkpoint was written "
                                       "for other trainable parameters or another optimizer)")
                    if tuple(value.shape) != shape:
                        raise ValueError(f"{where}: optimizer state {name}.{key} has shape {tuple(value.shape)}, "
                                         f"expected {shape}")
                    named[name] = value
                lo, hi = self.span(b)
                shard[key] = b.flatten(named, self.world)[lo:hi]
            new[b.key] = tree_unflatten(list(shard.items()))
        self.optimizer.state = new
        mx.eval(new)


def _reduce_scatter_works(group) -> bool:
    """Whether ``group``'s backend implements ``sum_scatter`` (NCCL does; ring, in this MLX, does not)."""
    try:
        mx.eval(mx.distributed.sum_scatter(mx.zeros((group.size(),)), group=group))
        return True
    except RuntimeError:
        return False

"""`Trainer`: a compiled training loop on mlx.optimizers with exact, resumable checkpoints."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from .device import Device, resolve
from .errors import TrainingDivergedError
from .layers.base import checkpoint_blocks
from .zero import ZeroSharding
from .weights import load_into, load_safetensors, save_safetensors


class Trainer:
    """Train a metalnn model (any ``mlx.nn.Module``) with an ``mlx.optimizers`` optimizer.

    Steps run in training mode (``model.train()``: dropout active), evaluations in evaluation mode;
    `fit` and `step` give the model back in the mode it had.

    Args:
        model: the model.
        optimizer: e.g. ``mlx.optimizers.AdamW(1e-3)``.
        loss_fn: ``loss_fn(model, batch, device) -> scalar mx.array``; ``batch`` is whatever the
            data source yields (typically a tuple of arrays). Draw any randomness from
            ``device.next_key()`` (as `Dropout` does): the device key is checkpointed, MLX's global
            random state is not. A loss_fn with a ``state`` attribute (a dict tree of arrays whose
            structure stays the same) has it taken in and given back by the compiled step, and
            evaluated with the loss: arrays the loss reads besides the model's (a frozen reference
            model) and arrays it stores while it runs (metrics: after `step`, ``loss_fn.state``
            holds that step's values).
        device: the `Device` (its key drives dropout and is checkpointed).
        compile: run the step through ``mx.compile`` (default True; always off on the ``emulate``
            kernel path, whose emulated kernels run eagerly).
        clip_grad_norm: clip the global gradient norm to this value.
        checkpoint_dir: where `fit` writes checkpoints (``step_0000100/``) every ``checkpoint_every``
            steps and at the end.
        eval_fn: ``eval_fn(trainer) -> dict`` of metrics, called every ``eval_every`` steps and at the
            end (with the model in evaluation mode); results are kept in ``history``.
        progress: show a tqdm progress bar with loss and throughput.
        grad_checkpoint: recompute each block of the model (`metalnn.layers.base.checkpoint_blocks`) in the
            backward pass instead of keeping its activations: the same gradients for less memory.
        group: the ``mx.distributed`` group to train data-parallel on (default: the process's
            group, ``mx.distributed.init()``; a single process is a group of one). See below.
        zero: shard the optimizer's state across the group's processes (ZeRO stage 1: each keeps the
            state of 1/N of the trainable parameters, updates that part and the updated parameters are
            all-gathered) or the state and the reduced gradients (stage 2); 0 (default): every process
            holds the whole state. Needs an element-wise optimizer (SGD, Adam, AdamW, Lion, ...). See
            `metalnn.zero` for the layout and what each stage keeps.

    Data parallel: in a group of N > 1 processes (started with ``mlx.launch -n N --backend ring --
    python train.py``), every batch the data source returns is split along axis 0 into N equal
    parts; each process computes the loss and gradients of its own part, the gradients are
    averaged across processes (``mlx.nn.average_gradients``: few large messages) before the
    optimizer step, and the reported loss is the mean over processes. With a mean-reduced loss the
    result equals one process training on the whole batches (dropout aside: each process draws its
    masks from the same device key). Only rank 0 writes checkpoints and shows progress; every
    process can resume from them. With ``zero`` the updates are the same (up to the order of float32
    additions); the checkpoints hold the whole optimizer state, gathered from every process (so
    `save_checkpoint` is then a collective: every process calls it, rank 0 writes).
    """

    def __init__(self, model, optimizer, loss_fn, device: Device | None = None, compile: bool = True,
                 clip_grad_norm: float | None = None, checkpoint_dir=None, checkpoint_every: int | None = None,
                 eval_fn=None, eval_every: int | None = None, progress: bool = True, keep_checkpoints: int = 3,
                 grad_checkpoint: bool = False, group=None, zero: int = 0):
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.device = resolve(device)
        self.use_compile = compile and self.device.kernels != "emulate"
        if group is None and mx.distributed.is_available():
            group = mx.distributed.init()
        self.group = group
        self.world_size = group.size() if group is not None else 1
        self.rank = group.rank() if group is not None else 0
        if grad_checkpoint and checkpoint_blocks(model) == 0:
            raise ValueError(f"Trainer: grad_checkpoint=True but {type(model).__name__} has no blocks "
                             "(layers with is_block = True) to checkpoint; set layer.grad_checkpoint = True "
                             "on the layers to recompute instead")
        self.clip_grad_norm = clip_grad_norm
        self.zero = ZeroSharding(zero, optimizer, group) if zero else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        self.eval_fn = eval_fn
        self.eval_every = eval_every
        self.progress = progress
        self.keep_checkpoints = keep_checkpoints
        self.step_count = 0
        self.history = {"loss": [], "eval": []}
        self._step_fn = None
        self._pending_resume = None

    # -- one step ----------------------------------------------------------------------------
    def _ensure_built(self, batch):
        """Create parameters (first compile) and optimizer state before tracing the step."""
        if not tree_flatten(self.model.trainable_parameters()) or not _all_built(self.model):
            with _mode(self.model, training=False):
                key = self.device.rng_state[0]
                mx.eval(self.loss_fn(self.model, batch, self.device))
                self.device.rng_state[0] = key
        if self.zero is not None:
            self.zero.build(self.model)
        elif not self.optimizer.state or "step" not in self.optimizer.state:
            self.optimizer.init(self.model.trainable_parameters())

    def _make_step(self):
        model, optimizer, device = self.model, self.optimizer, self.device
        loss_and_grad = nn.value_and_grad(model, lambda batch: self.loss_fn(model, batch, device))
        clip = self.clip_grad_norm
        group, world, zero = self.group, self.world_size, self.zero

        def step(batch):
            loss, grads = loss_and_grad(batch)
            if zero is not None:
                if world > 1:
                    loss = mx.distributed.all_sum(loss, group=group) / world
                zero.update(model, grads, clip)
                return loss
            if world > 1:
                grads = nn.average_gradients(grads, group)
                loss = mx.distributed.all_sum(loss, group=group) / world
            if clip is not None:
                grads, _ = optim.clip_grad_norm(grads, clip)
            optimizer.update(model, grads)
            return loss

        if self.use_compile:
            state = [model.state, optimizer.state, device.rng_state, mx.random.state, *self._loss_state()]
            step = partial(mx.compile, inputs=state, outputs=state)(step)
        return step

    def _loss_state(self) -> list:
        state = getattr(self.loss_fn, "state", None)
        return [state] if isinstance(state, dict) else []

    def step(self, batch):
        """Run one optimisation step on ``batch`` (this process's share of it, in a data-parallel
        group); returns the loss as a Python float."""
        if self.world_size > 1:
            batch = shard(batch, self.rank, self.world_size)
        if self._step_fn is None:
            self._ensure_built(batch)
            if self._pending_resume is not None:
                self._apply_resume()
            self._step_fn = self._make_step()
        with _mode(self.model, training=True):
            loss = self._step_fn(batch)
            mx.eval(loss, self.model.parameters(), self.optimizer.state, self.device.rng_state, self._loss_state())
        value = loss.item()
        self.step_count += 1
        if not math.isfinite(value):
            raise TrainingDivergedError(self.step_count, value)
        self.history["loss"].append(value)
        return value

    # -- the loop ----------------------------------------------------------------------------
    def fit(self, data, steps: int, items_per_batch: int | None = None, desc: str = "train"):
        """Train until ``self.step_count == steps``.

        Args:
            data: ``data(step) -> batch`` (preferred: resuming then sees exactly the batches an
                uninterrupted run would) or an iterable of batches (on resume the first
                ``step_count`` batches are skipped).
            steps: total number of steps (counting steps done before a resume).
            items_per_batch: items (samples or tokens) per batch, for the throughput display: a
                number, or ``f(batch) -> int`` (e.g. the tokens of a batch of varying length);
                defaults to the leading size of the batch's first array.
        Returns:
            ``self.history``.
        """
        if callable(data):
            get = data
        else:
            it = iter(data)
            for _ in range(self.step_count):
                next(it)
            get = lambda _step: next(it)  # noqa: E731
        bar = None
        if self.progress and self.rank == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, initial=self.step_count, desc=desc, dynamic_ncols=True)
        t0, done0 = time.perf_counter(), self.step_count
        items = 0
        try:
            while self.step_count < steps:
                batch = get(self.step_count)
                loss = self.step(batch)
                count = items_per_batch(batch) if callable(items_per_batch) else items_per_batch
                items += count or _leading(batch)
                if bar is not None:
                    rate = items / max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix(loss=f"{loss:.4f}", items_s=f"{rate:,.0f}", refresh=False)
                    bar.update(1)
                if self.eval_fn and self.eval_every and self.step_count % self.eval_every == 0:
                    self._evaluate(bar)
                if (self.checkpoint_dir and self.checkpoint_every and self.step_count % self.checkpoint_every == 0
                        and (self.rank == 0 or self.zero is not None)):
                    self.save_checkpoint()
        finally:
            if bar is not None:
                bar.close()
        if self.eval_fn and (not self.eval_every or self.step_count % self.eval_every):
            self._evaluate(None)
        if self.checkpoint_dir and self.step_count > done0 and (self.rank == 0 or self.zero is not None):
            self.save_checkpoint()
        return self.history

    def _evaluate(self, bar):
        with _mode(self.model, training=False):
            metrics = dict(self.eval_fn(self))
        metrics["step"] = self.step_count
        self.history["eval"].append(metrics)
        if bar is not None:
            bar.write("step {step}: ".format(**metrics) + ", ".join(
                f"{k}={v:.4f}" for k, v in metrics.items() if k != "step" and isinstance(v, float)))
        return metrics

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, path=None) -> Path:
        """Write weights, optimizer state, step, RNG state and history into a folder, atomically.

        Default location: ``checkpoint_dir/step_<step>``; ``checkpoint_dir/latest`` names it. With
        ``zero``, every process must call it (the optimizer state is gathered); only rank 0 writes.
        """
        if path is None:
            if self.checkpoint_dir is None:
                raise ValueError("Trainer.save_checkpoint: give a path or set checkpoint_dir")
            path = self.checkpoint_dir / f"step_{self.step_count:07d}"
        path = Path(path)
        opt_state = self.zero.full_state() if self.zero is not None else dict(tree_flatten(self.optimizer.state))
        if self.zero is None or self.rank == 0:
            self._write_checkpoint(path, opt_state)
        if self.zero is not None:
            self.zero.barrier()  # every process returns once the files are there
        return path

    def _write_checkpoint(self, path, opt_state):
        import shutil  # (checkpoints alone need it: not imported with metalnn)

        tmp = path.with_name(path.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        save_safetensors(tmp / "model.safetensors", dict(tree_flatten(self.model.parameters())))
        save_safetensors(tmp / "optimizer.safetensors", opt_state)
        save_safetensors(tmp / "rng.safetensors", {"device_key": self.device.rng_state[0]})
        (tmp / "trainer.json").write_text(json.dumps({"step": self.step_count, "history": self.history}))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        if self.checkpoint_dir is not None and path.parent == self.checkpoint_dir:
            latest = self.checkpoint_dir / "latest"
            latest_tmp = self.checkpoint_dir / ".latest.tmp"
            latest_tmp.write_text(path.name)
            os.replace(latest_tmp, latest)
            self._prune()

    def _prune(self):
        if not self.keep_checkpoints:
            return
        import shutil

        ckpts = sorted(p for p in self.checkpoint_dir.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in ckpts[:-self.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)

    def resume(self, path=None) -> int:
        """Restore a checkpoint (a ``step_*`` folder, or a checkpoint_dir whose ``latest`` names one).

        Continuing with the same data source afterwards gives the same losses, bit for bit, as a
        run that was never interrupted. Returns the restored step.
        """
        path = Path(path) if path is not None else self.checkpoint_dir
        if path is None:
            raise ValueError("Trainer.resume: give a path or set checkpoint_dir")
        if (path / "latest").exists():
            path = path / (path / "latest").read_text().strip()
        if not (path / "trainer.json").exists():
            raise FileNotFoundError(f"Trainer.resume: {path} is not a checkpoint (no trainer.json)")
        meta = json.loads((path / "trainer.json").read_text())
        self.step_count = int(meta["step"])
        self.history = meta["history"]
        self._step_fn = None
        self._pending_resume = path
        if tree_flatten(self.model.parameters()) and _all_built(self.model):
            self._apply_resume()
        return self.step_count

    def _apply_resume(self):
        path, self._pending_resume = self._pending_resume, None
        load_into(self.model, path / "model.safetensors", strict=True, cast=False)
        opt = load_safetensors(path / "optimizer.safetensors")
        if self.zero is not None:
            self.zero.build(self.model).load_state(opt, str(path / "optimizer.safetensors"))
        else:
            self.optimizer.state = tree_unflatten(list(opt.items()))
        rng = load_safetensors(path / "rng.safetensors")
        self.device.rng_state[0] = rng["device_key"]
        mx.eval(self.model.parameters(), self.optimizer.state)


def shard(batch, rank: int, world: int):
    """Rank ``rank``'s part of ``batch`` (arrays, or tuples / lists / dicts of them): each array split
    along axis 0 into ``world`` equal parts."""
    if isinstance(batch, (tuple, list)):
        return type(batch)(shard(b, rank, world) for b in batch)
    if isinstance(batch, dict):
        return {k: shard(v, rank, world) for k, v in batch.items()}
    if not isinstance(batch, mx.array) or batch.ndim == 0:
        return batch
    n = batch.shape[0]
    if n % world:
        raise ValueError(f"Trainer: a batch of {n} rows does not split evenly over {world} data-parallel "
                         f"processes; use a batch size divisible by {world}")
    part = n // world
    return batch[rank * part:(rank + 1) * part]


@contextlib.contextmanager
def _mode(model, training: bool):
    """Run the block with ``model.train(training)``; restore the model's mode afterwards."""
    was = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was)


def _leading(batch):
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape else 1


def _all_built(model):
    from .layers.base import Layer

    for _, m in model.named_modules():
        if isinstance(m, Layer) and not m.built:
            return False
    return True

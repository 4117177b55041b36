"""A data-parallel training run for tests/llm/tuner/test_distributed.py, started by ``mlx.launch``.

    mlx.launch -n 2 --backend ring -- python data_parallel_train.py OUT_DIR [--crash-at STEP]

Every rank trains the same tiny model on the same batches (8 rows each) with `metalnn.Trainer`, which
gives each rank half of every batch; each rank writes ``rank<r>.json`` (the rows it saw per step and
the loss history), rank 0 also ``weights.safetensors``. ``--crash-at`` kills rank 1 (SIGKILL) at that step.
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

import metalnn as mn

STEPS, BATCH = 6, 8


def build():
    with mn.init.seeded(0):
        return mn.Layers(mn.Linear(16, in_features=5), mn.Tanh(), mn.Linear(3, in_features=16))


def batch(step):
    rng = np.random.default_rng(step)
    return mx.array(rng.normal(size=(BATCH, 5)).astype(np.float32)), mx.array(rng.integers(0, 3, BATCH))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--crash-at", type=int, default=None)
    args = p.parse_args()
    group = mx.distributed.init()
    seen = []

    def loss_fn(model, b, device):
        x, y = b
        seen.append(int(x.shape[0]))
        if args.crash_at is not None and group.rank() == 1 and len(seen) >= args.crash_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return mn.losses.cross_entropy(model(x, device=device), y)

    model = build()
    trainer = mn.Trainer(model, optim.SGD(0.5), loss_fn, mn.Device(seed=0), compile=False, progress=False,
                         group=group)
    trainer.fit(batch, STEPS)
    (args.out / f"rank{group.rank()}.json").write_text(json.dumps(
        {"rank": group.rank(), "size": group.size(), "rows": seen, "loss": trainer.history["loss"]}))
    if group.rank() == 0:
        mn.save_safetensors(args.out / "weights.safetensors", model.named_parameters())
    return 0


if __name__ == "__main__":
    sys.exit(main())

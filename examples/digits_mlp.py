"""Train an MLP on scikit-learn's handwritten digits with the metalnn builder API.

    python examples/digits_mlp.py [--steps 600] [--out runs/digits_mlp]

Real data, offline: 1,797 8x8 images. Prints test accuracy (>= 95% expected), writes a loss/accuracy
plot and a checkpoint into --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import metalnn as mn

import mlx.core as mx  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402


def load_data(seed=0):
    """Digits scaled to [0, 1], split 80/20 with a fixed seed: (x_train, y_train, x_test, y_test)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(X, y, test_size=0.2, random_state=seed, stratify=y)
    return mx.array(xtr), mx.array(ytr.astype(np.int32)), mx.array(xte), mx.array(yte.astype(np.int32))


def build_model():
    return mn.Layers([
        mn.Linear(128, init="kaiming_normal"), mn.ReLU(), mn.Dropout(0.1),
        mn.Linear(64, init="kaiming_normal"), mn.ReLU(),
        mn.Linear(10),
    ])


def loss_fn(model, batch, device):
    x, y = batch
    return mn.losses.cross_entropy(model(x, device=device), y)


def train(steps=600, batch_size=64, lr=3e-3, seed=0, out=None, progress=True):
    """Train and return (model, device, trainer, test_accuracy)."""
    xtr, ytr, xte, yte = load_data(seed)
    device = mn.Device(seed=seed)
    model = build_model()
    n = xtr.shape[0]
    order = np.random.default_rng(seed).permutation(n * (steps * batch_size // n + 1)) % n

    def batch(step):  # deterministic in the step, so resuming replays the same batches
        idx = mx.array(order[step * batch_size:(step + 1) * batch_size])
        return xtr[idx], ytr[idx]

    def evaluate(trainer):
        logits = trainer.model(xte, device=trainer.device)
        return {"test_loss": mn.losses.cross_entropy(logits, yte).item(),
                "test_accuracy": mn.losses.accuracy(logits, yte).item()}

    trainer = mn.Trainer(model, optim.AdamW(lr, weight_decay=1e-4), loss_fn, device, eval_fn=evaluate,
                         eval_every=max(steps // 10, 1), progress=progress,
                         checkpoint_dir=Path(out) / "checkpoints" if out else None,
                         checkpoint_every=max(steps // 2, 1))
    trainer.fit(batch, steps, items_per_batch=batch_size, desc="digits-mlp")
    acc = trainer.history["eval"][-1]["test_accuracy"]
    return model, device, trainer, acc


def plot(history, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(history["loss"], lw=0.8, label="train loss")
    ev = history["eval"]
    a.plot([e["step"] for e in ev], [e["test_loss"] for e in ev], "o-", label="test loss")
    a.set_xlabel("step"), a.set_ylabel("cross-entropy"), a.set_yscale("log"), a.legend()
    b.plot([e["step"] for e in ev], [100 * e["test_accuracy"] for e in ev], "o-", color="C2")
    b.set_xlabel("step"), b.set_ylabel("test accuracy (%)"), b.set_ylim(0, 100), b.grid(alpha=0.3)
    fig.suptitle("metalnn: MLP on scikit-learn digits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/digits_mlp")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, device, trainer, acc = train(args.steps, args.batch_size, args.lr, args.seed, out)
    elapsed = time.perf_counter() - t0
    model.save(out / "model.safetensors")
    plot(trainer.history, out / "training.png")
    (out / "metrics.json").write_text(json.dumps(trainer.history["eval"], indent=1))
    print(f"test accuracy: {100 * acc:.2f}%  ({args.steps} steps in {elapsed:.1f} s, kernels={device.kernels})")
    print(f"wrote {out / 'model.safetensors'}, {out / 'training.png'}, checkpoints in {out / 'checkpoints'}")


if __name__ == "__main__":
    main()

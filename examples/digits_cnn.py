"""Train a small CNN on scikit-learn's 8x8 digits (offline) with metalnn's builder API and Trainer.

    python examples/digits_cnn.py [--out runs/digits_cnn] [--steps 600] [--batch 64] [--seed 0]

Model (called on channels-last images ``[B, 8, 8, 1]``; inside the chain the data is planar,
``D = batch*channels``, so the layers after the first are told their channel counts):
Conv2D(16, 3, pad 1) -> ReLU -> MaxPool2D(2) -> Conv2D(32, 3, pad 1) -> ReLU -> MaxPool2D(2)
-> Flatten(channels=32) -> Linear(64) -> ReLU -> Linear(10).

Writes ``<out>/curves.png`` (training loss and test accuracy), ``<out>/model.safetensors`` and the
Trainer checkpoints under ``<out>/checkpoints/``; prints the final test accuracy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import metalnn as mn
import mlx.core as mx
import mlx.optimizers as optim
import numpy as np


def load_digits_split(seed: int = 0, test_fraction: float = 0.25):
    """Digits as ``[N, 8, 8, 1]`` float32 in [0, 1] plus int labels; a fixed-seed train/test split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    ds = load_digits()
    x = (ds.images / 16.0).astype(np.float32)[..., None]  # channels-last [N, 8, 8, 1]
    y = ds.target.astype(np.int32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return xtr, ytr, xte, yte


def build_model():
    return mn.Layers([
        mn.Conv2D(16, 3, padding=1),
        mn.ReLU(),
        mn.MaxPool2D(2),
        mn.Conv2D(32, 3, padding=1, in_channels=16),  # inside the chain data is planar: say the channels
        mn.ReLU(),
        mn.MaxPool2D(2),
        mn.Flatten(channels=32),
        mn.Linear(64, init="kaiming_normal"),
        mn.ReLU(),
        mn.Linear(10),
    ])


def loss_fn(model, batch, device):
    x, y = batch
    return mn.losses.cross_entropy(model(x, device=device), y)  # x [B, 8, 8, 1] -> logits [B, 10]


def evaluate(model, x, y, device) -> float:
    correct = 0
    for i in range(0, len(x), 256):
        logits = model(mx.array(x[i:i + 256]), device=device)
        correct += int((mx.argmax(logits, axis=-1) == mx.array(y[i:i + 256])).sum().item())
    return correct / len(x)


def train(steps: int = 600, batch: int = 64, lr: float = 3e-3, seed: int = 0, out=None, progress: bool = True,
          eval_every: int = 100):
    """Train and return ``(model, trainer, test_accuracy)``; checkpoints go to ``out/checkpoints`` if given."""
    xtr, ytr, xte, yte = load_digits_split(seed)
    device = mn.Device(seed=seed)
    model = build_model()
    epoch_len = len(xtr) // batch
    perms = {}

    def data(step):
        # Deterministic per step (resumable): epoch permutation, then the step's slice.
        epoch, i = divmod(step, epoch_len)
        if epoch not in perms:
            perms.clear()
            perms[epoch] = np.random.default_rng([seed, epoch]).permutation(len(xtr))
        idx = perms[epoch][i * batch:(i + 1) * batch]
        return mx.array(xtr[idx]), mx.array(ytr[idx])

    schedule = optim.cosine_decay(lr, steps, lr * 0.05)
    trainer = mn.Trainer(
        model, optim.Adam(schedule), loss_fn, device, progress=progress,
        checkpoint_dir=(Path(out) / "checkpoints") if out else None,
        eval_fn=lambda tr: {"test_accuracy": evaluate(tr.model, xte, yte, tr.device)}, eval_every=eval_every,
    )
    trainer.fit(data, steps, items_per_batch=batch, desc="digits-cnn")
    acc = evaluate(model, xte, yte, device)
    return model, trainer, acc


def plot(history, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax1 = plt.subplots(figsize=(7, 4))
    loss = np.asarray(history["loss"])
    ax1.plot(np.arange(1, len(loss) + 1), loss, color="tab:blue", alpha=0.35, label="train loss (step)")
    if len(loss) >= 20:
        k = 20
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax1.plot(np.arange(k, len(loss) + 1), smooth, color="tab:blue", label="train loss (20-step mean)")
    ax1.set_xlabel("step")
    ax1.set_ylabel("cross-entropy")
    ax1.set_yscale("log")
    ax2 = ax1.twinx()
    ev = history["eval"]
    ax2.plot([e["step"] for e in ev], [e["test_accuracy"] for e in ev], "o-", color="tab:orange",
             label="test accuracy")
    ax2.set_ylabel("test accuracy")
    ax2.set_ylim(0.0, 1.0)
    lines = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax1.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax1.legend(lines, labels, loc="center right")
    ax1.set_title("metalnn CNN on sklearn digits")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Train a small CNN on sklearn digits with metalnn.")
    ap.add_argument("--out", default="runs/digits_cnn", help="output folder (plot, weights, checkpoints)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, trainer, acc = train(args.steps, args.batch, args.lr, args.seed, out)
    model.save(out / "model.safetensors")
    plot(trainer.history, out / "curves.png")
    print(f"final test accuracy: {acc:.4f} ({args.steps} steps); wrote {out / 'curves.png'}, "
          f"{out / 'model.safetensors'}, {out / 'checkpoints'}")
    return acc


if __name__ == "__main__":
    sys.exit(0 if main() >= 0 else 1)

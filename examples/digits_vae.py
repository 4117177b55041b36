"""A convolutional variational autoencoder on scikit-learn's 8x8 digits (offline), trained with the Trainer.

    python examples/digits_vae.py [--out runs/digits_vae] [--steps 2000] [--latent 8] [--seed 0]

Encoder: Conv2D(32, 3, stride 2) -> ReLU -> Conv2D(64, 3, stride 2) -> ReLU -> Flatten -> Linear(2*latent)
giving the mean and log-variance of q(z|x). Decoder: Linear(64*2*2) -> ReLU -> ConvTransposed2D(32, 3,
stride 2) -> ReLU -> ConvTransposed2D(1, 3, stride 2): Bernoulli logits of the 8x8 image. The latent
sample ``z = mu + exp(logvar / 2) * eps`` draws ``eps`` from the device's key, so a seeded run is
reproducible and resumable. Loss: the negative ELBO, ``BCE(x, decoder(z)) + KL(q(z|x) || N(0, I))``
in nats per image.

Writes ``<out>/vae.png`` (test digits, their reconstructions, and samples from the prior),
``<out>/elbo.png`` (train and test ELBO over training) and ``<out>/model.safetensors``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import metalnn as mn
import mlx.core as mx
import mlx.optimizers as optim
import numpy as np


def load_digits_split(seed: int = 0, test_fraction: float = 0.2):
    """Digits as channels-last ``[N, 8, 8, 1]`` float32 in [0, 1]; a fixed-seed train/test split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    ds = load_digits()
    x = (ds.images / 16.0).astype(np.float32)[..., None]
    xtr, xte = train_test_split(x, test_size=test_fraction, random_state=seed, stratify=ds.target)
    return xtr, xte


class DigitsVAE(mn.Layer):
    """Encoder and decoder as metalnn layers; ``elbo(x, device)`` gives the loss terms per image."""

    def __init__(self, latent: int = 8):
        super().__init__()
        self.latent = latent
        self.encoder = mn.Layers(
            mn.Conv2D(32, 3, stride=2, padding=1), mn.ReLU(),                    # 8x8x1 -> 4x4x32
            mn.Conv2D(64, 3, stride=2, padding=1, in_channels=32), mn.ReLU(),    # -> 2x2x64
            mn.Flatten(channels=64), mn.Linear(2 * latent),                      # -> mu, logvar
        )
        self.decoder = mn.Layers(
            mn.Linear(64 * 2 * 2), mn.ReLU(),
            mn.Reshape((2, 2, -1)),                                              # planar 2x2, 64 channels
            mn.ConvTransposed2D(32, 3, stride=2, padding=1, output_padding=1, in_channels=64), mn.ReLU(),
            mn.ConvTransposed2D(1, 3, stride=2, padding=1, output_padding=1, in_channels=32),  # 8x8 logits
        )

    def encode(self, x, device=None):
        """``x [N, 8, 8, 1]`` -> ``(mu, logvar)``, each ``[N, latent]``."""
        h = self.compile_child_array(self.encoder, mn.device.resolve(device), x)
        return h[:, :self.latent], h[:, self.latent:]

    def decode(self, z, device=None):
        """``z [N, latent]`` -> Bernoulli logits ``[N, 8, 8, 1]``."""
        out = self.compile_child(self.decoder, mn.device.resolve(device), mn.Data(z))
        return out.to_nhwc(1)

    def elbo(self, x, device):
        """Per-image ``(negative ELBO, reconstruction BCE, KL)`` in nats, each ``[N]``."""
        mu, logvar = self.encode(x, device)
        eps = mx.random.normal(mu.shape, key=device.next_key())
        z = mu + mx.exp(0.5 * logvar) * eps
        logits = self.decode(z, device)
        # binary cross-entropy with logits, summed over the 64 pixels
        bce = (mx.logaddexp(0.0, logits) - x * logits).reshape(x.shape[0], -1).sum(-1)
        kl = 0.5 * (mx.exp(logvar) + mu * mu - 1.0 - logvar).sum(-1)
        return bce + kl, bce, kl

    def forward(self, device, data):  # the builder call: reconstructions of planar images
        x = data.to_nhwc(1)
        mu, _ = self.encode(x, device)
        return mn.Data.from_nhwc(mx.sigmoid(self.decode(mu, device)))


def loss_fn(model, batch, device):
    return model.elbo(batch, device)[0].mean()


def train(steps: int = 2000, batch: int = 64, lr: float = 2e-3, latent: int = 8, seed: int = 0, progress=True,
          eval_every: int = 200):
    """Train; returns ``(model, trainer, test_negative_elbo, xte)``."""
    xtr, xte = load_digits_split(seed)
    device = mn.Device(seed=seed)
    model = DigitsVAE(latent)
    eval_device = mn.Device(seed=seed + 1)
    epoch_len = len(xtr) // batch

    def data(step):  # a function of the step: resumable
        epoch, i = divmod(step, epoch_len)
        idx = np.random.default_rng([seed, epoch]).permutation(len(xtr))[i * batch:(i + 1) * batch]
        return mx.array(xtr[idx])

    def evaluate(trainer):
        eval_device.seed(seed + 1)  # the same noise at every evaluation
        neg_elbo, bce, kl = model.elbo(mx.array(xte), eval_device)
        return {"test_elbo": -neg_elbo.mean().item(), "test_bce": bce.mean().item(), "test_kl": kl.mean().item()}

    schedule = optim.cosine_decay(lr, steps, lr * 0.05)
    trainer = mn.Trainer(model, optim.Adam(schedule), loss_fn, device, progress=progress, eval_fn=evaluate,
                         eval_every=eval_every)
    trainer.fit(data, steps, items_per_batch=batch, desc="digits-vae")
    return model, trainer, -trainer.history["eval"][-1]["test_elbo"], xte


def plot_digits(model, xte, path, seed=0, n=10):
    """Rows: test digits, their reconstructions (posterior means), samples from the prior."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model.eval()
    originals = mx.array(xte[:n])
    mu, _ = model.encode(originals)
    recon = mx.sigmoid(model.decode(mu))
    z = mx.random.normal((n, model.latent), key=mx.random.key(seed))
    samples = mx.sigmoid(model.decode(z))
    rows = [("test digits", originals), ("reconstructions", recon), ("samples from the prior", samples)]
    fig, axes = plt.subplots(3, n, figsize=(n * 0.9, 3.2))
    for r, (title, imgs) in enumerate(rows):
        imgs = np.array(imgs)[..., 0]
        for c in range(n):
            ax = axes[r, c]
            ax.imshow(imgs[c], cmap="gray_r", vmin=0, vmax=1)
            ax.set_xticks([]), ax.set_yticks([])
        axes[r, 0].set_ylabel(title, rotation=0, ha="right", va="center", fontsize=9)
    fig.suptitle("metalnn: convolutional VAE on 8x8 digits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_elbo(history, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    loss = np.asarray(history["loss"])
    ax.plot(np.arange(1, len(loss) + 1), -loss, lw=0.6, alpha=0.6, label="train ELBO (batch)")
    ev = history["eval"]
    ax.plot([e["step"] for e in ev], [e["test_elbo"] for e in ev], "o-", label="test ELBO")
    ax.set_xlabel("step"), ax.set_ylabel("ELBO (nats per image)")
    ax.set_ylim(max(-120, float((-loss).min())), None)
    ax.legend(), ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/digits_vae"))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--latent", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, trainer, neg_elbo, xte = train(args.steps, args.batch, args.lr, args.latent, args.seed,
                                          progress=not args.no_progress, eval_every=max(args.steps // 10, 1))
    elapsed = time.perf_counter() - t0
    model.save(args.out / "model.safetensors")
    plot_digits(model, xte, args.out / "vae.png", args.seed)
    plot_elbo(trainer.history, args.out / "elbo.png")
    last = trainer.history["eval"][-1]
    print(f"test ELBO {-neg_elbo:.2f} nats/image (reconstruction {last['test_bce']:.2f}, KL {last['test_kl']:.2f}); "
          f"{args.steps} steps in {elapsed:.1f} s")
    print(f"wrote {args.out / 'vae.png'}, {args.out / 'elbo.png'}, {args.out / 'model.safetensors'}")
    return trainer.history


if __name__ == "__main__":
    main()

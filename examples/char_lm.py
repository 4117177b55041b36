"""Train a small character-level transformer language model with metalnn.

The model is a Llama-style decoder (`metalnn.llm.models.LlamaForCausalLM`: embedding, RMSNorm
pre-norm `TransformerBlock`s with RoPE attention and SwiGLU, output head) trained with
`metalnn.Trainer` on a public-domain text shipped in examples/data/ (the King James Version of
Genesis and Exodus). Every ``--sample-every`` steps it prints the validation loss and a sample.

At the end ``--out`` (default runs/char_lm) holds:

* ``loss.png``: training and validation loss against the unigram (character frequency) entropy;
* ``checkpoints/``: Trainer checkpoints (resume with ``--resume``);
* ``model/``: ``config.json`` + ``model.safetensors`` + a character ``tokenizer.json``, loadable by
  ``metalnn.llm.models.load_pretrained``, transformers, and ``examples/generate.py``.

    python examples/char_lm.py                    # a few minutes on 2 CPU cores
    python examples/char_lm.py --steps 100        # a quick look
    python examples/generate.py runs/char_lm/model --prompt "And God said" --temperature 0.8
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import metalnn as mn
import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE / "data" / "kjv_genesis_exodus.txt"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a UTF-8 text file")
    p.add_argument("--out", type=Path, default=Path("runs/char_lm"))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128, help="characters per training window")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sample-every", type=int, default=200)
    p.add_argument("--sample-chars", type=int, default=240)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def unigram_entropy(ids: np.ndarray, vocab: int) -> float:
    """Entropy (nats per character) of the character frequencies: the loss of the best model that
    ignores context."""
    counts = np.bincount(ids, minlength=vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def main(argv=None):
    args = parse_args(argv)
    text = args.data.read_text(encoding="utf-8")
    tok = mn.models.char_tokenizer(text)
    tok.eos_token_id = None
    ids = np.array(tok.encode(text), dtype=np.int32)
    split = int(len(ids) * 0.95)
    train, val = ids[:split], ids[split:]
    vocab = tok.vocab_size
    h_uni = unigram_entropy(train, vocab)
    print(f"text: {args.data.name}, {len(text):,} characters, {vocab} symbols; "
          f"unigram entropy {h_uni:.3f} nats/char ({h_uni / math.log(2):.3f} bits)")

    config = mn.models.llama_config(vocab_size=vocab, hidden_size=args.dim, num_hidden_layers=args.layers,
                                    num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                    intermediate_size=(8 * args.dim) // 3, max_position_embeddings=args.seq)
    model = mn.models.from_config(config, seed=args.seed)
    print(f"model: {model.num_parameters():,} parameters "
          f"({args.layers} x TransformerBlock, width {args.dim}, {args.heads} heads / {args.kv_heads} kv heads)")
    device = mn.Device(seed=args.seed)

    def batch_at(step, data=train, batch=args.batch):
        rng = np.random.default_rng((args.seed, step))
        starts = rng.integers(0, len(data) - args.seq - 1, batch)
        window = np.stack([data[s:s + args.seq + 1] for s in starts])
        return mx.array(window[:, :-1]), mx.array(window[:, 1:])

    def loss_fn(model, batch, device):
        x, y = batch
        logits = model.compile(device, mn.Data(x)).array
        return mn.losses.cross_entropy(logits, y)

    val_batches = [batch_at(10**6 + i, val, 32) for i in range(4)]

    def val_loss():
        return float(np.mean([loss_fn(model, b, device).item() for b in val_batches]))

    prompt = "1:1 In the beginning"

    def sample(n=args.sample_chars, seed=0):
        out = mn.generate(model, tok.encode(prompt), n, temperature=0.8, top_k=20, seed=seed, device=device,
                          max_context=args.seq)  # stay within the positions the model was trained on
        return prompt + tok.decode(out)

    def eval_fn(trainer):
        v = val_loss()
        from tqdm.auto import tqdm

        tqdm.write(f"\n--- step {trainer.step_count}: val loss {v:.3f} nats/char "
                   f"(unigram {h_uni:.3f}) ---\n{sample()}\n")
        return {"val_loss": v}

    warmup = min(100, max(1, args.steps // 10))
    schedule = optim.join_schedules([optim.linear_schedule(1e-5, args.lr, warmup),
                                     optim.cosine_decay(args.lr, max(1, args.steps - warmup), args.lr * 0.05)],
                                    [warmup])
    trainer = mn.Trainer(model, optim.AdamW(schedule, weight_decay=0.01), loss_fn, device=device,
                         clip_grad_norm=1.0, checkpoint_dir=args.out / "checkpoints",
                         checkpoint_every=max(args.steps // 4, 1), eval_fn=eval_fn, eval_every=args.sample_every,
                         progress=not args.no_progress)
    if args.resume and (args.out / "checkpoints" / "latest").exists():
        print(f"resuming from step {trainer.resume()}")
    t0 = time.perf_counter()
    history = trainer.fit(batch_at, args.steps, items_per_batch=args.batch * args.seq)
    elapsed = time.perf_counter() - t0

    final_val = history["eval"][-1]["val_loss"] if history["eval"] else val_loss()
    tail = history["loss"][-min(50, len(history["loss"])):]
    print(f"\ntrained {args.steps} steps in {elapsed:.0f} s; train loss (last {len(tail)} steps) "
          f"{np.mean(tail):.3f}, val loss {final_val:.3f} nats/char; unigram entropy {h_uni:.3f} "
          f"({final_val / math.log(2):.2f} vs {h_uni / math.log(2):.2f} bits/char)")

    args.out.mkdir(parents=True, exist_ok=True)
    folder = model.save_pretrained(args.out / "model")
    tok.save(folder)
    print(f"saved model + tokenizer to {folder}")
    plot = _plot(history, h_uni, args.out / "loss.png")
    if plot:
        print(f"loss plot: {plot}")
    print(f"\nsample:\n{sample(400, seed=1)}")
    return final_val, h_uni


def _plot(history, h_uni, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    losses = np.array(history["loss"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(np.arange(1, len(losses) + 1), losses, lw=0.6, alpha=0.5, label="train (per step)")
    k = min(25, len(losses))
    if k > 1:
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k, len(losses) + 1), smooth, label=f"train ({k}-step mean)")
    if history["eval"]:
        ax.plot([e["step"] for e in history["eval"]], [e["val_loss"] for e in history["eval"]], "o-",
                label="validation")
    ax.axhline(h_uni, color="gray", ls="--", label=f"unigram entropy {h_uni:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title("char-level transformer (metalnn)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()

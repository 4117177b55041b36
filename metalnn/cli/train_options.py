"""What the preference and reinforcement fine-tuning commands share (``metalnn dpo|orpo|kto|grpo``):
their options, with TRL's defaults where TRL has one, the optimizer and learning-rate schedule they
name, what is trained (LoRA adapters, QLoRA on a quantized base, or every weight with ``--full``),
and the ``--log-file`` of one JSON line per step.

TRL's defaults kept here: AdamW (betas 0.9 / 0.999, eps 1e-8, no weight decay), a learning rate
decaying linearly to 0 over the run with no warm-up, gradient clipping at a global norm of 1.0,
``beta`` 0.1 (each command states its own default learning rate and ``beta``, as TRL's configs do).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .common import CommandError, positive_int

OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("linear", "constant")


def add_fine_tuning_options(parser, *, learning_rate: float, beta: float | None = 0.1, steps: int = 100,
                            batch_size: int = 4):
    """Add the shared options to ``parser``: data, output, what trains, the optimizer and logging.
    ``learning_rate``, ``beta``, ``steps`` and ``batch_size`` are the command's defaults (``beta``
    None: the command has no ``--beta``)."""
    parser.add_argument("--train", required=True, metavar="FILE", help="training data (.jsonl, TRL's format)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="folder for the result: PEFT adapters, or the whole model with --full")
    parser.add_argument("--ref-model", metavar="MODEL",
                        help="the reference model (default: the model itself before training; with LoRA the "
                             "adapters switched off, no second copy of the weights)")
    if beta is not None:
        parser.add_argument("--beta", type=float, default=beta,
                            help=f"strength of the pull towards the reference model (default {beta}, as TRL)")
    what = parser.add_argument_group("what trains (default: LoRA adapters)")
    what.add_argument("--full", action="store_true", help="train every weight instead of LoRA adapters")
    what.add_argument("--rank", type=positive_int, default=8, help="adapter rank r (default 8)")
    what.add_argument("--alpha", type=float, default=16.0, help="lora_alpha; the update is scaled by alpha / r "
                      "(default 16)")
    what.add_argument("--targets", default="q_proj,v_proj",
                      help="comma-separated projection names to adapt (default q_proj,v_proj)")
    what.add_argument("--quantize", type=int, metavar="BITS", help="quantize a float model to BITS first (QLoRA)")
    what.add_argument("--group-size", type=int, default=64, help="group size for --quantize (default 64)")
    opt = parser.add_argument_group("optimisation (TRL's defaults)")
    opt.add_argument("--steps", type=positive_int, default=steps, help=f"optimizer steps (default {steps})")
    opt.add_argument("--batch-size", type=positive_int, default=batch_size,
                     help=f"examples per step (default {batch_size})")
    opt.add_argument("--lr", type=float, default=learning_rate, help=f"learning rate (default {learning_rate:g})")
    opt.add_argument("--lr-schedule", choices=SCHEDULES, default="linear",
                     help="linear: decay to 0 over --steps, no warm-up (default, as TRL); constant")
    opt.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="default adamw (no weight decay)")
    opt.add_argument("--max-grad-norm", type=float, default=1.0,
                     help="clip the global gradient norm to this (default 1.0; 0 turns clipping off)")
    opt.add_argument("--max-length", type=positive_int, default=1024,
                     help="tokens per prompt + completion; longer ones are cut (default 1024)")
    opt.add_argument("--grad-checkpoint", action="store_true",
                     help="recompute each transformer block in the backward pass (less memory, more time)")
    opt.add_argument("--seed", type=int, default=0, help="seed of the adapters' initial values and sampling")
    parser.add_argument("--log-file", metavar="FILE",
                        help="write one JSON line per step: the loss and the metrics TRL logs, under TRL's names")


def check_fine_tuning_options(args):
    """Refuse values no run can use, naming the option (before the model loads)."""
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise CommandError(f"--lr must be a positive number, got {args.lr}")
    if not (args.max_grad_norm >= 0 and math.isfinite(args.max_grad_norm)):
        raise CommandError(f"--max-grad-norm must be 0 (off) or a positive number, got {args.max_grad_norm}")
    if getattr(args, "beta", 0.0) is not None and not (getattr(args, "beta", 0.0) >= 0
                                                      and math.isfinite(getattr(args, "beta", 0.0))):
        raise CommandError(f"--beta must be a number >= 0, got {args.beta}")
    if args.full and args.quantize:
        raise CommandError("--full trains float weights; it cannot be combined with --quantize (QLoRA)")
    if not [t for t in args.targets.split(",") if t.strip()]:
        raise CommandError("--targets names no projection")


def make_optimizer(name: str, learning_rate: float, steps: int, schedule: str = "linear"):
    """The ``mlx.optimizers`` optimizer ``name`` (``sgd``, ``adam``, ``adamw``) with TRL's settings
    (AdamW without weight decay, eps 1e-8) and the learning rate ``schedule`` over ``steps``:
    ``linear`` gives step ``t`` (from 0) the rate ``learning_rate * (1 - t / steps)``, as
    transformers' linear schedule without warm-up."""
    import mlx.optimizers as optim

    if schedule == "linear":
        lr = optim.linear_schedule(learning_rate, 0.0, steps)
    elif schedule == "constant":
        lr = learning_rate
    else:
        raise CommandError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if name == "sgd":
        return optim.SGD(learning_rate=lr)
    if name == "adam":
        return optim.Adam(learning_rate=lr, eps=1e-8)
    if name == "adamw":
        return optim.AdamW(learning_rate=lr, eps=1e-8, weight_decay=0.0)
    raise CommandError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def prepare_trainable(model, args) -> str:
    """Make ``model`` ready to train as ``args`` ask: quantize first with ``--quantize``, then LoRA
    adapters on ``--targets`` (QLoRA over quantized weights), or every weight with ``--full``.
    Returns a one-line description for the log."""
    import mlx.core as mx

    from ..llm.tuner import lora
    from ..quantization import quantize, quantized_layers

    if args.quantize:
        if quantized_layers(model):
            raise CommandError(f"{args.model}: the model is already quantized; leave out --quantize")
        quantize(model, bits=args.quantize, group_size=args.group_size)
    if args.full:
        if quantized_layers(model):
            raise CommandError(f"{args.model}: --full trains float weights, and this model is quantized; "
                               "train LoRA adapters on it instead (QLoRA: leave out --full)")
        model.unfreeze()
        return "full fine-tuning: every weight trains"
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    mx.random.seed(args.seed)  # the adapters' initial values come from MLX's random state
    paths = lora.apply(model, rank=args.rank, alpha=args.alpha, targets=targets)
    kind = "QLoRA" if quantized_layers(model) else "LoRA"
    return f"{kind}: {len(paths)} adapters of rank {args.rank} on {', '.join(targets)}"


def save_result(model, args):
    """Write the adapters (PEFT's format) or, with ``--full``, the whole model to ``--out``."""
    from ..llm.tuner import lora

    if args.full:
        model.save_pretrained(args.out)
        return f"wrote {args.out} (the whole model)"
    lora.save_adapters(model, args.out, base_model_name_or_path=str(args.model))
    return f"wrote {args.out} (PEFT adapter_config.json + adapter_model.safetensors)"


class MetricsLog:
    """``--log-file``: one JSON object per line (``{"step": n, "loss": ..., <TRL's metric names>}``);
    a no-op without a path. Use as a context manager."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self._file = None

    def __enter__(self):
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")
        return self

    def write(self, step: int, metrics: dict):
        if self._file is not None:
            record = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def __exit__(self, *exc):
        if self._file is not None:
            self._file.close()
            self._file = None

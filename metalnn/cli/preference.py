"""``metalnn dpo|orpo|kto MODEL --train DATA.jsonl --out DIR``: preference fine-tuning, as TRL 1.13 computes it.

DPO and KTO pull the model towards preferred completions relative to a reference model: with LoRA
(the default) the model itself with its adapters switched off, no second copy of the weights; with
``--full`` a frozen copy of the weights from before training; or ``--ref-model M``. ORPO needs no
reference. The data is TRL's (`metalnn.llm.tuner.preference_data`); the losses and the metrics
written to ``--log-file`` (one JSON line per step, TRL's names) are `metalnn.llm.tuner.preference`'s.
Batches follow the file's order. Defaults are TRL's (learning rate 1e-6, beta 0.1, AdamW, linear
decay, clipping at 1.0).
"""

from __future__ import annotations

import math

from .common import CommandError, add_model, load
from .train_options import (MetricsLog, add_fine_tuning_options, check_fine_tuning_options, make_optimizer,
                            prepare_trainable, save_result)

HELP = {
    "dpo": "Direct Preference Optimization on {prompt, chosen, rejected} pairs",
    "orpo": "Odds Ratio Preference Optimization on {prompt, chosen, rejected} pairs (no reference model)",
    "kto": "Kahneman-Tversky Optimization on {prompt, completion, label} examples",
}
#: what each command's progress line shows besides the loss
SHOWN = {"dpo": ("rewards/margins", "rewards/accuracies"), "orpo": ("nll_loss", "rewards/accuracies"),
         "kto": ("rewards/chosen", "rewards/rejected", "kl")}


def add_parser(commands):
    for method in ("dpo", "orpo", "kto"):
        p = commands.add_parser(method, help=HELP[method].split(" on ")[0] + " fine-tuning (TRL's losses)",
                                description=HELP[method] + ", in TRL's data format (standard or conversational); "
                                "writes PEFT adapters (or the whole model with --full).")
        add_model(p)
        add_fine_tuning_options(p, learning_rate=1e-6, beta=0.1)
        if method == "dpo":
            p.add_argument("--loss", choices=("sigmoid", "ipo", "hinge", "robust"), default="sigmoid",
                           help="DPO loss (default sigmoid)")
            p.add_argument("--label-smoothing", type=float, default=0.0,
                           help="probability that a preference label is flipped, for --loss robust (default 0)")
            p.add_argument("--truncation-mode", choices=("keep_start", "keep_end"), default="keep_start",
                           help="which end of a sequence longer than --max-length to keep (default keep_start)")
        if method == "kto":
            p.add_argument("--desirable-weight", type=float, default=1.0,
                           help="weight of the desirable examples' losses (default 1)")
            p.add_argument("--undesirable-weight", type=float, default=1.0,
                           help="weight of the undesirable examples' losses (default 1)")
        if method != "orpo":
            p.add_argument("--precompute-ref-log-probs", action="store_true",
                           help="compute the reference log-probabilities of the whole dataset once, before training")
        p.set_defaults(run=run, method=method)


def _check(args):
    check_fine_tuning_options(args)
    method = args.method
    if method == "orpo" and args.ref_model:
        raise CommandError("--ref-model: ORPO uses no reference model")
    if method == "dpo":
        if args.label_smoothing and args.loss != "robust":
            raise CommandError(f"--label-smoothing is used only by --loss robust (as TRL), not --loss {args.loss}")
        if not 0.0 <= args.label_smoothing < 0.5:
            raise CommandError(f"--label-smoothing must be in [0, 0.5), got {args.label_smoothing}")
        if args.loss == "ipo" and args.beta == 0:
            raise CommandError("--beta must be > 0 with --loss ipo (the loss divides by it)")
    if method == "kto":
        for name in ("desirable_weight", "undesirable_weight"):
            value = getattr(args, name)
            if not (value > 0 and math.isfinite(value)):
                raise CommandError(f"--{name.replace('_', '-')} must be a positive number, got {value}")


def _settings(args) -> dict:
    if args.method == "dpo":
        return {"beta": args.beta, "loss_type": args.loss, "label_smoothing": args.label_smoothing}
    if args.method == "kto":
        return {"beta": args.beta, "desirable_weight": args.desirable_weight,
                "undesirable_weight": args.undesirable_weight}
    return {"beta": args.beta}


def run(args):
    from ..device import Device
    from ..llm.tuner import preference as pref
    from ..llm.tuner import preference_data as pdata
    from ..trainer import Trainer

    _check(args)
    method = args.method
    model, tok = load(args.model)
    data = pdata.load_preference_data(args.train, tok, method, max_length=args.max_length,
                                      truncation_mode=getattr(args, "truncation_mode", "keep_start"))
    ref_model = load(args.ref_model, tokenizer=False)[0] if args.ref_model else None
    what = prepare_trainable(model, args)
    reference = None if method == "orpo" else pref.Reference.for_model(model, ref_model)
    device = Device(seed=args.seed)
    if getattr(args, "precompute_ref_log_probs", False):
        data = pref.precompute_reference(data, model, reference, args.batch_size, device)
    objective = pref.objective(method, reference, **_settings(args))
    optimizer = make_optimizer(args.optimizer, args.lr, args.steps, args.lr_schedule)
    trainer = Trainer(model, optimizer, objective, device=device, clip_grad_norm=args.max_grad_norm or None,
                      progress=False, grad_checkpoint=args.grad_checkpoint)
    source = data.batches(args.batch_size)
    ref_text = "" if reference is None else f"; reference: {reference.describe()}" + (
        " (log-probabilities precomputed)" if data.ref_logps is not None else "")
    print(f"{method.upper()}, {what}; {len(data)} training examples{ref_text}", flush=True)
    report = max(1, args.steps // 10)
    tokens, recent = 0, []
    with MetricsLog(args.log_file) as log:
        for step in range(args.steps):
            batch = source(step)
            loss = trainer.step(batch)
            tokens += pdata.num_tokens(batch)
            metrics = {"loss": loss, **objective.metrics(), "num_tokens": tokens}
            log.write(step + 1, metrics)
            recent.append(metrics)
            if (step + 1) % report == 0 or step + 1 == args.steps:
                shown = [("loss", "train loss")] + [(k, k) for k in SHOWN[method]]
                parts = []
                for key, label in shown:
                    values = [m[key] for m in recent if key in m]
                    if values:
                        parts.append(f"{label} {sum(values) / len(values):.4f}")
                print(f"step {step + 1}/{args.steps}: " + ", ".join(parts), flush=True)
                recent = []
    print(save_result(model, args))

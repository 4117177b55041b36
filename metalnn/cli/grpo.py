"""``metalnn grpo MODEL --train prompts.jsonl --out adapters/ --reward module:function``: GRPO fine-tuning.

Reinforcement learning with verifiable rewards (`metalnn.llm.tuner.grpo`, computed as TRL's
``GRPOTrainer``): each step samples ``--num-generations`` completions of each prompt, scores them
with the ``--reward`` functions (``module:function`` from the current folder or
``path/to/file.py:function``, repeatable; ``--reward-weights`` weighs them) and moves the model
towards the completions that scored above their group's mean. The defaults are TRL's (learning
rate 1e-6, beta 0, loss ``dapo``, 8 generations, 512 completion tokens, temperature 1, AdamW,
linear decay, gradient clipping at 1.0). ``--log-file`` writes one JSON line per step with the
loss and TRL's metrics (``reward``, ``reward_std``, ``rewards/<func>/mean``, ``kl``, ...).
"""

from __future__ import annotations

import math
import sys

from .common import CommandError, add_model, load, positive_int
from .train_options import (MetricsLog, add_fine_tuning_options, check_fine_tuning_options, make_optimizer,
                            prepare_trainable, save_result)


def add_parser(commands):
    from ..llm.tuner.grpo import LOSS_TYPES
    from ..llm.tuner.rewards import SCALE_REWARDS

    p = commands.add_parser("grpo", help="GRPO fine-tuning with reward functions (as TRL's GRPOTrainer)",
                            description=(
        "GRPO: sample groups of completions of each prompt ({'prompt': ...} per JSONL line, a string or chat "
        "messages; other fields go to the reward functions), score them with Python reward functions and train "
        "towards the better ones. Writes PEFT adapters (or the whole model with --full)."))
    add_model(p)
    add_fine_tuning_options(p, learning_rate=1e-6, beta=0.0, steps=100, batch_size=8)
    g = p.add_argument_group("GRPO (TRL's defaults)")
    g.add_argument("--reward", action="append", required=True, metavar="MODULE:FUNCTION",
                   help="a reward function: module:function (imported from the current folder) or "
                        "path/to/file.py:function; repeat for several")
    g.add_argument("--reward-weights", metavar="W1,W2,...", help="one weight per --reward (default: all 1)")
    g.add_argument("--num-generations", type=positive_int, default=8,
                   help="completions sampled per prompt (default 8; --batch-size must be a multiple)")
    g.add_argument("--max-completion-length", type=positive_int, default=512,
                   help="the most tokens of a completion (default 512)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    g.add_argument("--loss", choices=LOSS_TYPES, default="dapo",
                   help="how token losses are averaged (default dapo, as TRL)")
    g.add_argument("--epsilon", type=float, default=0.2, help="ratio clipping range (default 0.2)")
    g.add_argument("--epsilon-high", type=float, help="upper clipping range (default: --epsilon)")
    g.add_argument("--scale-rewards", choices=SCALE_REWARDS, default="group",
                   help="divide advantages by the group's or batch's reward std, or not (default group)")
    g.add_argument("--mask-truncated-completions", action="store_true",
                   help="leave completions that hit --max-completion-length out of the loss")
    p.set_defaults(run=run)


def _weights(text, count):
    if text is None:
        return None
    try:
        weights = tuple(float(w) for w in text.split(","))
    except ValueError:
        raise CommandError(f"--reward-weights must be comma-separated numbers, got {text!r}") from None
    if len(weights) != count:
        raise CommandError(f"--reward-weights gives {len(weights)} weights for {count} --reward functions")
    if not all(math.isfinite(w) for w in weights):
        raise CommandError(f"--reward-weights must be finite numbers, got {text!r}")
    return weights


def _config(args, weights):
    from ..llm.tuner.grpo import GRPOConfig

    if args.batch_size % args.num_generations:
        raise CommandError(f"--batch-size {args.batch_size} must be a multiple of --num-generations "
                           f"{args.num_generations} (each step takes whole groups of completions)")
    try:
        return GRPOConfig(num_generations=args.num_generations, max_completion_length=args.max_completion_length,
                          temperature=args.temperature, beta=args.beta, epsilon=args.epsilon,
                          epsilon_high=args.epsilon_high, loss_type=args.loss, scale_rewards=args.scale_rewards,
                          reward_weights=weights, mask_truncated_completions=args.mask_truncated_completions)
    except ValueError as e:
        message = str(e)
        for field, flag in (("num_generations", "--num-generations"), ("temperature", "--temperature"),
                            ("beta", "--beta")):
            message = message.replace(f"GRPOConfig.{field}:", f"{flag}:")
        raise CommandError(message) from None


def run(args):
    from ..device import Device
    from ..llm.tuner.grpo import GRPOTrainer, load_prompts
    from ..llm.tuner.rewards import load_reward

    check_fine_tuning_options(args)
    funcs = [load_reward(spec) for spec in args.reward]  # before the model loads: a bad spec fails fast
    cfg = _config(args, _weights(args.reward_weights, len(funcs)))
    records = load_prompts(args.train)
    model, tok = load(args.model)
    what = prepare_trainable(model, args)
    ref = None
    if cfg.beta:
        if args.ref_model:
            ref, _ = load(args.ref_model, tokenizer=False)
        elif args.full:  # the model before training: a second copy, as the adapters cannot be switched off
            ref, _ = load(args.model, tokenizer=False, quiet=True)
    trainer = GRPOTrainer(model, tok, funcs, records, cfg, ref_model=ref, batch_size=args.batch_size,
                          optimizer=make_optimizer(args.optimizer, args.lr, args.steps, args.lr_schedule),
                          max_grad_norm=args.max_grad_norm, seed=args.seed, device=Device(seed=args.seed),
                          steps=args.steps, max_prompt_length=max(1, args.max_length - args.max_completion_length))
    print(f"{what}; {len(records)} prompts, {trainer.prompts_per_step} per step x {cfg.num_generations} completions; "
          f"rewards: {', '.join(spec for spec in args.reward)}", flush=True)
    report = max(1, args.steps // 10)
    recent = []
    with MetricsLog(args.log_file) as log:
        for step in range(1, args.steps + 1):
            metrics = trainer.step()
            log.write(step, {k: v for k, v in metrics.items() if math.isfinite(v)})
            recent.append(metrics)
            if step % report == 0 or step == args.steps:
                mean = lambda k: sum(m[k] for m in recent) / len(recent)  # noqa: E731
                failures = sum(m["reward_failures"] for m in recent)
                print(f"step {step}/{args.steps}: loss {mean('loss'):.4f}, reward {mean('reward'):.4f}, "
                      f"completion length {mean('completions/mean_length'):.1f}"
                      + (f", kl {mean('kl'):.4f}" if cfg.beta else "")
                      + (f", {failures:g} completions without a reward" if failures else ""), flush=True)
                for name, message in trainer.reward_errors.items():
                    sys.stderr.write(f"[reward {name} failed: {message}]\n")
                trainer.reward_errors.clear()
                recent = []
    print(save_result(model, args))

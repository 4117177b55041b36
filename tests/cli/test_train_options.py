"""The fine-tuning commands' shared options: TRL's defaults, the optimizers and schedules they name,
refusals naming the option, the JSON-lines log."""

import argparse
import json

import mlx.core as mx
import mlx.optimizers as optim
import pytest

from metalnn.cli.common import CommandError
from metalnn.cli.train_options import (MetricsLog, add_fine_tuning_options, check_fine_tuning_options,
                                       make_optimizer)


def parse(*argv, **defaults):
    p = argparse.ArgumentParser()
    add_fine_tuning_options(p, learning_rate=defaults.pop("learning_rate", 1e-6), **defaults)
    return p.parse_args(["--train", "t.jsonl", "--out", "o", *argv])


def test_defaults_are_trls():
    args = parse()
    assert (args.optimizer, args.lr, args.lr_schedule, args.max_grad_norm, args.beta) == ("adamw", 1e-6, "linear",
                                                                                         1.0, 0.1)
    assert not args.full and args.rank == 8
    assert not hasattr(parse(beta=None), "beta")


def test_linear_schedule_decays_to_zero_as_transformers():
    opt = make_optimizer("sgd", 0.5, steps=4)
    rates = []
    for _ in range(4):
        opt.update({"w": mx.array(1.0)}, {"w": mx.array(0.0)})
        rates.append(opt.learning_rate.item())  # the rate the update just used
    assert rates == [0.5, 0.375, 0.25, 0.125]  # transformers' linear schedule, no warm-up
    assert make_optimizer("adam", 0.1, 4, "constant").learning_rate.item() == pytest.approx(0.1)


def test_adamw_has_no_weight_decay():
    opt = make_optimizer("adamw", 1e-3, 10)
    assert isinstance(opt, optim.AdamW) and opt.weight_decay == 0.0 and opt.eps == 1e-8


@pytest.mark.parametrize("argv, message", [
    (("--lr", "0"), "--lr must be a positive number, got 0.0"),
    (("--max-grad-norm", "-1"), "--max-grad-norm must be 0 (off) or a positive number"),
    (("--beta", "nan"), "--beta must be a number >= 0, got nan"),
    (("--full", "--quantize", "4"), "--full trains float weights"),
    (("--targets", " , "), "--targets names no projection"),
])
def test_bad_values_are_named(argv, message):
    with pytest.raises(CommandError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_fine_tuning_options(parse(*argv))


def test_metrics_log_writes_one_json_line_per_step(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    with MetricsLog(str(path)) as log:
        log.write(1, {"loss": mx.array(0.5), "rewards/margins": 0.25})
        log.write(2, {"loss": 0.4})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [{"step": 1, "loss": 0.5, "rewards/margins": 0.25}, {"step": 2, "loss": 0.4}]
    with MetricsLog(None) as log:  # no file: nothing written, nothing raised
        log.write(1, {"loss": 1.0})

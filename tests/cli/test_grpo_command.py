"""``metalnn grpo`` (run as child processes) on the tiny model of tests/support/app_models.py: reward
functions from a file and from a module of the current folder, the JSON-lines log under TRL's
metric names, PEFT adapters written, reward failures reported while the run goes on, and the
one-line errors of bad options."""

import json
import os
import subprocess
import sys

import pytest

from app_models import save_tiny_model
from commands import assert_one_line_error

REWARDS = '''
def has_x(completions, **kwargs):
    return [float("x" in c) for c in completions]

def picky(completions, target, **kwargs):
    if any("a" in c for c in completions):
        raise ValueError("no a")
    return [float(t in c) for c, t in zip(completions, target)]

not_callable = 3
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture
def work(tmp_path):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    prompts = [{"prompt": [{"role": "user", "content": q}], "target": t} for q, t in
               (("say x", "x"), ("say y", "y"), ("say z", "z"))]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return tmp_path


def metalnn_cmd(*args, cwd):
    """``python -m metalnn *args`` run in ``cwd`` (reward modules are imported from there)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "metalnn", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def grpo(tiny, work, *args):
    return metalnn_cmd("grpo", tiny, "--train", work / "prompts.jsonl", "--out", work / "adapters",
                       "--num-generations", "2", "--batch-size", "4", "--max-completion-length", "6",
                       "--steps", "3", *args, cwd=work)


def test_trains_with_rewards_from_a_file_and_a_module_and_logs_trls_metrics(tiny, work):
    r = grpo(tiny, work, "--reward", "my_rewards.py:has_x", "--reward", "my_rewards:picky",
             "--reward-weights", "1,0.5", "--beta", "0.05", "--loss", "grpo", "--lr", "1e-3",
             "--log-file", work / "logs" / "metrics.jsonl")
    assert r.returncode == 0, r.stderr
    assert "step 3/3: loss" in r.stdout and "LoRA: " in r.stdout
    assert (work / "adapters" / "adapter_config.json").exists()
    assert (work / "adapters" / "adapter_model.safetensors").exists()
    lines = [json.loads(line) for line in (work / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert {"loss", "reward", "reward_std", "kl", "entropy", "grad_norm", "learning_rate", "num_tokens",
                "rewards/has_x/mean", "rewards/picky/mean", "rewards/picky/failures", "reward_failures",
                "completions/mean_length", "clip_ratio/region_mean", "frac_reward_zero_std"} <= set(line)
    # the linear schedule from --lr down to 0 over --steps, as TRL
    assert [line["learning_rate"] for line in lines] == pytest.approx([1e-3, 2e-3 / 3, 1e-3 / 3])


def test_reward_failures_are_reported_and_the_run_goes_on(tiny, work):
    (work / "always_fails.py").write_text("def broken(completions, **kw):\n    raise KeyError('answer')\n")
    r = grpo(tiny, work, "--reward", "always_fails.py:broken", "--reward", "my_rewards.py:has_x",
             "--log-file", work / "m.jsonl")
    assert r.returncode == 0, r.stderr
    assert "[reward broken failed: KeyError: 'answer']" in r.stderr
    assert "4 completions without a reward" in r.stdout
    lines = [json.loads(line) for line in (work / "m.jsonl").read_text().splitlines()]
    assert all(line["rewards/broken/failures"] == 4 and line["reward_failures"] == 4 for line in lines)
    assert all("rewards/broken/mean" not in line for line in lines)  # NaN (no reward at all) is left out


@pytest.mark.parametrize("args, mentions", [
    (("--reward", "nocolon"), ["reward 'nocolon': expected module:function or path/to/file.py:function"]),
    (("--reward", "missing.py:f"), ["reward 'missing.py:f': no such file"]),
    (("--reward", "my_rewards.py:nothing"), ["reward 'my_rewards.py:nothing':", "has no nothing"]),
    (("--reward", "my_rewards:not_callable"), ["my_rewards.not_callable is a int, not a function"]),
    (("--reward", "no_such_module:f"), ["reward 'no_such_module:f': cannot load no_such_module"]),
    (("--reward", "my_rewards:has_x", "--reward-weights", "1,2"), ["--reward-weights gives 2 weights for 1"]),
    (("--reward", "my_rewards:has_x", "--batch-size", "3"), ["--batch-size 3 must be a multiple of "
                                                             "--num-generations 2"]),
    (("--reward", "my_rewards:has_x", "--temperature", "0"), ["--temperature: expected > 0"]),
])
def test_bad_options_are_one_line(tiny, work, args, mentions):
    assert_one_line_error(grpo(tiny, work, *args), *mentions)


def test_a_bad_prompt_file_names_its_line(tiny, work):
    (work / "prompts.jsonl").write_text('{"prompt": "a"}\n{"question": "b"}\n')
    assert_one_line_error(grpo(tiny, work, "--reward", "my_rewards:has_x"), "prompts.jsonl:2: 'prompt' must be")

"""GRPO's rewards: calling the user's reward functions, group-normalised advantages, reward metrics.

A reward function is called as TRL's `GRPOTrainer` calls it::

    func(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> list[float | None]

with one entry per completion: ``prompts`` (each completion's prompt, as in the dataset: a string
or a list of messages), ``completions`` (the decoded text, or ``[{"role": "assistant", "content":
text}]`` for conversational prompts), ``completion_ids`` (the token ids), every other dataset
column as a keyword (one value per completion), and ``trainer_state`` (``.global_step``,
``.max_steps``) and ``log_metric(name, value)``.

Failures: a function that raises is called again on each completion alone, so only the
completions it fails on lose their reward; a ``None`` (TRL's "no reward for this one"), a value
that is not a finite number, or a raise on a lone completion gives NaN for that completion, and
is counted (`RewardScores.failures`). A completion every function fails on is *unscorable*: it
is left out of its group's mean and standard deviation and gets advantage 0 (as TRL does).

Advantages (`advantages`, TRL's ``multi_objective_aggregation="sum_then_normalize"``): the
weighted sum of the functions' rewards (a NaN counting 0 unless every function failed), minus
its group's mean, divided by the group's (``scale_rewards="group"``, TRL's default) or the
batch's (``"batch"``) standard deviation (Bessel-corrected) plus 1e-4, or not divided
(``"none"``, Dr. GRPO). Rows are laid out group by group: ``num_generations`` consecutive rows
share a prompt.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SCALE_REWARDS = ("group", "batch", "none")


class RewardSpecError(ValueError):
    """A ``module:function`` reward specification that does not name a callable."""


def reward_name(func) -> str:
    """The name TRL logs a reward function under (``rewards/<name>/mean``): its ``__name__``
    (through `functools.partial`), else its class name."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def load_reward(spec: str, base: str | Path | None = None):
    """The callable a ``module:function`` or ``path/to/file.py:function`` spec names.

    A module is imported from ``base`` (default: the current folder) first, then from
    ``sys.path``; a file path (ending in ``.py``) is loaded as a module. Raises `RewardSpecError`
    (one line naming the spec) when the spec is malformed, the module or file cannot be loaded, or
    the name is missing or not callable.
    """
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardSpecError(f"reward {spec!r}: expected module:function or path/to/file.py:function")
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise RewardSpecError(f"reward {spec!r}: expected module:function or path/to/file.py:function")
    base = Path(base) if base is not None else Path.cwd()
    try:
        if where.endswith(".py") or "/" in where or "\\" in where:
            path = Path(where)
            path = path if path.is_absolute() else base / path
            if not path.is_file():
                raise RewardSpecError(f"reward {spec!r}: no such file {path}")
            module_name = f"_metalnn_reward_{abs(hash(str(path.resolve())))}"
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
        else:
            added = str(base) not in sys.path
            if added:
                sys.path.insert(0, str(base))
            try:
                module = importlib.import_module(where)
            finally:
                if added:
                    sys.path.remove(str(base))
    except RewardSpecError:
        raise
    except Exception as e:  # the module's own import error, a syntax error, ...
        raise RewardSpecError(f"reward {spec!r}: cannot load {where}: {type(e).__name__}: {e}") from None
    func = getattr(module, name, None)
    if func is None:
        raise RewardSpecError(f"reward {spec!r}: {where} has no {name}")
    if not callable(func):
        raise RewardSpecError(f"reward {spec!r}: {where}.{name} is a {type(func).__name__}, not a function")
    return func


@dataclass
class RewardScores:
    """What the reward functions gave one batch of completions.

    Attributes:
        names: each function's name (`reward_name`).
        values: ``[N, F]`` float32 rewards, NaN where a function gave none.
        failures: ``{name: count}`` of completions each function gave no reward (None, not a
            finite number, or it raised on that completion).
        errors: ``{name: message}`` of the last exception each function raised (for the log).
    """

    names: list
    values: np.ndarray
    failures: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)

    @property
    def unscorable(self) -> np.ndarray:
        """``[N]`` bool: completions every function failed on."""
        return np.isnan(self.values).all(axis=1)


def _as_reward(value):
    """A reward as a float, or None when it is none (None, not a real number, not finite)."""
    if value is None or isinstance(value, bool):
        return None if value is None else float(value)
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _call(func, prompts, completions, completion_ids, columns, extra):
    out = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **extra)
    out = list(out)
    if len(out) != len(prompts):
        raise ValueError(f"returned {len(out)} rewards for {len(prompts)} completions (one per completion is "
                         "expected)")
    return out


def score(funcs, prompts, completions, completion_ids, columns: dict | None = None, extra: dict | None = None
          ) -> RewardScores:
    """Call every reward function on the batch (see the module docstring).

    Args:
        funcs: the reward functions.
        prompts, completions, completion_ids: one entry per completion.
        columns: ``{column: [value per completion]}``, passed as keywords.
        extra: more keywords for every call (``trainer_state``, ``log_metric``).
    """
    columns, extra = dict(columns or {}), dict(extra or {})
    n = len(prompts)
    names = [reward_name(f) for f in funcs]
    values = np.full((n, len(funcs)), np.nan, np.float32)
    failures, errors = {}, {}
    for j, (func, name) in enumerate(zip(funcs, names)):
        try:
            raw = _call(func, prompts, completions, completion_ids, columns, extra)
        except Exception as e:  # noqa: BLE001 (a user's function: find the completions it fails on)
            errors[name] = f"{type(e).__name__}: {e}"
            raw = []
            for i in range(n):
                one = {k: [v[i]] for k, v in columns.items()}
                try:
                    raw.append(_call(func, [prompts[i]], [completions[i]], [completion_ids[i]], one, extra)[0])
                except Exception as e1:  # noqa: BLE001
                    errors[name] = f"{type(e1).__name__}: {e1}"
                    raw.append(None)
        got = [_as_reward(r) for r in raw]
        failures[name] = sum(1 for r in got if r is None)
        values[:, j] = [np.nan if r is None else r for r in got]
    return RewardScores(names, values, failures, errors)


def _nanstd(x, axis=None):
    """Bessel-corrected standard deviation ignoring NaNs (NaN with fewer than 2 values), as TRL's
    ``nanstd``."""
    x = np.asarray(x, np.float32)
    valid = ~np.isnan(x)
    count = valid.sum(axis=axis, keepdims=True)
    mean = np.where(valid, x, 0).sum(axis=axis, keepdims=True) / np.maximum(count, 1)
    var = np.where(valid, (x - mean) ** 2, 0).sum(axis=axis, keepdims=True) / np.maximum(count - 1, 1)
    std = np.where(count > 1, np.sqrt(var), np.nan).astype(np.float32)
    return std.squeeze(axis) if axis is not None else std.reshape(())


def _nanmean(x, axis=None):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN group: NaN, as torch.nanmean
        return np.nanmean(x, axis=axis)


def weighted_rewards(scores: RewardScores, weights=None) -> np.ndarray:
    """``[N]`` the weighted sum of each completion's rewards (a missing reward counts 0; NaN for
    an unscorable completion)."""
    weights = np.ones(len(scores.names), np.float32) if weights is None else np.asarray(weights, np.float32)
    if weights.shape != (len(scores.names),):
        raise ValueError(f"reward_weights: expected {len(scores.names)} weights (one per reward function), got "
                         f"{weights.size}")
    total = np.nansum(scores.values * weights[None], axis=1).astype(np.float32)
    total[scores.unscorable] = np.nan
    return total


def advantages(scores: RewardScores, num_generations: int, weights=None, scale_rewards: str = "group"):
    """``(advantages [N], is_std_zero [N])`` as TRL computes them (module docstring)."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards: expected one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    rewards = weighted_rewards(scores, weights)
    n = rewards.shape[0]
    if n % num_generations:
        raise ValueError(f"advantages: {n} completions do not split into groups of num_generations "
                         f"{num_generations}")
    grouped = rewards.reshape(-1, num_generations)
    mean = np.repeat(_nanmean(grouped, axis=1), num_generations).astype(np.float32)
    if scale_rewards == "batch":
        std = np.full(n, _nanstd(rewards) if n > 1 else 0.0, np.float32)
    elif num_generations > 1:
        std = np.repeat(_nanstd(grouped, axis=1), num_generations).astype(np.float32)
    else:
        std = np.zeros(n, np.float32)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + np.float32(1e-4))
    is_std_zero = np.isclose(std, 0.0, rtol=1.3e-6, atol=1e-5)  # torch.isclose's float32 defaults
    return np.nan_to_num(adv.astype(np.float32), nan=0.0), is_std_zero


def reward_metrics(scores: RewardScores, weights=None, is_std_zero=None) -> dict:
    """TRL's reward metrics: ``reward``, ``reward_std``, ``rewards/<name>/mean``, ``rewards/<name>/std``,
    ``frac_reward_zero_std``; and the failures: ``rewards/<name>/failures`` (completions without a
    reward from that function) and ``reward_failures`` (their sum)."""
    out = {}
    for j, name in enumerate(scores.names):
        out[f"rewards/{name}/mean"] = float(_nanmean(scores.values[:, j]))
        out[f"rewards/{name}/std"] = float(_nanstd(scores.values[:, j]))
    total = weighted_rewards(scores, weights)
    out["reward"] = float(_nanmean(total))
    out["reward_std"] = float(_nanstd(total))
    if is_std_zero is not None:
        out["frac_reward_zero_std"] = float(np.mean(is_std_zero))
    for name in scores.names:
        out[f"rewards/{name}/failures"] = float(scores.failures.get(name, 0))
    out["reward_failures"] = float(sum(scores.failures.values()))
    return out

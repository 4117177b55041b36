"""GRPO (group relative policy optimisation) with verifiable rewards, computed as TRL's ``GRPOTrainer``.

Each step takes ``batch_size / num_generations`` prompts, samples ``num_generations`` completions
of each (one batch of sequences decoded together, `metalnn.llm.batching.BatchGenerator`, each row
its own seeded `metalnn.llm.sampling.Sampler`), scores them with the reward functions
(`metalnn.llm.tuner.rewards`), turns the rewards into group-normalised advantages and takes one
optimizer step on the clipped-ratio policy loss (`grpo_loss`). Generation is outside the gradient.

Data: ``{"prompt": ...}`` records (`load_prompts`), standard (a string, tokenised as is) or
conversational (a list of ``{"role", "content"}`` messages, rendered with the chat template and its
generation prompt); every other field is passed to the reward functions as a keyword, one value per
completion.

Completions (as TRL): a completion ends with the first end-of-sequence token (kept, and in the
loss) or after ``max_completion_length`` tokens (truncated; with ``mask_truncated_completions``
it is left out of the loss). Standard prompts give the reward functions the decoded text;
conversational ones ``[{"role": "assistant", "content": text}]``.

The loss of completion tokens ``t`` with mask ``m`` (TRL's ``_compute_loss``)::

    logp      = log_softmax(logits / temperature)[token]         (the policy, with gradient)
    ratio     = exp(logp - old_logp)                             (old_logp: the sampling policy's,
                                                                  = logp detached for num_iterations 1)
    per_token = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)
                + beta * (exp(ref - logp) - (ref - logp) - 1)    (k3 KL to the reference; beta 0: none;
                                                                  times ratio with use_bias_correction_kl)

reduced by ``loss_type``: ``grpo`` the mean over completions of each one's token mean; ``bnpo`` the
token mean of the batch; ``dr_grpo`` the token sum over ``batch * max_completion_length``; ``dapo``
(TRL's default) the token sum over the batch's completion tokens (with one generation batch per
step, as here, the same as ``bnpo``).

The reference model: ``ref_model`` when given, else the model with its LoRA adapters switched off
(`metalnn.llm.tuner.lora.adapters_disabled`: no second copy of the weights). With ``beta`` 0 no
reference pass runs at all.

Metrics (TRL's names, one dict per step): ``loss``, ``grad_norm``, ``learning_rate``,
``num_tokens``, ``completions/mean_length`` (``min``, ``max``, ``clipped_ratio``,
``mean_terminated_length``, ``min_terminated_length``, ``max_terminated_length``), ``reward``,
``reward_std``, ``rewards/<func>/mean``, ``rewards/<func>/std``, ``frac_reward_zero_std``, ``kl``
(beta > 0), ``entropy``, ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
``clip_ratio/region_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_max``, ``step_time``; and
``rewards/<func>/failures`` and ``reward_failures`` (completions a reward function gave nothing).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..batching import BatchGenerator
from ..sampling import Sampler, SamplingParams, sample_batch
from . import lora, rewards as rw
from .datasets import DatasetError

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO's settings, with TRL's ``GRPOConfig`` names and defaults.

    Attributes:
        num_generations: completions sampled per prompt (a group; at least 2).
        max_completion_length: the most tokens of a completion.
        temperature, top_p, top_k, min_p: sampling (``top_p`` 1 / ``top_k`` 0 / ``min_p`` None: off);
            the loss divides the logits by ``temperature`` too, as TRL does.
        beta: weight of the KL term to the reference model (0: no reference pass).
        epsilon, epsilon_high: the ratio is clipped to ``[1 - epsilon, 1 + epsilon_high]``
            (``epsilon_high`` None: ``epsilon``).
        loss_type: ``dapo`` (TRL's default), ``grpo``, ``bnpo`` or ``dr_grpo`` (module docstring).
        scale_rewards: ``group`` (default), ``batch`` or ``none`` (`metalnn.llm.tuner.rewards`).
        reward_weights: one weight per reward function (None: all 1).
        mask_truncated_completions: leave completions that hit ``max_completion_length`` out of the loss.
        num_iterations: optimizer steps per batch of completions (TRL's mu; above 1 the sampling
            policy's log-probabilities are kept for the ratio).
        use_bias_correction_kl: multiply the KL term by the ratio (TRL's default): its value is
            unchanged on-policy, but its gradient becomes the unbiased reverse-KL gradient.
    """

    num_generations: int = 8
    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    reward_weights: tuple | None = None
    mask_truncated_completions: bool = False
    num_iterations: int = 1
    use_bias_correction_kl: bool = True

    def __post_init__(self):
        if self.num_generations < 2:
            raise ValueError(f"GRPOConfig.num_generations: GRPO needs at least 2 completions per prompt, got "
                             f"{self.num_generations}")
        if self.max_completion_length < 1:
            raise ValueError(f"GRPOConfig.max_completion_length: expected >= 1, got {self.max_completion_length}")
        if not self.temperature > 0:
            raise ValueError(f"GRPOConfig.temperature: expected > 0 (GRPO samples), got {self.temperature}")
        if not (self.beta >= 0 and np.isfinite(self.beta)):
            raise ValueError(f"GRPOConfig.beta: expected a number >= 0, got {self.beta}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"GRPOConfig.loss_type: expected one of {', '.join(LOSS_TYPES)}, got "
                             f"{self.loss_type!r}")
        if self.scale_rewards not in rw.SCALE_REWARDS:
            raise ValueError(f"GRPOConfig.scale_rewards: expected one of {', '.join(rw.SCALE_REWARDS)}, got "
                             f"{self.scale_rewards!r}")
        if self.num_iterations < 1:
            raise ValueError(f"GRPOConfig.num_iterations: expected >= 1, got {self.num_iterations}")

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def upper_epsilon(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def sampling(self, seed: int | None = None) -> SamplingParams:
        """The `SamplingParams` of the rollouts (one seed per row)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p if self.top_p < 1 else None,
                              top_k=self.top_k if self.top_k > 0 else None, min_p=self.min_p or None, seed=seed)


# -- data ---------------------------------------------------------------------------------------

def is_conversational(prompt) -> bool:
    """Whether a prompt is a list of messages (rendered with the chat template)."""
    return isinstance(prompt, list)


def _check_record(record, where):
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise DatasetError(f"{where}: 'prompt' is empty")
        return record
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return record
    raise DatasetError(f"{where}: 'prompt' must be a string or a non-empty list of {{role, content}} messages, got "
                       f"{prompt!r}"[:300])


def load_prompts(path) -> list:
    """The records of a ``.jsonl`` prompt file (``{"prompt": ..., <more fields>}`` per line).
    Raises `DatasetError` naming the file and line of a malformed record."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such prompt file")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            records.append(_check_record(record, where))
    if not records:
        raise DatasetError(f"{path}: no prompts (the file is empty)")
    return records


def prompt_ids(tokenizer, prompt) -> list:
    """A prompt's token ids as TRL makes them: a conversation through the chat template with its
    generation prompt, a string encoded with the tokenizer's special tokens."""
    if is_conversational(prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise DatasetError("a conversational prompt needs a tokenizer with a chat template")
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True))
    return list(tokenizer.encode(prompt))


# -- a batch of completions ---------------------------------------------------------------------

def cut_at_eos(ids, eos) -> tuple:
    """``(completion, truncated)``: ``ids`` up to and including the first id in ``eos``; truncated
    when none is there."""
    for i, t in enumerate(ids):
        if int(t) in eos:
            return [int(x) for x in ids[:i + 1]], False
    return [int(x) for x in ids], True


@dataclass
class Completions:
    """Prompts and their completions as padded arrays for the loss.

    Attributes:
        tokens: ``[B, L]`` int32, each row its prompt then its completion, padded on the right
            (causal attention: the padding changes nothing before it).
        positions: ``[B, C]`` int32, the position whose logits predict each completion token.
        completion: ``[B, C]`` int32 completion tokens (padding 0).
        mask: ``[B, C]`` float32, 1 on the completion tokens the loss covers.
    """

    tokens: mx.array
    positions: mx.array
    completion: mx.array
    mask: mx.array

    @classmethod
    def build(cls, prompts, completions, keep=None, pad_id: int = 0) -> "Completions":
        """From lists of prompt and completion ids (``keep``: per row, whether the loss covers it)."""
        if len(prompts) != len(completions):
            raise ValueError(f"Completions: {len(prompts)} prompts for {len(completions)} completions")
        rows = len(prompts)
        width = max(1, max(len(c) for c in completions))
        length = max(len(p) + len(c) for p, c in zip(prompts, completions))
        tokens = np.full((rows, length), pad_id, np.int32)
        positions = np.zeros((rows, width), np.int32)
        completion = np.zeros((rows, width), np.int32)
        mask = np.zeros((rows, width), np.float32)
        for r, (p, c) in enumerate(zip(prompts, completions)):
            if not p:
                raise ValueError(f"Completions: prompt {r} is empty (at least one token is needed)")
            tokens[r, :len(p) + len(c)] = list(p) + list(c)
            positions[r] = np.minimum(len(p) - 1 + np.arange(width), length - 1)
            completion[r, :len(c)] = c
            if keep is None or keep[r]:
                mask[r, :len(c)] = 1.0
        return cls(mx.array(tokens), mx.array(positions), mx.array(completion), mx.array(mask))


def per_token_logps(model, batch: Completions, temperature: float = 1.0, device=None, entropy: bool = False):
    """``log p(completion token)`` ``[B, C]`` float32 under ``model`` with the logits divided by
    ``temperature`` (and, with ``entropy``, each position's entropy ``[B, C]``, without gradient)."""
    logits = model(batch.tokens, device=device)
    picked = mx.take_along_axis(logits, batch.positions[:, :, None], axis=1).astype(mx.float32) / temperature
    lse = mx.logsumexp(picked, axis=-1)
    logps = mx.take_along_axis(picked, batch.completion[:, :, None], axis=-1)[..., 0] - lse
    if not entropy:
        return logps
    x = mx.stop_gradient(picked)
    ent = mx.stop_gradient(lse) - (mx.softmax(x, axis=-1) * x).sum(axis=-1)
    return logps, ent


def _masked_mean(x, mask):
    return (x * mask).sum() / mx.maximum(mask.sum(), 1.0)


def _row_means(x, mask):
    """Each row's mean over its mask (NaN for a row without tokens), as TRL's ``masked_seq_mean``."""
    return (x * mask).sum(-1) / mask.sum(-1)


def grpo_loss(model, batch: Completions, advantages, config: GRPOConfig, *, old_logps=None, ref_logps=None,
              num_items=None, device=None):
    """``(loss, metrics)``: TRL's GRPO loss of ``batch`` (module docstring) and its step metrics
    (``kl``, ``entropy``, ``clip_ratio/*``; lazy arrays).

    Args:
        advantages: ``[B]`` float32.
        old_logps: ``[B, C]`` the sampling policy's log-probabilities (None: the current ones detached).
        ref_logps: ``[B, C]`` the reference model's (needed when ``config.beta`` > 0).
        num_items: the completion tokens of the whole generation batch (``dapo``; default: this batch's).
    """
    logps, entropies = per_token_logps(model, batch, config.temperature, device, entropy=True)
    mask = batch.mask
    adv = mx.array(advantages, dtype=mx.float32)[:, None]
    old = mx.stop_gradient(logps) if old_logps is None else old_logps
    coef_1 = mx.exp(logps - old)
    coef_2 = mx.clip(coef_1, 1 - config.epsilon_low, 1 + config.upper_epsilon)
    per_token = -mx.minimum(coef_1 * adv, coef_2 * adv)
    metrics = {}
    if config.beta != 0.0:
        if ref_logps is None:
            raise ValueError("grpo_loss: beta > 0 needs ref_logps (the reference model's log-probabilities)")
        d = ref_logps - logps
        per_token_kl = mx.exp(d) - d - 1
        if config.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
        per_token = per_token + config.beta * per_token_kl
        metrics["kl"] = mx.stop_gradient(_masked_mean(per_token_kl, mask))
    if config.loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mx.maximum(mask.sum(-1), 1.0)).mean()
    elif config.loss_type == "bnpo":
        loss = (per_token * mask).sum() / mx.maximum(mask.sum(), 1.0)
    elif config.loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.shape[0] * config.max_completion_length)
    else:  # dapo
        count = mask.sum() if num_items is None else mx.array(num_items, dtype=mx.float32)
        loss = (per_token * mask).sum() / mx.maximum(count, 1.0)
    metrics["entropy"] = _masked_mean(entropies, mask)
    coef = mx.stop_gradient(coef_1)
    low = ((coef < 1 - config.epsilon_low) & (adv < 0)).astype(mx.float32)
    high = ((coef > 1 + config.upper_epsilon) & (adv > 0)).astype(mx.float32)
    region = mx.maximum(low, high)
    metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
    metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
    metrics["clip_ratio/region_mean"] = _masked_mean(region, mask)
    metrics["clip_ratio/low_row_means"] = _row_means(low, mask)
    metrics["clip_ratio/high_row_means"] = _row_means(high, mask)
    return loss, metrics


def finish_metrics(metrics: dict) -> dict:
    """`grpo_loss`'s metrics as floats, the per-row clip ratios reduced as TRL logs them
    (``clip_ratio/low_min``: the least row mean, ``clip_ratio/high_max``: the largest; NaN rows left out)."""
    out = {}
    for k, v in metrics.items():
        a = np.array(v, dtype=np.float64)
        if k == "clip_ratio/low_row_means":
            out["clip_ratio/low_min"] = float(np.nanmin(a)) if np.isfinite(a).any() else float("nan")
        elif k == "clip_ratio/high_row_means":
            out["clip_ratio/high_max"] = float(np.nanmax(a)) if np.isfinite(a).any() else float("nan")
        else:
            out[k] = float(a)
    return out


# -- rollouts -----------------------------------------------------------------------------------

@dataclass
class Rollout:
    """One generation batch: ``num_generations`` consecutive rows per prompt.

    Attributes:
        records: each row's dataset record.
        prompt_ids, completion_ids: token ids per row (completions cut after the first EOS).
        truncated: per row, whether the completion hit ``max_completion_length`` without an EOS.
        completions: what the reward functions see (text, or assistant messages).
    """

    records: list
    prompt_ids: list
    completion_ids: list
    truncated: list
    completions: list
    batch: Completions | None = None
    scores: rw.RewardScores | None = None
    advantages: np.ndarray | None = None
    is_std_zero: np.ndarray | None = None
    old_logps: mx.array | None = None
    ref_logps: mx.array | None = None
    uses: int = 0


def sample_completions(model, prompts, config: GRPOConfig, eos, seed: int = 0, device=None,
                       prefill_chunk: int = 512) -> list:
    """Sampled completion ids (``max_completion_length`` at most, cut after the first id in ``eos``)
    of each prompt in ``prompts`` (lists of ids), decoded together; row ``i`` samples with seed
    ``seed + i``."""
    gen = BatchGenerator(model, sample=lambda seqs, logits: [c.token for c in sample_batch(
        [s.state for s in seqs], logits)], prefill_chunk=prefill_chunk, max_batch=max(1, len(prompts)),
        device=device)
    seqs = [gen.add(p, config.max_completion_length, eos=eos,
                    state=Sampler(config.sampling((seed + i) % 2**63))) for i, p in enumerate(prompts)]
    was = model.training
    model.eval()
    try:
        while gen:
            gen.step()
    finally:
        model.train(was)
    return [list(s.tokens) for s in seqs]


def _eos_ids(tokenizer, model) -> frozenset:
    ids = set(getattr(tokenizer, "eos_token_ids", None) or ())
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    return frozenset(ids or getattr(model, "eos_token_ids", ()) or ())


class GRPOTrainer:
    """Train ``model`` with GRPO on prompt records (module docstring).

    Args:
        model: a `metalnn.llm.models.CausalLM` whose trainable parameters train (LoRA adapters after
            `metalnn.llm.tuner.lora.apply`, or every weight after ``model.unfreeze()``).
        tokenizer: its `metalnn.llm.tokenizer.Tokenizer`.
        reward_funcs: a reward function or a list of them (`metalnn.llm.tuner.rewards`).
        train_data: prompt records (`load_prompts`).
        config: a `GRPOConfig`.
        optimizer: an ``mlx.optimizers`` optimizer (default: AdamW at TRL's 1e-6, no weight decay).
        ref_model: the reference model for ``beta`` > 0 (default: ``model`` with its adapters off;
            a model without adapters needs one).
        batch_size: completions per step (TRL's ``per_device_train_batch_size``), a multiple of
            ``num_generations``: ``batch_size / num_generations`` prompts per step.
        max_grad_norm: clip the global gradient norm (None or 0: no clipping).
        seed: the prompt order and the sampling seeds derive from it.
        device: the `metalnn.Device`.
        steps: the run's length (reward functions see it as ``trainer_state.max_steps``).
        max_prompt_length: longer prompts keep their last ``max_prompt_length`` tokens (None: whole).
    """

    def __init__(self, model, tokenizer, reward_funcs, train_data, config: GRPOConfig | None = None, *,
                 optimizer=None, ref_model=None, batch_size: int = 8, max_grad_norm: float | None = 1.0,
                 seed: int = 0, device=None, steps: int | None = None, max_prompt_length: int | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not self.reward_funcs:
            raise ValueError("GRPOTrainer: give at least one reward function")
        self.config = config or GRPOConfig()
        if self.config.reward_weights is not None and len(self.config.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"GRPOTrainer: reward_weights has {len(self.config.reward_weights)} weights for "
                             f"{len(self.reward_funcs)} reward functions")
        self.records = list(train_data)
        if not self.records:
            raise ValueError("GRPOTrainer: no training prompts")
        if batch_size % self.config.num_generations:
            raise ValueError(f"GRPOTrainer: batch_size {batch_size} must be a multiple of num_generations "
                             f"{self.config.num_generations} (each step takes whole groups)")
        self.batch_size, self.prompts_per_step = batch_size, batch_size // self.config.num_generations
        if self.config.beta != 0.0 and ref_model is None and not lora.adapters(model):
            raise ValueError("GRPOTrainer: beta > 0 needs a reference model: give ref_model, or train LoRA "
                             "adapters (the reference is then the model with its adapters off)")
        self.ref_model = ref_model
        self.optimizer = optimizer or optim.AdamW(learning_rate=1e-6, eps=1e-8, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm or None
        self.seed, self.device, self.max_steps = int(seed), device, steps
        self.max_prompt_length = max_prompt_length
        self.eos = _eos_ids(tokenizer, model)
        self.pad_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
        self.step_count = 0
        self.num_tokens = 0
        self.history: list = []
        self._rollout: Rollout | None = None
        self._user_metrics: dict = {}
        self.reward_errors: dict = {}  # {function name: the last exception's message}
        self._loss_and_grad = nn.value_and_grad(model, self._loss)

    # -- rollouts ----------------------------------------------------------------------------
    def _prompt_batch(self, index: int) -> list:
        """The records of generation batch ``index``: the prompts in an order drawn from
        ``(seed, epoch)``, ``prompts_per_step`` at a time (wrapping into the next epoch)."""
        out, n = [], len(self.records)
        for k in range(index * self.prompts_per_step, (index + 1) * self.prompts_per_step):
            epoch, i = divmod(k, n)
            out.append(self.records[np.random.default_rng([self.seed, epoch]).permutation(n)[i]])
        return out

    def decode(self, record, ids):
        """What the reward functions see of a completion (module docstring)."""
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return [{"role": "assistant", "content": text}] if is_conversational(record["prompt"]) else text

    def rollout(self, records, seed: int = 0, num_generations: int | None = None, score: bool = True) -> Rollout:
        """Sample ``num_generations`` completions of each record's prompt (default: the config's)
        and, with ``score``, score them (`score`)."""
        g = num_generations or self.config.num_generations
        rows = [r for r in records for _ in range(g)]
        prompts = [prompt_ids(self.tokenizer, r["prompt"]) for r in records]
        if self.max_prompt_length:
            prompts = [p[-self.max_prompt_length:] for p in prompts]
        row_prompts = [p for p in prompts for _ in range(g)]
        sampled = sample_completions(self.model, row_prompts, self.config, self.eos, seed=seed, device=self.device)
        cut = [cut_at_eos(ids, self.eos) for ids in sampled]
        completion_ids = [c for c, _ in cut]
        truncated = [t for _, t in cut]
        completions = [self.decode(r, c) for r, c in zip(rows, completion_ids)]
        ro = Rollout(rows, row_prompts, completion_ids, truncated, completions)
        return self.score(ro) if score else ro

    def score(self, ro: Rollout) -> Rollout:
        """Rewards, advantages and the arrays of the loss (and reference / old log-probabilities)."""
        cfg = self.config
        ro.scores = self.rewards(ro)
        ro.advantages, ro.is_std_zero = rw.advantages(ro.scores, cfg.num_generations, cfg.reward_weights,
                                                      cfg.scale_rewards)
        keep = [not t for t in ro.truncated] if cfg.mask_truncated_completions else None
        ro.batch = Completions.build(ro.prompt_ids, ro.completion_ids, keep, self.pad_id)
        was = self.model.training
        self.model.eval()
        try:
            if cfg.num_iterations > 1:
                ro.old_logps = mx.stop_gradient(per_token_logps(self.model, ro.batch, cfg.temperature, self.device))
                mx.eval(ro.old_logps)
            if cfg.beta != 0.0:
                ro.ref_logps = self.reference_logps(ro.batch)
        finally:
            self.model.train(was)
        return ro

    def rewards(self, ro: Rollout) -> rw.RewardScores:
        """The reward functions' scores of a rollout's completions (each other column of the
        records passed as a keyword, as TRL passes them)."""
        skip = ("prompt", "completion", "completion_ids")
        columns = {k: [r.get(k) for r in ro.records] for k in ro.records[0] if k not in skip}
        state = SimpleNamespace(global_step=self.step_count, max_steps=self.max_steps)
        extra = {"trainer_state": state, "log_metric": self._log_metric}
        scores = rw.score(self.reward_funcs, [r["prompt"] for r in ro.records], ro.completions, ro.completion_ids,
                          columns, extra)
        self.reward_errors.update(scores.errors)
        return scores

    def reference_logps(self, batch: Completions):
        """The reference model's per-token log-probabilities of ``batch`` (no gradient)."""
        if self.ref_model is not None:
            out = per_token_logps(self.ref_model, batch, self.config.temperature, self.device)
        else:
            with lora.adapters_disabled(self.model):
                out = per_token_logps(self.model, batch, self.config.temperature, self.device)
        out = mx.stop_gradient(out)
        mx.eval(out)
        return out

    def _log_metric(self, name, value):
        self._user_metrics.setdefault(str(name), []).append(float(value))

    # -- the step ----------------------------------------------------------------------------
    def _loss(self):
        ro = self._rollout
        return grpo_loss(self.model, ro.batch, ro.advantages, self.config, old_logps=ro.old_logps,
                         ref_logps=ro.ref_logps, device=self.device)

    def step(self) -> dict:
        """One optimizer step (sampling a new generation batch every ``num_iterations`` steps);
        returns its metrics (TRL's names)."""
        start = time.perf_counter()
        self._user_metrics = {}
        cfg = self.config
        new = self._rollout is None or self._rollout.uses >= cfg.num_iterations
        if new:
            index = self.step_count // cfg.num_iterations
            seed = (self.seed * 1_000_003 + index * self.batch_size) % 2**62
            self._rollout = self.rollout(self._prompt_batch(index), seed=seed)
        ro = self._rollout
        ro.uses += 1
        self.model.train()
        (loss, metrics), grads = self._loss_and_grad()
        if self.max_grad_norm:
            grads, grad_norm = optim.clip_grad_norm(grads, self.max_grad_norm)
        else:
            grad_norm = optim.clip_grad_norm(grads, float("inf"))[1]
        self.optimizer.update(self.model, grads)
        mx.eval(loss, metrics, grad_norm, self.model.parameters(), self.optimizer.state)
        lr = self.optimizer.learning_rate  # (after the update: the rate it used)
        lr = float(lr.item() if isinstance(lr, mx.array) else lr)
        self.step_count += 1
        out = {"loss": float(loss.item()), "grad_norm": float(grad_norm.item()), "learning_rate": lr}
        out.update(self.rollout_metrics(ro, counted=new))
        out.update(finish_metrics(metrics))
        for name, values in sorted(self._user_metrics.items()):
            out[name] = float(np.mean(values))
        out["step_time"] = time.perf_counter() - start
        self.history.append(out)
        return out

    def rollout_metrics(self, ro: Rollout, counted: bool = True) -> dict:
        """TRL's completion and reward metrics of a generation batch."""
        lengths = np.array([len(c) for c in ro.completion_ids], np.float64)
        if counted:
            self.num_tokens += int(sum(len(p) for p in ro.prompt_ids) + lengths.sum())
        truncated = np.array(ro.truncated, bool)
        term = lengths[~truncated] if (~truncated).any() else np.zeros(1)
        out = {"num_tokens": float(self.num_tokens),
               "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
               "completions/max_length": float(lengths.max()),
               "completions/clipped_ratio": float(truncated.mean()),
               "completions/mean_terminated_length": float(term.mean()),
               "completions/min_terminated_length": float(term.min()),
               "completions/max_terminated_length": float(term.max())}
        out.update(rw.reward_metrics(ro.scores, self.config.reward_weights, ro.is_std_zero))
        return out

    def train(self, steps: int, callback=None) -> list:
        """Run ``steps`` steps; ``callback(step, metrics)`` after each. Returns the metrics."""
        out = []
        for _ in range(int(steps)):
            m = self.step()
            out.append(m)
            if callback is not None:
                callback(self.step_count, m)
        return out

    # -- evaluation --------------------------------------------------------------------------
    def mean_reward(self, records, num_generations: int = 1, seed: int = 12345) -> float:
        """The mean weighted reward of ``num_generations`` sampled completions per record (at the
        training temperature; completions without a reward left out), without training."""
        ro = self.rollout(list(records), seed=seed, num_generations=num_generations, score=False)
        total = rw.weighted_rewards(self.rewards(ro), self.config.reward_weights)
        return float(np.nanmean(total))

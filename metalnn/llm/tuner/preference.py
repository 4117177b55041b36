"""Preference fine-tuning losses: DPO (``sigmoid``, ``ipo``, ``hinge``, ``robust``), ORPO and KTO, as TRL 1.13 computes them.

The losses work on batches of `metalnn.llm.tuner.preference_data` (sequence log-probabilities are
sums over the completion tokens' log-probabilities, the prompt and padding left out). Each
objective is a callable ``loss(model, batch, device) -> scalar`` for `metalnn.Trainer`, and keeps
the metrics TRL logs for the batch, under TRL's names, in ``loss.state`` (a dict of arrays the
Trainer evaluates together with the loss, in its compiled step); ``loss.metrics()`` gives them as
floats after the step:

* `DPOLoss`: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``
  (rewards are ``beta * (logp - ref_logp)``), ``logps/chosen``, ``logps/rejected``,
  ``logits/chosen``, ``logits/rejected`` (the logits' mean over the vocabulary, averaged over the
  completion tokens), ``entropy`` (of the next-token distribution over completion tokens),
  ``mean_token_accuracy`` (argmax = the chosen completion's token);
* `ORPOLoss` (no reference model; ``beta`` is the paper's lambda, TRL's name kept): ``nll_loss``
  (cross-entropy of the chosen rows over prompt and completion), ``log_odds_ratio``,
  ``log_odds_chosen``, ``rewards/*`` (``beta * `` the average completion log-probability),
  ``logps/*`` (average per token), ``logits/*`` (averaged over every position of the rows, as TRL,
  which also counts padded positions: the two agree on batches without padding);
* `KTOLoss`: ``kl`` (the batch's KL estimate from the mismatched pairs, clamped at 0, no gradient),
  ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``logps/*``, ``logits/*``,
  ``entropy``; as TRL, a metric of desirable (undesirable) examples is absent from a batch
  without any.

The reference model (`Reference`): with LoRA, the model itself with its adapters switched off (no
second copy of the weights); else a separate frozen model, or the model's own weights from before
training (a snapshot of the parameter arrays: MLX arrays are immutable, so the snapshot keeps the
initial values while the optimizer replaces the model's). `precompute_reference` computes the
reference log-probabilities of a whole dataset once (TRL's ``precompute_ref_log_probs``).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from . import lora

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
_LN2 = 0.6931471805599453


# -- building blocks ---------------------------------------------------------------------------
def log_sigmoid(x):
    """``log(sigmoid(x)) = -log(1 + e^-x)``, stable for large ``|x|``, with the gradient
    ``sigmoid(-x)`` everywhere (a ``min(x, 0) - log1p(e^-|x|)`` form has gradient 0 at ``x = 0``,
    where every DPO run starts)."""
    return -mx.logaddexp(mx.zeros_like(x), -x)


def log1mexp(x):
    """``log(1 - exp(x))`` for ``x < 0``, branching at ``-ln 2`` (as TRL's ORPO)."""
    return mx.where(x < -_LN2, mx.log1p(-mx.exp(x)), mx.log(-mx.expm1(x)))


def token_logps(logits, input_ids):
    """Log-probability of each next token: ``logits`` ``[B, T, V]``, ``input_ids`` ``[B, T]`` ->
    ``[B, T - 1]`` (position ``t`` scores ``input_ids[:, t + 1]``), in float32."""
    shift = logits[:, :-1].astype(mx.float32)
    picked = mx.take_along_axis(shift, input_ids[:, 1:, None].astype(mx.int32), axis=-1)[..., 0]
    return picked - mx.logsumexp(shift, axis=-1)


def completion_logps(logits, input_ids, completion_mask):
    """Per-row sums of the completion tokens' log-probabilities ``[B]`` (``completion_mask``
    ``[B, T]`` marks completion tokens; the first position is never scored)."""
    return (token_logps(logits, input_ids) * completion_mask[:, 1:]).sum(axis=1)


def _entropy(logits):
    """Entropy of ``softmax(logits)`` over the last axis, float32."""
    logits = logits.astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    p = mx.exp(logits - lse)
    return lse[..., 0] - (p * logits).sum(axis=-1)


def _masked_mean(values, mask):
    """``sum(values * mask) / sum(mask)``: NaN when the mask is empty (TRL then logs nothing)."""
    return (values * mask).sum() / mask.sum()


def dpo_losses(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta: float = 0.1,
               loss_type: str = "sigmoid", label_smoothing: float = 0.0, chosen_lengths=None, rejected_lengths=None):
    """Per-pair DPO losses ``[B]`` from sequence log-probabilities ``[B]`` (TRL 1.13's formulas).

    With ``d = (chosen - ref_chosen) - (rejected - ref_rejected)``:
    ``sigmoid``: ``-log sigmoid(beta d)``; ``hinge``: ``relu(1 - beta d)``; ``robust``:
    ``(-(1 - e) log sigmoid(beta d) + e log sigmoid(-beta d)) / (1 - 2 e)`` with ``e =
    label_smoothing``; ``ipo``: ``(dc / lc - dr / lr - 1 / (2 beta))^2`` with ``dc``, ``dr`` the
    chosen and rejected log-ratios and ``lc``, ``lr`` the completion lengths ``[B]`` (at least 1).
    TRL 1.13 uses ``label_smoothing`` only in ``robust``.
    """
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        return -log_sigmoid(beta * delta)
    if loss_type == "hinge":
        return mx.maximum(1.0 - beta * delta, 0.0)
    if loss_type == "robust":
        e = label_smoothing
        return (-(1.0 - e) * log_sigmoid(beta * delta) + e * log_sigmoid(-beta * delta)) / (1.0 - 2.0 * e)
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("dpo_losses: the 'ipo' loss needs chosen_lengths and rejected_lengths")
        d = chosen_ratio / mx.maximum(chosen_lengths, 1.0) - rejected_ratio / mx.maximum(rejected_lengths, 1.0)
        return (d - 1.0 / (2.0 * beta)) ** 2
    raise ValueError(f"dpo_losses: loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")


def orpo_log_odds(chosen_avg_logps, rejected_avg_logps):
    """ORPO's log odds ratio ``[B]`` of average per-token log-probabilities ``[B]``:
    ``(c - r) - (log(1 - e^c) - log(1 - e^r))``."""
    return (chosen_avg_logps - rejected_avg_logps) - (log1mexp(chosen_avg_logps) - log1mexp(rejected_avg_logps))


def kto_losses(logratios, labels, kl, *, beta: float = 0.1, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0):
    """Per-example KTO losses ``[B]``: ``w_d (1 - sigmoid(beta (r - kl)))`` for desirable
    examples (``labels`` 1), ``w_u (1 - sigmoid(beta (kl - r)))`` for undesirable ones, with
    ``r = logp - ref_logp`` ``[B]`` and ``kl`` the batch's KL estimate (a scalar)."""
    chosen = desirable_weight * (1.0 - mx.sigmoid(beta * (logratios - kl)))
    rejected = undesirable_weight * (1.0 - mx.sigmoid(beta * (kl - logratios)))
    return mx.where(labels > 0.5, chosen, rejected)


# -- the reference model -----------------------------------------------------------------------
@contextmanager
def weights_swapped(model, weights):
    """Run the block with ``weights`` (a parameter tree of ``model``) in place of its own."""
    current = model.parameters()
    model.update(weights)
    try:
        yield model
    finally:
        model.update(current)


class Reference:
    """Where reference log-probabilities come from (see the module docstring); `for_model` chooses.

    Args:
        kind: ``"adapters_off"``, ``"model"`` (``model`` is the frozen reference) or
            ``"initial_weights"`` (``weights`` is the snapshot).
    """

    def __init__(self, kind: str, model=None, weights=None):
        if kind not in ("adapters_off", "model", "initial_weights"):
            raise ValueError(f"Reference: kind must be adapters_off, model or initial_weights, got {kind!r}")
        self.kind, self.model, self.weights = kind, model, weights

    @classmethod
    def for_model(cls, model, ref_model=None) -> "Reference":
        """``ref_model`` when given (frozen here); else the adapters switched off when ``model`` has
        LoRA adapters; else a snapshot of ``model``'s weights now (call it before training)."""
        if ref_model is not None:
            ref_model.freeze()
            ref_model.eval()
            return cls("model", model=ref_model)
        if lora.adapters(model):
            return cls("adapters_off")
        # copies (new arrays, not the model's own objects: a compiled step tells its inputs apart by identity)
        snapshot = tree_unflatten([(k, mx.array(v)) for k, v in tree_flatten(model.parameters())])
        mx.eval(snapshot)
        return cls("initial_weights", weights=snapshot)

    def logits(self, model, input_ids, device=None):
        """Reference logits ``[B, T, V]`` (no gradient) for ``input_ids`` ``[B, T]``; ``model`` is the
        model being trained."""
        if self.kind == "model":
            out = self.model(input_ids, device=device)
        elif self.kind == "adapters_off":
            with lora.adapters_disabled(model):
                out = model(input_ids, device=device)
        else:
            with weights_swapped(model, self.weights):
                out = model(input_ids, device=device)
        return mx.stop_gradient(out)

    def arrays(self):
        """The arrays the reference reads (a tree updated in place), for `metalnn.Trainer`'s compiled
        step to take as inputs: the frozen model's, the weight snapshot, or nothing."""
        if self.kind == "model":
            return self.model.state
        if self.kind == "initial_weights":
            return self.weights
        return {}

    def describe(self) -> str:
        return {"model": "a separate frozen model", "adapters_off": "the model with its adapters switched off",
                "initial_weights": "the model's weights before training"}[self.kind]


# -- objectives --------------------------------------------------------------------------------
class PreferenceLoss:
    """Base of the objectives. ``state`` is what `metalnn.Trainer`'s compiled step takes in and
    gives back: ``state["metrics"]``, the last batch's metrics as arrays (the same keys always), and
    ``state["reference"]``, the arrays the reference model reads."""

    names: tuple = ()

    def __init__(self, reference=None):
        self.reference = reference
        self.state = {"metrics": {name: mx.array(0.0) for name in self.names},
                      "reference": reference.arrays() if reference is not None else {}}

    def metrics(self) -> dict:
        """The last batch's metrics as floats under TRL's names (those TRL would not log for the
        batch, NaN here, left out)."""
        out = {}
        for k, v in self.state["metrics"].items():
            value = float(v.item())
            if not math.isnan(value):
                out[k] = value
        return out

    def _keep(self, metrics: dict):
        for k in self.names:
            self.state["metrics"][k] = mx.stop_gradient(metrics[k]).astype(mx.float32)


def _logit_metrics(logits, mask):
    """Mean over the vocabulary of ``logits`` ``[B, T-1, V]``, averaged over ``mask`` ``[B, T-1]``."""
    return _masked_mean(logits.astype(mx.float32).mean(axis=-1), mask)


class DPOLoss(PreferenceLoss):
    """DPO as TRL's ``DPOTrainer`` computes it (see `dpo_losses` and the module docstring).

    Args:
        reference: a `Reference` (None: every batch must carry precomputed ``ref_chosen_logps`` /
            ``ref_rejected_logps``).
        beta, loss_type, label_smoothing: as TRL's ``DPOConfig``.
    """

    names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")

    def __init__(self, reference: Reference | None, beta: float = 0.1, loss_type: str = "sigmoid",
                 label_smoothing: float = 0.0):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"DPOLoss: loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
        if loss_type == "robust" and not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"DPOLoss: label_smoothing must be in [0, 0.5) for the robust loss, got {label_smoothing}")
        if loss_type == "ipo" and beta <= 0:
            raise ValueError(f"DPOLoss: the ipo loss divides by beta, which must be > 0, got {beta}")
        super().__init__(reference)
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing

    def reference_logps(self, model, batch, device=None):
        """``(ref_chosen_logps, ref_rejected_logps)`` ``[B]`` of a batch (precomputed ones if it has them)."""
        if "ref_chosen_logps" in batch:
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        if self.reference is None:
            raise ValueError("DPOLoss: the batch carries no precomputed reference log-probabilities and no "
                             "reference model was given")
        ids = batch["input_ids"]
        ref = completion_logps(self.reference.logits(model, ids, device), ids, batch["completion_mask"])
        b = ids.shape[0] // 2
        return ref[:b], ref[b:]

    def __call__(self, model, batch, device=None):
        ids, cmask = batch["input_ids"], batch["completion_mask"]
        b = ids.shape[0] // 2
        logits = model(ids, device=device)
        mask = cmask[:, 1:]
        logps = (token_logps(logits, ids) * mask).sum(axis=1)
        chosen, rejected = logps[:b], logps[b:]
        ref_chosen, ref_rejected = self.reference_logps(model, batch, device)
        lengths = cmask.sum(axis=1)  # TRL's ipo divides by the (unshifted) completion lengths
        losses = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta=self.beta, loss_type=self.loss_type,
                            label_smoothing=self.label_smoothing, chosen_lengths=lengths[:b],
                            rejected_lengths=lengths[b:])
        loss = losses.mean()

        shift = mx.stop_gradient(logits[:, :-1])
        chosen_r = self.beta * mx.stop_gradient(chosen - ref_chosen)
        rejected_r = self.beta * mx.stop_gradient(rejected - ref_rejected)
        hits = (mx.argmax(shift[:b], axis=-1) == ids[:b, 1:]).astype(mx.float32)
        self._keep({
            "rewards/chosen": chosen_r.mean(), "rewards/rejected": rejected_r.mean(),
            "rewards/accuracies": (chosen_r > rejected_r).astype(mx.float32).mean(),
            "rewards/margins": (chosen_r - rejected_r).mean(),
            "logps/chosen": chosen.mean(), "logps/rejected": rejected.mean(),
            "logits/chosen": _logit_metrics(shift[:b], mask[:b]),
            "logits/rejected": _logit_metrics(shift[b:], mask[b:]),
            "entropy": _masked_mean(_entropy(shift), mask),
            "mean_token_accuracy": _masked_mean(hits, mask[:b]),
        })
        return loss


class ORPOLoss(PreferenceLoss):
    """ORPO as TRL's ``ORPOTrainer`` computes it: ``nll_loss - mean(beta * log sigmoid(log odds
    ratio))``, with no reference model (``beta``: the paper's lambda, TRL's name)."""

    names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/rejected",
             "logps/chosen", "logits/rejected", "logits/chosen", "nll_loss", "log_odds_ratio", "log_odds_chosen")

    def __init__(self, beta: float = 0.1):
        super().__init__(None)
        self.beta = beta

    def __call__(self, model, batch, device=None):
        ids, cmask, att = batch["input_ids"], batch["completion_mask"], batch["attention_mask"]
        b = ids.shape[0] // 2
        logits = model(ids, device=device)
        tok = token_logps(logits, ids)
        mask = cmask[:, 1:]
        avg = (tok * mask).sum(axis=1) / mask.sum(axis=1)
        chosen, rejected = avg[:b], avg[b:]
        targets = att[:b, 1:]  # the chosen rows' real next tokens, prompt included
        nll = -(tok[:b] * targets).sum() / targets.sum()
        log_odds = orpo_log_odds(chosen, rejected)
        ratio = log_sigmoid(log_odds)
        loss = nll - (self.beta * ratio).mean()

        shift = mx.stop_gradient(logits[:, :-1])
        positions = att[:, :-1]
        chosen_r, rejected_r = self.beta * mx.stop_gradient(chosen), self.beta * mx.stop_gradient(rejected)
        self._keep({
            "rewards/chosen": chosen_r.mean(), "rewards/rejected": rejected_r.mean(),
            "rewards/accuracies": (chosen_r > rejected_r).astype(mx.float32).mean(),
            "rewards/margins": (chosen_r - rejected_r).mean(),
            "logps/rejected": rejected.mean(), "logps/chosen": chosen.mean(),
            "logits/rejected": _logit_metrics(shift[b:], positions[b:]),
            "logits/chosen": _logit_metrics(shift[:b], positions[:b]),
            "nll_loss": nll, "log_odds_ratio": ratio.mean(), "log_odds_chosen": log_odds.mean(),
        })
        return loss


class KTOLoss(PreferenceLoss):
    """KTO as TRL's ``KTOTrainer`` computes it (loss type ``kto``; see `kto_losses`): the mean of
    the weighted per-example losses, the KL estimate from the batch's mismatched pairs (the policy's
    and the reference's log-probabilities of ``KL_input_ids``, no gradient, clamped at 0).

    Args:
        reference: a `Reference` (None: batches must carry precomputed ``ref_logps`` / ``ref_KL_logps``).
        beta, desirable_weight, undesirable_weight: as TRL's ``KTOConfig``.
    """

    names = ("kl", "entropy", "logits/chosen", "logits/rejected", "rewards/chosen", "logps/chosen",
             "rewards/rejected", "logps/rejected", "rewards/margins")

    def __init__(self, reference: Reference | None, beta: float = 0.1, desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0):
        super().__init__(reference)
        self.beta = beta
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight

    def reference_logps(self, model, batch, device=None):
        """``(ref_logps, ref_KL_logps)`` ``[B]`` of a batch (precomputed ones if it has them)."""
        if "ref_logps" in batch:
            return batch["ref_logps"], batch["ref_KL_logps"]
        if self.reference is None:
            raise ValueError("KTOLoss: the batch carries no precomputed reference log-probabilities and no "
                             "reference model was given")
        ref = completion_logps(self.reference.logits(model, batch["input_ids"], device), batch["input_ids"],
                               batch["completion_mask"])
        ref_kl = completion_logps(self.reference.logits(model, batch["KL_input_ids"], device),
                                  batch["KL_input_ids"], batch["KL_completion_mask"])
        return ref, ref_kl

    def __call__(self, model, batch, device=None):
        ids, cmask, labels = batch["input_ids"], batch["completion_mask"], batch["label"]
        kl_ids = batch["KL_input_ids"]
        kl_logps = mx.stop_gradient(completion_logps(model(kl_ids, device=device), kl_ids,
                                                     batch["KL_completion_mask"]))
        logits = model(ids, device=device)
        mask = cmask[:, 1:]
        logps = (token_logps(logits, ids) * mask).sum(axis=1)
        ref, ref_kl = self.reference_logps(model, batch, device)
        kl = mx.maximum(mx.stop_gradient(kl_logps - ref_kl).mean(), 0.0)
        ratios = logps - ref
        loss = kto_losses(ratios, labels, kl, beta=self.beta, desirable_weight=self.desirable_weight,
                          undesirable_weight=self.undesirable_weight).mean()

        shift = mx.stop_gradient(logits[:, :-1])
        rewards = self.beta * mx.stop_gradient(ratios)
        plain = mx.stop_gradient(logps)
        chosen, rejected = labels, 1.0 - labels
        rewards_chosen = (rewards * chosen).sum() / chosen.sum()
        rewards_rejected = (rewards * rejected).sum() / rejected.sum()
        self._keep({
            "kl": kl, "entropy": _masked_mean(_entropy(shift), mask),
            "logits/chosen": _logit_metrics(shift, mask * chosen[:, None]),
            "logits/rejected": _logit_metrics(shift, mask * rejected[:, None]),
            "rewards/chosen": rewards_chosen, "logps/chosen": (plain * chosen).sum() / chosen.sum(),
            "rewards/rejected": rewards_rejected, "logps/rejected": (plain * rejected).sum() / rejected.sum(),
            "rewards/margins": rewards_chosen - rewards_rejected,
        })
        return loss


def objective(method: str, reference: Reference | None, **settings) -> PreferenceLoss:
    """The objective of ``method`` (``dpo``, ``orpo``, ``kto``) with TRL's settings by name."""
    if method == "dpo":
        return DPOLoss(reference, **settings)
    if method == "orpo":
        return ORPOLoss(**settings)
    if method == "kto":
        return KTOLoss(reference, **settings)
    raise ValueError(f"objective: method must be dpo, orpo or kto, got {method!r}")


def precompute_reference(dataset, model, reference: Reference, batch_size: int, device=None):
    """``dataset`` (a `PreferenceDataset`) with its reference log-probabilities computed once
    (TRL's ``precompute_ref_log_probs``), in batches of ``batch_size`` (KTO: the training batch
    size, since its KL pairs are built within training batches)."""
    import numpy as np

    if not dataset.paired:
        keys = ("ref_logps", "ref_KL_logps")
    else:
        keys = ("ref_chosen_logps", "ref_rejected_logps")
    values = {k: np.zeros(len(dataset), dtype=np.float32) for k in keys}
    was = model.training
    model.eval()
    try:
        for group in dataset.batch_indices(batch_size):
            batch = dataset.collate(group)
            ids = batch["input_ids"]
            ref = completion_logps(reference.logits(model, ids, device), ids, batch["completion_mask"])
            if dataset.paired:
                n = len(group)
                mx.eval(ref)
                values[keys[0]][group], values[keys[1]][group] = np.array(ref[:n]), np.array(ref[n:])
            else:
                kl_ids = batch["KL_input_ids"]
                ref_kl = completion_logps(reference.logits(model, kl_ids, device), kl_ids, batch["KL_completion_mask"])
                mx.eval(ref, ref_kl)
                values[keys[0]][group], values[keys[1]][group] = np.array(ref), np.array(ref_kl)
    finally:
        model.train(was)
    return dataset.with_ref_logps(values)

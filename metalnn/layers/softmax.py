"""Softmax variants as layers (over the W axis of each row)."""

from __future__ import annotations

import math

import mlx.core as mx

from ..data import Data, MTLSize
from .base import Layer
from .adaptive_softmax import AdaptiveSoftmax

VARIANTS = ("standard", "temperature", "masked", "gumbel", "sparsemax", "entmax", "grid", "hierarchical", "adaptive",
            "mixture", "log")


def sparsemax(x, axis=-1):
    """Euclidean projection of ``x`` onto the probability simplex (Martins & Astudillo, 2016)."""
    z = mx.moveaxis(x, axis, -1).astype(mx.float32)
    n = z.shape[-1]
    zs = mx.sort(z, axis=-1)[..., ::-1]
    k = mx.arange(1, n + 1, dtype=mx.float32)
    cums = mx.cumsum(zs, axis=-1)
    support = (1 + k * zs) > cums
    k_z = mx.sum(support, axis=-1, keepdims=True).astype(mx.float32)
    tau = (mx.take_along_axis(cums, k_z.astype(mx.int32) - 1, axis=-1) - 1) / k_z
    p = mx.maximum(z - tau, 0)
    return mx.moveaxis(p.astype(x.dtype), -1, axis)


def entmax(x, alpha: float = 1.5, axis=-1, iters: int = 40):
    """alpha-entmax by bisection on the threshold (alpha=1: softmax, alpha=2: sparsemax)."""
    if alpha == 1.0:
        return mx.softmax(x, axis=axis)
    z = mx.moveaxis(x, axis, -1).astype(mx.float32) * (alpha - 1)
    n = z.shape[-1]
    zmax = mx.max(z, axis=-1, keepdims=True)
    lo, hi = zmax - 1.0, zmax - (1.0 / n) ** (alpha - 1)
    for _ in range(iters):
        tau = (lo + hi) / 2
        p = mx.maximum(z - tau, 0) ** (1 / (alpha - 1))
        big = mx.sum(p, axis=-1, keepdims=True) >= 1
        lo, hi = mx.where(big, tau, lo), mx.where(big, hi, tau)
    p = mx.maximum(z - (lo + hi) / 2, 0) ** (1 / (alpha - 1))
    p = p / mx.sum(p, axis=-1, keepdims=True)
    return mx.moveaxis(p.astype(x.dtype), -1, axis)


def hierarchical_softmax(x, levels):
    """Nested decisions: leaf probabilities ``[..., prod(levels)]`` from the decision logits of every level.

    ``x`` ``[..., sum_l prod(levels[:l+1])]`` holds, level after level, the logits of each decision:
    for levels ``(3, 3, 4)`` first the 3 strategy logits, then 3 x 3 unit logits (3 per strategy),
    then 9 x 4 action logits (4 per unit). Each level is a softmax over siblings (a child given its
    parent); a leaf's probability is the product along its path, so the leaves of a row sum to 1.
    """
    out = None
    start = 0
    groups = 1
    lead = x.shape[:-1]
    for size in levels:
        block = x[..., start:start + groups * size].reshape(*lead, groups, size)
        cond = mx.softmax(block, axis=-1)                                  # P(child | parent)
        out = cond if out is None else out.reshape(*lead, groups, 1) * cond
        out = out.reshape(*lead, groups * size)
        start += groups * size
        groups *= size
    return out


class Softmax(Layer):
    """Normalise each row into a distribution (over the W axis).

    Args:
        variant: one of
            * ``"standard"``; ``"temperature"`` (``softmax(x / temperature)``); ``"log"`` (log-softmax);
            * ``"masked"``: entries where ``mask`` is False get probability 0 (``mask`` broadcasts to the
              rows);
            * ``"gumbel"``: adds Gumbel noise from the device key in training mode (a relaxed sample);
            * ``"sparsemax"``; ``"entmax"`` (``alpha`` between 1 and 2);
            * ``"grid"``: each row split into ``groups`` equal chunks, each normalised on its own;
            * ``"hierarchical"``: nested decisions over ``levels`` (e.g. ``(3, 3, 4)``: strategy -> unit
              -> action): the input holds every level's decision logits (``3 + 9 + 36`` values), the
              output the ``prod(levels)`` leaf probabilities, which sum to 1 (see `hierarchical_softmax`);
            * ``"mixture"``: ``sum_k weights[k] * softmax(x / temperatures[k])``, a blend of sharper and
              smoother distributions (defaults: temperatures ``(0.5, 1, 2)``, equal weights;
              ``learn_weights=True`` makes the blend a trained parameter ``mixture_logits``);
            * ``"adaptive"``: the probabilities of an `AdaptiveSoftmax` (``in_features``, ``n_classes``,
              ``cutoffs``, ``div_value`` as there): input width ``in_features``, output ``n_classes``.
    """

    positional_hint = "{cls}({variant!r}, temperature={extra[0]!r})"

    def __init__(self, variant: str = "standard", *, temperature: float = 1.0, mask=None, alpha: float = 1.5,
                 groups: int = 1, levels=None, temperatures=(0.5, 1.0, 2.0), weights=None, learn_weights=False,
                 in_features: int | None = None, n_classes: int | None = None, cutoffs=None, div_value: float = 4.0):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"Softmax: variant must be one of {VARIANTS}, got {variant!r}")
        if temperature <= 0:
            raise ValueError(f"Softmax: temperature must be positive, got {temperature}")
        if variant == "masked" and mask is None:
            raise ValueError("Softmax: variant 'masked' needs mask=")
        self.variant, self.temperature, self.alpha, self.groups = variant, float(temperature), alpha, int(groups)
        self._mask = None if mask is None else mx.array(mask).astype(mx.bool_)
        if variant == "hierarchical":
            if not levels or any(int(v) < 1 for v in levels):
                raise ValueError(f"Softmax: variant 'hierarchical' needs levels= (positive sizes), got {levels!r}")
            self.levels = tuple(int(v) for v in levels)
        if variant == "mixture":
            self.temperatures = tuple(float(t) for t in temperatures)
            if not self.temperatures or min(self.temperatures) <= 0:
                raise ValueError(f"Softmax: mixture temperatures must be positive, got {temperatures!r}")
            k = len(self.temperatures)
            w = [1.0 / k] * k if weights is None else [float(v) for v in weights]
            if len(w) != k or min(w) < 0 or sum(w) <= 0:
                raise ValueError(f"Softmax: mixture weights must be {k} non-negative numbers, got {weights!r}")
            if learn_weights:
                self.mixture_logits = mx.log(mx.array(w, dtype=mx.float32) / sum(w) + 1e-12)
            else:
                self._weights = mx.array(w, dtype=mx.float32) / sum(w)
        if variant == "adaptive":
            if in_features is None or n_classes is None or cutoffs is None:
                raise ValueError("Softmax: variant 'adaptive' needs in_features=, n_classes= and cutoffs=")
            self.adaptive = AdaptiveSoftmax(in_features, n_classes, cutoffs, div_value=div_value)

    @property
    def in_width(self):
        """The input width a variant requires (None: any)."""
        if self.variant == "hierarchical":
            return sum(math.prod(self.levels[:i + 1]) for i in range(len(self.levels)))
        if self.variant == "adaptive":
            return self.adaptive.in_features
        return None

    def forward(self, device, data):
        x, d = data.array, data.dims
        v = self.variant
        if self.in_width is not None:
            self.require(d.W == self.in_width, f"input W={self.in_width} ({v} softmax"
                         + (f" over levels {self.levels})" if v == "hierarchical" else ")"), f"W={d.W}")
        if v == "hierarchical":
            y = hierarchical_softmax(x, self.levels)
            return Data(y, MTLSize(y.shape[-1], d.H, d.D))
        if v == "adaptive":
            y = mx.exp(self.adaptive.log_prob(x.reshape(-1, d.W)))
            return Data(y, MTLSize(y.shape[-1], d.H, d.D))
        if v == "mixture":
            w = mx.softmax(self.mixture_logits) if "mixture_logits" in self else self._weights
            y = sum(w[i] * mx.softmax(x / t, axis=-1) for i, t in enumerate(self.temperatures))
            return Data(y.astype(x.dtype), d)
        if v in ("temperature", "gumbel"):
            x = x / self.temperature
        if v == "gumbel" and self.training:
            u = mx.random.uniform(1e-9, 1.0, x.shape, key=device.next_key())
            x = x - mx.log(-mx.log(u))
        if v == "masked":
            x = mx.where(self._mask, x, -mx.inf)
        if v == "sparsemax":
            y = sparsemax(x)
        elif v == "entmax":
            y = entmax(x, self.alpha)
        elif v == "log":
            y = x - mx.logsumexp(x, axis=-1, keepdims=True)
        elif v == "grid":
            self.require(d.W % self.groups == 0, f"W divisible by groups={self.groups}", f"W={d.W}")
            y = mx.softmax(x.reshape(*x.shape[:-1], self.groups, d.W // self.groups), axis=-1).reshape(x.shape)
        else:
            y = mx.softmax(x, axis=-1)
        return Data(y, MTLSize(*d))

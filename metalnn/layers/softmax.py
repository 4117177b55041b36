"""Softmax variants as layers (over the W axis of each row)."""

from __future__ import annotations

import mlx.core as mx

from ..data import Data, MTLSize
from ..layer import Layer, no_positional

VARIANTS = ("standard", "temperature", "masked", "gumbel", "sparsemax", "entmax", "grid", "log")


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


class Softmax(Layer):
    """Normalise each row into a distribution.

    Args:
        variant: ``"standard"``; ``"temperature"`` (``softmax(x / temperature)``); ``"masked"``
            (entries where ``mask`` is False get probability 0; ``mask`` broadcasts to the rows);
            ``"gumbel"`` (adds Gumbel noise from the device key in training mode: a relaxed sample);
            ``"sparsemax"``; ``"entmax"`` (``alpha`` between 1 and 2); ``"grid"`` (each row split into
            ``groups`` equal chunks, each normalised on its own); ``"log"`` (log-softmax).
    """

    def __init__(self, variant: str = "standard", *extra, temperature: float = 1.0, mask=None, alpha: float = 1.5,
                 groups: int = 1):
        super().__init__()
        no_positional("Softmax", extra, f"Softmax({variant!r}, temperature={extra[0]!r})" if extra else "")
        if variant not in VARIANTS:
            raise ValueError(f"Softmax: variant must be one of {VARIANTS}, got {variant!r}")
        if temperature <= 0:
            raise ValueError(f"Softmax: temperature must be positive, got {temperature}")
        if variant == "masked" and mask is None:
            raise ValueError("Softmax: variant 'masked' needs mask=")
        self.variant, self.temperature, self.alpha, self.groups = variant, float(temperature), alpha, int(groups)
        self._mask = None if mask is None else mx.array(mask).astype(mx.bool_)

    def forward(self, device, data):
        x, d = data.array, data.dims
        v = self.variant
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

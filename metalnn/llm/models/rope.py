"""Rotary position embeddings from Hugging Face config values: `rope_options` turns ``rope_theta`` /
``rope_scaling`` / ``rope_parameters`` / ``partial_rotary_factor`` (and the per-frequency factors GGUF
files store) into `SelfAttention`'s RoPE keywords; every architecture's ``ModelArgs`` declares those
keys and their defaults and calls it once.

YaRN (``rope_type`` ``yarn``, `yarn_rope_parameters`) is transformers' ``_compute_yarn_parameters``:
blended frequencies and an attention factor that multiplies cos and sin (so every score by its
square), given to `SelfAttention` as ``rope_attention_factor`` (the key is present for YaRN only).
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import UnsupportedConfigError
from ...layers.fused_projections import LongRoPE

#: rope types `rope_options` implements (``rope_type`` / ``type`` of ``rope_scaling`` / ``rope_parameters``)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_options(head_dim: int, *, rope_theta: float, rope_scaling: dict | None, rope_parameters: dict | None,
                 partial_rotary_factor: float, rope_freq_factors=None,
                 max_position_embeddings: int | None = None) -> dict:
    """`SelfAttention` keywords ``rope_base``, ``rope_scale``, ``rope_freqs`` and ``rope_dims`` (and
    ``rope_attention_factor`` for YaRN).

    Args:
        head_dim: width of one attention head.
        rope_theta, partial_rotary_factor: the config's top-level values; ``rope_parameters`` (newer
            configs) or ``rope_scaling`` (older ones) override them when they hold the same keys.
        rope_scaling, rope_parameters: ``{"rope_type": ..., "factor": ..., ...}`` or None; rope types
            ``default``, ``linear``, ``llama3`` and ``yarn`` are supported.
        rope_freq_factors: per-frequency divisors (``head_dim * partial_rotary_factor / 2`` of them)
            as GGUF files store Llama 3's scaling, or None.
        max_position_embeddings: the config's value; YaRN's ``original_max_position_embeddings``
            defaults to it, and its ``factor`` (when null) is its ratio to that (transformers' rule).
    Raises:
        UnsupportedConfigError: another rope type, or factors that do not fit.
    """
    params = dict(rope_parameters or {})
    params.update(rope_scaling or {})
    theta = float(params.get("rope_theta", rope_theta))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    partial = float(params.get("partial_rotary_factor", partial_rotary_factor))
    rope_dims = int(head_dim * partial)
    out = {"rope_base": theta, "rope_scale": 1.0, "rope_freqs": None, "rope_dims": rope_dims}
    if rope_freq_factors is not None:
        if kind != "default" or len(rope_freq_factors) != rope_dims // 2:
            raise UnsupportedConfigError(f"rope_freq_factors: {len(rope_freq_factors)} factors for {rope_dims // 2} "
                                         f"frequencies with rope type {kind!r} (expected the default type)")
        exponents = np.arange(0, rope_dims, 2, dtype=np.float32) / np.float32(rope_dims)
        periods = np.float32(theta) ** exponents * np.asarray(rope_freq_factors, dtype=np.float32)
        out["rope_freqs"] = periods.astype(np.float32)
        return out
    if kind == "default":
        return out
    if kind == "linear":
        out["rope_scale"] = 1.0 / float(params["factor"])
        return out
    if kind == "llama3":
        out["rope_freqs"] = llama3_rope_periods(rope_dims, theta, params)
        return out
    if kind == "yarn":
        inv_freq, factor = yarn_rope_parameters(rope_dims, theta, params, max_position_embeddings)
        out["rope_freqs"] = (1.0 / inv_freq).astype(np.float32)
        out["rope_attention_factor"] = factor
        return out
    raise UnsupportedConfigError(f"rope_scaling / rope_parameters: rope type {kind!r} is not supported "
                                 f"(supported: {', '.join(ROPE_TYPES)})")


def llama3_rope_periods(dims: int, base: float, params: dict):
    """Llama 3.1's frequency scaling; returns the ``dims // 2`` periods (``1 / inv_freq``) for
    `metalnn.functional.rope`."""
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_len = float(params.get("original_max_position_embeddings", 8192))
    inv = (1.0 / (np.float32(base) ** (np.arange(0, dims, 2, dtype=np.int64).astype(np.float32) / np.float32(dims))))
    inv = inv.astype(np.float32)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    scaled = np.where(medium, smoothed, scaled).astype(np.float32)
    return (1.0 / scaled).astype(np.float32)


def yarn_rope_parameters(dims: int, base: float, params: dict, max_position_embeddings: int | None = None):
    """YaRN's ``(inv_freq [dims // 2] float32, attention_factor)`` as transformers'
    ``_compute_yarn_parameters`` computes them.

    ``params``: ``factor`` (null: ``max_position_embeddings / original_max_position_embeddings``),
    ``original_max_position_embeddings`` (default ``max_position_embeddings``), ``beta_fast`` (32),
    ``beta_slow`` (1), ``truncate`` (true: the correction range's ends rounded outwards),
    ``attention_factor`` (default ``0.1 * ln(factor) + 1``, or with ``mscale`` and ``mscale_all_dim``
    both set, the ratio of that formula with each as the multiplier of ``ln(factor)``; 1 for factors up to 1).

    Raises:
        UnsupportedConfigError: no original length to scale from.
    """
    original = params.get("original_max_position_embeddings", max_position_embeddings)
    if original is None:
        raise UnsupportedConfigError("rope_scaling / rope_parameters: YaRN needs original_max_position_embeddings "
                                     "(or max_position_embeddings)")
    original = float(original)
    factor = params.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise UnsupportedConfigError("rope_scaling / rope_parameters: YaRN without a factor needs "
                                         "max_position_embeddings")
        factor = max_position_embeddings / original
    factor = float(factor)

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all_dim))
        else:
            attention = get_mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations):
        return (dims * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    pos_freqs = (np.float32(base) ** (np.arange(0, dims, 2, dtype=np.float32) / np.float32(dims))).astype(np.float32)
    inv_extra = (1.0 / pos_freqs).astype(np.float32)
    inv_inter = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    return inv.astype(np.float32), float(attention)


#: ``rope_type`` names transformers' Phi-3 config reads as LongRoPE
LONGROPE_TYPES = ("longrope", "su", "yarn")


def longrope_options(head_dim: int, *, rope_theta: float, rope_scaling: dict | None, rope_parameters: dict | None,
                     partial_rotary_factor: float, max_position_embeddings: int,
                     original_max_position_embeddings: int) -> dict:
    """`FusedQKVAttention` RoPE keywords for a Phi-3 config: `rope_options`' keywords, plus ``long_rope``
    (a `metalnn.layers.LongRoPE`, or None when the config's rope type is not LongRoPE).

    As transformers' Phi-3: ``su`` and ``yarn`` mean ``longrope``; the pretraining length is the
    config's top-level ``original_max_position_embeddings``; the attention factor is the rope
    parameters' ``attention_factor``, else ``sqrt(1 + log(s) / log(original))`` for
    ``s = factor`` (or ``max_position_embeddings / original`` without one) above 1, else 1.

    Raises:
        UnsupportedConfigError: another rope type (`rope_options`), or short/long factors missing or
            not one per rotated frequency.
    """
    params = dict(rope_parameters or {})
    params.update(rope_scaling or {})
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in LONGROPE_TYPES:
        return {**rope_options(head_dim, rope_theta=rope_theta, rope_scaling=rope_scaling,
                               rope_parameters=rope_parameters, partial_rotary_factor=partial_rotary_factor),
                "long_rope": None}
    theta = float(params.get("rope_theta", rope_theta))
    dims = int(head_dim * float(params.get("partial_rotary_factor", partial_rotary_factor)))
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = params.get(key)
        if not isinstance(value, (list, tuple)) or len(value) != dims // 2:
            raise UnsupportedConfigError(f"rope_scaling.{key}: expected {dims // 2} numbers (one per frequency of "
                                         f"{dims} rotated features), got {value!r}")
        factors[key] = [float(v) for v in value]
    original = int(original_max_position_embeddings)
    scale = params.get("factor")
    scale = float(scale) if scale is not None else max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    long_rope = LongRoPE(dims, theta, factors["short_factor"], factors["long_factor"], original, float(attention))
    return {"rope_base": theta, "rope_scale": 1.0, "rope_freqs": None, "rope_dims": dims, "long_rope": long_rope}

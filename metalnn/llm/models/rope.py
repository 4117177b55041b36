"""Rotary position embeddings from Hugging Face config values: `rope_options` turns ``rope_theta`` /
``rope_scaling`` / ``rope_parameters`` / ``partial_rotary_factor`` (and the per-frequency factors GGUF
files store) into `SelfAttention`'s RoPE keywords; every architecture's ``ModelArgs`` declares those
keys and their defaults and calls it once.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import UnsupportedConfigError
from ...layers.fused_projections import LongRoPE

#: rope types `rope_options` implements (``rope_type`` / ``type`` of ``rope_scaling`` / ``rope_parameters``)
ROPE_TYPES = ("default", "linear", "llama3")


def rope_options(head_dim: int, *, rope_theta: float, rope_scaling: dict | None, rope_parameters: dict | None,
                 partial_rotary_factor: float, rope_freq_factors=None) -> dict:
    """`SelfAttention` keywords ``rope_base``, ``rope_scale``, ``rope_freqs`` and ``rope_dims``.

    Args:
        head_dim: width of one attention head.
        rope_theta, partial_rotary_factor: the config's top-level values; ``rope_parameters`` (newer
            configs) or ``rope_scaling`` (older ones) override them when they hold the same keys.
        rope_scaling, rope_parameters: ``{"rope_type": ..., "factor": ..., ...}`` or None; rope types
            ``default``, ``linear`` and ``llama3`` are supported.
        rope_freq_factors: per-frequency divisors (``head_dim * partial_rotary_factor / 2`` of them)
            as GGUF files store Llama 3's scaling, or None.
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

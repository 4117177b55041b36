"""The K-quants: 256-value super-blocks split into sub-blocks of 16 or 32 values, each sub-block with a
small integer scale (and minimum) that multiplies the super-block's float16 ``d`` (and ``dmin``)
(``block_q2_K`` ... ``block_q6_K`` in ``ggml-common.h``).

Bit layouts shared by several types. A run of 2-bit fields is stored as "planes": the 256 values form
two halves of 128; value ``128 h + 32 s + j`` is bits ``2s, 2s + 1`` of byte ``32 h + j``. A run of
4-bit fields is stored likewise with two nibble planes: value ``64 c + 32 s + j`` is nibble ``s`` of byte
``32 c + j``. A high-bit mask ``hm[32]`` gives value ``32 b + j`` its extra bit from bit ``b`` of byte ``j``.

Layouts (bytes):

* Q2_K (84): ``scales[16]``, ``qs[64]`` (2-bit planes), ``d`` f16, ``dmin`` f16. Sub-block ``i`` of 16
  values: ``sc = scales[i] & 0xF``, ``m = scales[i] >> 4``; ``x = (d * sc) * q - (dmin * m)``.
* Q3_K (110): ``hmask[32]`` (high-bit mask), ``qs[64]`` (2-bit planes), ``scales[12]``, ``d`` f16. Sixteen
  6-bit scales: scale ``i`` takes its low four bits from nibble ``i // 8`` of byte ``i % 8`` and its top
  two from bits ``2 (i // 4)`` of byte ``8 + i % 4``; ``q = low2 - (0 if high bit else 4)``;
  ``x = (d * (scale - 32)) * q``.
* Q4_K (144): ``d`` f16, ``dmin`` f16, ``scales[12]``, ``qs[128]`` (nibble planes). Eight sub-blocks of
  32 with 6-bit scale and minimum (``get_scale_min_k4``): for ``i < 4``, ``sc = s[i] & 63`` and
  ``m = s[i + 4] & 63``; for ``i >= 4``, ``sc = (s[i + 4] & 0xF) | (s[i - 4] >> 6) << 4`` and
  ``m = (s[i + 4] >> 4) | (s[i] >> 6) << 4``; ``x = (d * sc) * q - (dmin * m)``.
* Q5_K (176): ``d`` f16, ``dmin`` f16, ``scales[12]`` (as Q4_K), ``qh[32]`` (high-bit mask), ``qs[128]``
  (nibble planes); ``q = nibble | high << 4``, ``x = (d * sc) * q - (dmin * m)``.
* Q6_K (210): ``ql[128]``, ``qh[64]``, ``scales[16]`` int8, ``d`` f16. In half ``h`` (128 values), value
  ``128 h + 64 s + k`` takes nibble ``s`` of ``ql[64 h + k]`` and value ``128 h + 32 t + j`` takes its top
  two bits from bits ``2t`` of ``qh[32 h + j]``; ``x = (d * scales[i]) * (q - 32)`` over sub-blocks ``i``
  of 16.

Encoders (``quantize_row_q2_K_ref`` ... ``quantize_row_q6_K_ref``, what ``llama-quantize`` writes without
an importance matrix) work in two passes. First each sub-block gets a float scale (and minimum) of its
own: Q4_K, Q5_K and Q2_K by ``make_qkx2_quants``, a weighted least-squares fit of an affine grid tried
at a few grid spacings around ``(max - min) / nmax``; Q6_K by ``make_qx_quants``, a symmetric grid
tried at 19 spacings around ``max / -32``; Q3_K by ``make_q3_quants``, which moves single values
to better levels while that lowers the weighted error. Then the sub-block scales are themselves
quantized against the block's float16 ``d`` (6 bits for Q4_K/Q5_K/Q3_K, 4 for Q2_K, 8 for Q6_K) and
every value is re-rounded against its sub-block's final scale. Sub-blocks are laid out as columns
(``[values per sub-block, sub-blocks]``) so that ggml's sums over a sub-block's values are added one
value at a time, in ggml's order, over all sub-blocks at once.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .base import (F32, GGMLType, f16, f16_bytes, f16_round, first_abs_max, i8s, nearest_int, pack_nibbles,
                   seq_sum, u8s)

QK_K = 256

_NIBBLE = mx.array([[0], [4]], dtype=mx.uint32)
_PAIR = mx.array([[0], [2], [4], [6]], dtype=mx.uint32)
_BIT = mx.arange(8, dtype=mx.uint32).reshape(8, 1)


def _crumbs(qs):
    """``[n, 64]`` bytes of 2-bit planes -> ``[n, 256]`` values."""
    return ((qs.reshape(-1, 2, 1, 32) >> _PAIR) & 3).reshape(-1, QK_K)


def _nibble_planes(qs, width=32):
    """``[n, m]`` bytes of nibble planes ``width`` bytes wide -> ``[n, 2m]`` values."""
    return ((qs.reshape(-1, qs.shape[-1] // width, 1, width) >> _NIBBLE) & 0xF).reshape(-1, 2 * qs.shape[-1])


def _high_bits(hm):
    """``[n, 32]`` high-bit mask -> ``[n, 256]``: bit ``b`` of byte ``j`` for value ``32 b + j``."""
    return ((hm[:, None, :] >> _BIT) & 1).reshape(-1, QK_K)


def _scale_min_k4(s):
    """The eight 6-bit scales and minimums of Q4_K/Q5_K from their 12 bytes: two ``[n, 8]`` uint32."""
    lo, mid, top = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = mx.concatenate([lo & 63, (top & 0xF) | ((lo >> 2) & 0x30)], axis=-1)
    mn = mx.concatenate([mid & 63, (top >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return sc, mn


def _per_sub_block(scale, values, sub):
    """``scale [n, k] * values [n, k * sub]`` with each scale over its ``sub`` values, as ``[n, k, sub]``."""
    return scale[:, :, None] * values.reshape(-1, scale.shape[-1], sub)


# -- encoders -------------------------------------------------------------------------------------------

GROUP_MAX_EPS = F32(1e-15)


def _columns(values, sub):
    """``float32 [n, 256] -> [sub, n * 256 / sub]``: one column per sub-block of ``sub`` values."""
    return np.ascontiguousarray(values.reshape(-1, sub).T)


def _rows(columns, n):
    """Inverse of `_columns`: ``[sub, n * 256 / sub] -> [n, 256]``."""
    return np.ascontiguousarray(columns.T).reshape(n, QK_K)


def _positive_max(values):
    """ggml's ``m = 0; if (v > m) m = v;`` over the last axis (``+0.0`` when none is positive)."""
    top = values.max(axis=-1)
    return np.where(top > 0, top, F32(0.0)).astype(F32)


def _clamped(values, lo, hi):
    return np.clip(nearest_int(values), lo, hi)


def _grid(scaled, span_ok, lo, hi, out):
    """``out = clamp(nearest_int(scaled), lo, hi)`` as float32, in place (``scaled`` may be ``out``).
    Where the caller knows every value is far inside ``nearest_int``'s range (``span_ok``), NumPy's
    round-half-to-even is the same and faster; otherwise ggml's bit trick is reproduced exactly."""
    if span_ok:
        np.rint(scaled, out=out)
        np.clip(out, lo, hi, out=out)
    else:
        out[...] = np.clip(nearest_int(scaled), lo, hi)
    return out


def _bounded(iscale, span):
    """Whether ``iscale * v`` for ``|v| <= span`` stays within a few grid steps (finite scales)."""
    return bool(np.isfinite(iscale).all() and np.isfinite(span).all())


def _make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad):
    """ggml's ``make_qkx2_quants`` on each column of ``x [m, s]`` (weights alike): the scale, the
    minimum (as the positive amount subtracted) ``[s]`` and the levels ``int [m, s]`` in ``0..nmax``
    of the best of ``nstep + 2`` weighted fits of ``x ~ scale * level - min``: the grid
    ``(max - min) / nmax`` as is, then for ``nmax + rmin + rdelta * step`` grid steps across the range
    the least-squares scale and minimum of its levels (the minimum kept ``<= 0``). A later fit is
    taken when its weighted error is smaller; the next grid starts from the minimum taken."""
    lo = x.min(axis=0)
    hi = x.max(axis=0)
    sum_w = seq_sum(weights)
    sum_x = seq_sum(weights * x)
    lo = np.where(lo > 0, F32(0.0), lo).astype(F32)
    flat = hi == lo  # ggml returns scale 0, levels 0 and this minimum at once
    flat_min = lo
    shifted, levels, wl, tmp = (np.empty_like(x) for _ in range(4))

    def fit_levels(iscale, lo):
        iscale = np.where(flat, F32(0.0), iscale).astype(F32)
        np.subtract(x, lo, out=shifted)
        np.multiply(shifted, iscale, out=shifted)
        return _grid(shifted, _bounded(iscale, hi - lo), 0, nmax, out=levels)

    def error(scale, lo):
        np.multiply(levels, scale, out=tmp)
        np.add(tmp, lo, out=tmp)
        np.subtract(tmp, x, out=tmp)
        if use_mad:
            np.abs(tmp, out=tmp)
        else:
            np.multiply(tmp, tmp, out=tmp)
        return seq_sum(np.multiply(tmp, weights, out=tmp), start=0.0)

    iscale = F32(nmax) / (hi - lo)
    scale = F32(1.0) / iscale
    fit_levels(iscale, lo)
    best_error = error(scale, lo)
    best_iscale, best_lo = iscale, lo  # to rebuild the levels taken
    for step in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (hi - lo)
        fit_levels(iscale, lo)
        np.multiply(weights, levels, out=wl)
        sum_l = seq_sum(wl, start=0.0)
        sum_l2 = seq_sum(np.multiply(wl, levels, out=tmp), start=0.0)
        sum_xl = seq_sum(np.multiply(wl, x, out=tmp), start=0.0)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        clipped = this_min > 0
        this_scale = np.where(clipped, sum_xl / sum_l2, this_scale).astype(F32)
        this_min = np.where(clipped, F32(0.0), this_min).astype(F32)
        cur_error = error(this_scale, this_min)
        better = (det > 0) & (cur_error < best_error)
        best_iscale = np.where(better, iscale, best_iscale)
        best_lo = np.where(better, lo, best_lo)
        best_error = np.where(better, cur_error, best_error)
        scale = np.where(better, this_scale, scale)
        lo = np.where(better, this_min, lo)
    fit_levels(best_iscale, best_lo)
    scale = np.where(flat, F32(0.0), scale)
    the_min = np.where(flat, -flat_min, -lo)
    return scale.astype(F32), the_min.astype(F32), np.where(flat, 0, levels.astype(np.int32))


def _make_qx_quants(x, nmax):
    """ggml's ``make_qx_quants`` with ``rmse_type = 1`` (weights ``x**2``) on each column of
    ``x [m, s]``: the scale ``[s]`` and levels ``int [m, s]`` in ``0..2 nmax - 1`` (``l + nmax``) of the
    best of 19 symmetric grids ``x ~ scale * l``, ``l`` in ``-nmax..nmax-1`` (grid steps of
    ``max / -(nmax + 0.1 k)``, ``k = -9..9``; a later one taken when it fits better)."""
    amax, vmax = first_abs_max(x, axis=0)
    zero = amax < GROUP_MAX_EPS  # ggml returns scale 0 and levels 0
    w = x * x
    wx = w * x
    levels, tmp = np.empty_like(x), np.empty_like(x)

    def fit(iscale):
        iscale = np.where(zero, F32(0.0), iscale).astype(F32)
        np.multiply(x, iscale, out=levels)
        _grid(levels, _bounded(iscale, amax), -nmax, nmax - 1, out=levels)
        sumlx = seq_sum(np.multiply(wx, levels, out=tmp), start=0.0)
        np.multiply(w, levels, out=tmp)
        return iscale, sumlx, seq_sum(np.multiply(tmp, levels, out=tmp), start=0.0)

    best_iscale, sumlx, suml2 = fit(F32(-nmax) / vmax)
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0.0)).astype(F32)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale, sumlx, suml2 = fit(-(F32(nmax) + F32(0.1) * F32(step)) / vmax)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        best_iscale = np.where(better, iscale, best_iscale)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    fit(best_iscale)
    return (np.where(zero, F32(0.0), scale).astype(F32),
            np.where(zero, 0, levels.astype(np.int32) + nmax))


def _make_q3_quants(x, nmax):
    """ggml's ``make_q3_quants`` with ``do_rmse`` on each column of ``x [m, s]``: start from the grid
    ``max / -nmax``, then (up to five sweeps) move single values to the level that fits the current
    weighted least-squares scale when that lowers the error. The scale ``[s]`` and levels ``int [m, s]``
    in ``0..2 nmax - 1``."""
    amax, vmax = first_abs_max(x, axis=0)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    wx = w * x
    levels = _clamped((F32(-nmax) / vmax) * x, -nmax, nmax - 1)
    lf = levels.astype(F32)
    sumlx = seq_sum(wx * lf, start=0.0)
    suml2 = seq_sum(w * lf * lf, start=0.0)
    active = ~zero
    for _ in range(5):
        changed = np.zeros_like(active)
        for i in range(x.shape[0]):
            cur = levels[i].astype(F32)
            slx = sumlx - wx[i] * cur
            sl2 = suml2 - w[i] * cur * cur
            new = _clamped(x[i] * sl2 / slx, -nmax, nmax - 1)
            nf = new.astype(F32)
            slx_new = slx + wx[i] * nf
            sl2_new = sl2 + w[i] * nf * nf
            take = (active & (slx > 0) & (new != levels[i]) & (sl2_new > 0)
                    & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new))
            levels[i] = np.where(take, new, levels[i])
            sumlx = np.where(take, slx_new, sumlx)
            suml2 = np.where(take, sl2_new, suml2)
            changed |= take
        active &= changed
        if not active.any():
            break
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0.0))
    return np.where(zero, F32(0.0), scale).astype(F32), np.where(zero, 0, levels + nmax)


def _requantize(x, levels, d, offset, lo, hi, add=0):
    """ggml's last pass over sub-blocks whose final scale ``d [s]`` (float32, from the float16 block
    scale times the integer sub-block scale) is not zero: ``nearest_int((x + offset) / d)`` clamped to
    ``lo..hi`` (plus ``add``); other sub-blocks keep ``levels``. ``x``, ``levels`` are ``[m, s]``."""
    num = x if offset is None else x + offset
    new = _clamped(num / d, lo, hi) + add
    return np.where(d != 0, new, levels)


def _affine_k4_encode(values, nmax, rmin, rdelta, nstep):
    """The shared part of Q4_K and Q5_K: ``[n, 256]`` -> ``d``, ``dmin`` f16 bytes, the 12 scale bytes,
    and the levels ``[n, 256]`` (``0..nmax``)."""
    n = len(values)
    x = _columns(values, 32)
    av_x = np.sqrt(seq_sum(x * x, start=0.0) / F32(32.0))
    weights = av_x + np.abs(x)
    scales, mins, levels = _make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad=False)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale, max_min = _positive_max(scales), _positive_max(mins)
    inv_scale = np.where(max_scale > 0, F32(63.0) / np.where(max_scale > 0, max_scale, F32(1.0)), F32(0.0))
    inv_min = np.where(max_min > 0, F32(63.0) / np.where(max_min > 0, max_min, F32(1.0)), F32(0.0))
    ls = np.minimum(63, nearest_int(inv_scale.astype(F32)[:, None] * scales) & 0xFF)
    lm = np.minimum(63, nearest_int(inv_min.astype(F32)[:, None] * mins) & 0xFF)
    packed = np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
                             lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                             (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)], axis=-1).astype(np.uint8)
    d, dmin = max_scale / F32(63.0), max_min / F32(63.0)
    d_sub = (f16_round(d)[:, None] * ls.astype(F32)).reshape(-1)
    m_sub = (f16_round(dmin)[:, None] * lm.astype(F32)).reshape(-1)
    levels = _requantize(x, levels, d_sub, m_sub, 0, nmax)
    head = np.concatenate([f16_bytes(d), f16_bytes(dmin), packed], axis=-1)
    return head, _rows(levels, n)


def _crumb_planes(levels):
    """``int [n, 256]`` 2-bit values -> ``[n, 64]`` bytes of 2-bit planes."""
    q = levels.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _high_bit_mask(levels, bit):
    """``int [n, 256] -> [n, 32]``: bit ``b`` of byte ``j`` is bit ``bit`` of value ``32 b + j``."""
    q = ((levels.reshape(-1, 8, 32) >> bit) & 1).astype(np.uint8)
    return np.bitwise_or.reduce(q << np.arange(8, dtype=np.uint8)[:, None], axis=1)


def _nibble_plane_bytes(levels):
    """``int [n, 256]`` 4-bit values -> ``[n, 128]`` bytes of nibble planes 32 bytes wide."""
    q = levels.reshape(-1, 4, 2, 32)
    return pack_nibbles(q[:, :, 0], q[:, :, 1]).reshape(-1, 128)


class Q2_K(GGMLType, type_id=10, block_size=256, type_size=84):
    @classmethod
    def decode_blocks(cls, blocks):
        scales = u8s(blocks, 0, 16)
        q = _crumbs(u8s(blocks, 16, 64)).astype(mx.float32)
        dl = f16(blocks, 80) * (scales & 0xF).astype(mx.float32)
        ml = f16(blocks, 82) * (scales >> 4).astype(mx.float32)
        return (_per_sub_block(dl, q, 16) - ml[:, :, None]).reshape(-1, QK_K)

    encode_chunk = 1 << 17

    @classmethod
    def encode_blocks(cls, values):
        n = len(values)
        x = _columns(values, 16)
        scales, mins, levels = _make_qkx2_quants(x, np.abs(x), 3, -0.5, 0.1, 15, use_mad=True)
        scales, mins = scales.reshape(n, 16), mins.reshape(n, 16)
        max_scale, max_min = _positive_max(scales), _positive_max(mins)
        has_scale, has_min = (max_scale > 0)[:, None], (max_min > 0)[:, None]
        iscale = F32(15.0) / np.where(max_scale > 0, max_scale, F32(1.0))
        imin = F32(15.0) / np.where(max_min > 0, max_min, F32(1.0))
        sc = np.where(has_scale, nearest_int(iscale[:, None] * scales) & 0xFF, 0)
        sc = sc | np.where(has_min, (nearest_int(imin[:, None] * mins) << 4) & 0xFF, 0)
        d = np.where(max_scale > 0, max_scale / F32(15.0), F32(0.0)).astype(F32)
        dmin = np.where(max_min > 0, max_min / F32(15.0), F32(0.0)).astype(F32)
        d_sub = (f16_round(d)[:, None] * (sc & 0xF).astype(F32)).reshape(-1)
        m_sub = (f16_round(dmin)[:, None] * (sc >> 4).astype(F32)).reshape(-1)
        levels = _rows(_requantize(x, levels, d_sub, m_sub, 0, 3), n)
        return np.concatenate([sc.astype(np.uint8), _crumb_planes(levels), f16_bytes(d), f16_bytes(dmin)],
                              axis=-1)


class Q3_K(GGMLType, type_id=11, block_size=256, type_size=110):
    @classmethod
    def decode_blocks(cls, blocks):
        s = u8s(blocks, 96, 12)
        low = mx.concatenate([s[:, :8] & 0xF, s[:, :8] >> 4], axis=-1)
        high = ((s[:, None, 8:12] >> _PAIR) & 3).reshape(-1, 16)
        dl = f16(blocks, 108) * ((low | (high << 4)).astype(mx.float32) - 32)
        low2 = _crumbs(u8s(blocks, 32, 64)).astype(mx.int32)
        missing = ((_high_bits(u8s(blocks, 0, 32)) ^ 1) << 2).astype(mx.int32)
        q = (low2 - missing).astype(mx.float32)
        return _per_sub_block(dl, q, 16).reshape(-1, QK_K)

    encode_chunk = 1 << 17

    @classmethod
    def encode_blocks(cls, values):
        n = len(values)
        x = _columns(values, 16)
        scales, levels = _make_q3_quants(x, 4)
        scales = scales.reshape(n, 16)
        _, max_scale = first_abs_max(scales, axis=1)
        has = max_scale != 0
        iscale = F32(-32.0) / np.where(has, max_scale, F32(1.0))
        l = nearest_int(iscale[:, None] * scales)
        l = np.clip(((l + 128) & 0xFF) - 128, -32, 31) + 32  # (int8_t), clamped, biased: 0..63
        l = np.where(has[:, None], l, 32)
        high = (l >> 4).reshape(n, 4, 4)  # [group j // 4, j % 4]
        packed = np.concatenate([(l[:, :8] & 0xF) | ((l[:, 8:] & 0xF) << 4),
                                 high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)],
                                axis=-1).astype(np.uint8)
        packed = np.where(has[:, None], packed, 0).astype(np.uint8)
        d = np.where(has, F32(1.0) / iscale, F32(0.0)).astype(F32)
        d_sub = (f16_round(d)[:, None] * (l - 32).astype(F32)).reshape(-1)
        levels = _rows(_requantize(x, levels, d_sub, None, -4, 3, add=4), n)
        return np.concatenate([_high_bit_mask(levels, 2), _crumb_planes(levels & 3), packed, f16_bytes(d)],
                              axis=-1)


class Q4_K(GGMLType, type_id=12, block_size=256, type_size=144):
    @classmethod
    def decode_blocks(cls, blocks):
        sc, mn = _scale_min_k4(u8s(blocks, 4, 12))
        d1 = f16(blocks, 0) * sc.astype(mx.float32)
        m1 = f16(blocks, 2) * mn.astype(mx.float32)
        q = _nibble_planes(u8s(blocks, 16, 128)).astype(mx.float32)
        return (_per_sub_block(d1, q, 32) - m1[:, :, None]).reshape(-1, QK_K)

    encode_chunk = 1 << 17

    @classmethod
    def encode_blocks(cls, values):
        head, levels = _affine_k4_encode(values, 15, -1.0, 0.1, 20)
        return np.concatenate([head, _nibble_plane_bytes(levels)], axis=-1)


class Q5_K(GGMLType, type_id=13, block_size=256, type_size=176):
    @classmethod
    def decode_blocks(cls, blocks):
        sc, mn = _scale_min_k4(u8s(blocks, 4, 12))
        d1 = f16(blocks, 0) * sc.astype(mx.float32)
        m1 = f16(blocks, 2) * mn.astype(mx.float32)
        q = (_nibble_planes(u8s(blocks, 48, 128)) | (_high_bits(u8s(blocks, 16, 32)) << 4)).astype(mx.float32)
        return (_per_sub_block(d1, q, 32) - m1[:, :, None]).reshape(-1, QK_K)

    encode_chunk = 1 << 17

    @classmethod
    def encode_blocks(cls, values):
        head, levels = _affine_k4_encode(values, 31, -0.5, 0.1, 15)
        return np.concatenate([head, _high_bit_mask(levels, 4), _nibble_plane_bytes(levels & 0xF)], axis=-1)


class Q6_K(GGMLType, type_id=14, block_size=256, type_size=210):
    @classmethod
    def decode_blocks(cls, blocks):
        low = _nibble_planes(u8s(blocks, 0, 128), width=64)
        high = _crumbs(u8s(blocks, 128, 64))
        q = (low | (high << 4)).astype(mx.float32) - 32
        dl = f16(blocks, 208) * i8s(blocks, 192, 16)
        return _per_sub_block(dl, q, 16).reshape(-1, QK_K)

    encode_chunk = 1 << 17

    @classmethod
    def encode_blocks(cls, values):
        n = len(values)
        x = _columns(values, 16)
        scales, levels = _make_qx_quants(x, 32)
        scales = scales.reshape(n, 16)
        max_abs, max_scale = first_abs_max(scales, axis=1)
        zero = max_abs < GROUP_MAX_EPS
        iscale = F32(-128.0) / np.where(zero, F32(1.0), max_scale)
        d = np.where(zero, F32(0.0), F32(1.0) / iscale).astype(F32)
        sc = np.minimum(127, nearest_int(iscale[:, None] * scales))
        sc = ((sc + 128) & 0xFF) - 128  # int8_t
        d_sub = (f16_round(d)[:, None] * sc.astype(F32)).reshape(-1)
        levels = _rows(_requantize(x, levels, d_sub, None, -32, 31, add=32), n)
        q = levels.reshape(n, 2, 4, 32)
        ql = np.concatenate([pack_nibbles(q[:, :, 0], q[:, :, 2]), pack_nibbles(q[:, :, 1], q[:, :, 3])],
                            axis=-1).reshape(n, 128)
        qh = _crumb_planes(levels >> 4)
        out = np.concatenate([ql, qh, (sc & 0xFF).astype(np.uint8), f16_bytes(d)], axis=-1)
        out[zero] = 0
        return out

"""Normalisation layers: `RMSNorm`, `LayerNorm`, `GatedRMSNorm`, `GroupedGatedRMSNorm`."""

from __future__ import annotations

import mlx.core as mx

from .. import functional as F
from ..data import Data
from .base import Layer

#: the right call for mlx.nn's ``RMSNorm(dims, eps)``
_NORM_HINT = "{cls}({dims}, eps={extra[0]})"
from .linear import float_dtype


class _Norm(Layer):
    """Shared construction: a per-feature gain (and bias) over the W axis, created now when ``dims``
    is given, else at the first compile."""

    fixed_axes = ("W",)
    has_bias = False

    def __init__(self, dims, eps, affine, bias, dtype, offset=0.0):
        super().__init__()
        name = type(self).__name__
        self.offset = float(offset)
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims <= 0):
            raise ValueError(f"{name}: dims must be a positive int (the feature width), got {dims!r}")
        if not eps > 0:
            raise ValueError(f"{name}: eps must be positive, got {eps!r}")
        self.eps = float(eps)
        self.affine = bool(affine)
        self.use_bias = bool(bias) and self.has_bias
        self._dtype = dtype
        if dims is not None:
            self._create(int(dims), dtype or mx.float32)
            self.mark_built((int(dims), 1, 1))

    def _create(self, width, dtype):
        if self.affine:  # the gain starts at 1 (stored as 1 - offset)
            self.weight = mx.full((width,), 1.0 - self.offset, dtype=dtype)
            if self.use_bias:
                self.bias = mx.zeros((width,), dtype=dtype)

    def build(self, device, dims, dtype):
        self._create(dims.W, self._dtype or float_dtype(dtype))


class RMSNorm(_Norm):
    """``x / sqrt(mean(x^2) + eps) * (offset + weight)`` over the W axis (as ``mlx.nn.RMSNorm``
    when ``offset`` is 0).

    Args:
        dims: feature width (optional: taken from the first input when not given).
        eps: added to the mean square.
        affine: learn the per-feature gain ``weight[dims]``, as Llama does; ``False`` gives the
            gain-free form.
        offset: added to ``weight`` to form the gain. ``offset=1`` is the zero-centred convention of
            Qwen3-Next, Qwen3.5 and Gemma (``x_hat * (1 + weight)``, weight starting at zeros); the
            normalisation and gain are then computed in float32 and cast back, as transformers does.
            With ``offset=0`` (default) the weight starts at ones.
        dtype: parameter dtype.
    """

    positional_hint = _NORM_HINT

    def __init__(self, dims: int | None = None, *, eps: float = 1e-5, affine: bool = True, offset: float = 0.0,
                 dtype=None):
        super().__init__(dims, eps, affine, False, dtype, offset=offset)

    def forward(self, device, data):
        x = data.array
        if not self.affine:
            return Data(F.rms_norm(x, None, self.eps, device=device), data.dims)
        if not self.offset:
            return Data(F.rms_norm(x, self.weight, self.eps, device=device), data.dims)
        gain = self.weight.astype(mx.float32) + self.offset
        y = F.rms_norm(x.astype(mx.float32), gain, self.eps, device=device)
        return Data(y.astype(x.dtype), data.dims)

    def _extra_repr(self):
        return f"eps={self.eps}, offset={self.offset}" if self.offset else f"eps={self.eps}"


class LayerNorm(_Norm):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the W axis (as ``mlx.nn.LayerNorm``).

    Args:
        dims: feature width (optional: taken from the first input when not given).
        eps: added to the variance.
        affine: learn ``weight`` (ones) and ``bias`` (zeros).
        bias: learn the bias when ``affine`` (some models use a gain only).
        dtype: parameter dtype.
    """

    has_bias = True
    positional_hint = _NORM_HINT

    def __init__(self, dims: int | None = None, *, eps: float = 1e-5, affine: bool = True, bias: bool = True,
                 dtype=None):
        super().__init__(dims, eps, affine, bias, dtype)

    def forward(self, device, data):
        w = self.weight if self.affine else None
        b = self.bias if self.use_bias and self.affine else None
        return Data(F.layer_norm(data.array, w, b, self.eps, device=device), data.dims)


class GatedRMSNorm(_Norm):
    """``rms_norm(x) * weight * silu(gate)``: the output norm of Gated DeltaNet layers.

    ``compile(device, data, gate=g)`` with ``g`` an array of the input's shape (``[..., W]``); the
    normalisation is over W (a value head). The gate is applied in float32, as Qwen3-Next does.

    Args:
        dims: feature width (optional: taken from the first input when not given).
        eps: added to the mean square.
        dtype: parameter dtype.
    """

    positional_hint = _NORM_HINT

    def __init__(self, dims: int | None = None, *, eps: float = 1e-6, dtype=None):
        super().__init__(dims, eps, True, False, dtype)

    def forward(self, device, data, gate=None):
        if gate is None:
            raise TypeError(f"{self._describe()}: needs gate= (an array of the input's shape)")
        x = data.array
        self.require(tuple(gate.shape) == tuple(x.shape) or gate.size == x.size, f"gate of {x.size} elements",
                     f"gate of shape {tuple(gate.shape)}")
        y = F.rms_norm(x, self.weight, self.eps, device=device)
        gate = F.activation(gate.reshape(x.shape).astype(mx.float32), "silu", device=device)
        y = (y.astype(mx.float32) * gate).astype(x.dtype)
        return Data(y, data.dims)


class GroupedGatedRMSNorm(_Norm):
    """``rms_norm(x * silu(gate))`` over groups of ``group_size`` features, times ``weight``: the
    output norm of Mamba2 layers (``RMSNormGated`` with ``norm_before_gate=False``; the gate is
    applied before the normalisation, unlike `GatedRMSNorm`).

    ``compile(device, data, gate=g)`` with ``g`` an array of the input's shape (``[..., W]``); W is
    cut into ``W // group_size`` groups, each normalised on its own. Computed in float32 and cast
    back to the input's dtype before the gain, as transformers does.

    Args:
        dims: feature width (optional: taken from the first input when not given).
        group_size: features per normalised group (default: all of W).
        eps: added to the mean square.
        dtype: parameter dtype.
    """

    positional_hint = _NORM_HINT

    def __init__(self, dims: int | None = None, *, group_size: int | None = None, eps: float = 1e-6, dtype=None):
        super().__init__(dims, eps, True, False, dtype)
        if group_size is not None and (dims is not None and (group_size <= 0 or dims % group_size)):
            raise ValueError(f"GroupedGatedRMSNorm: group_size must divide dims = {dims}, got {group_size}")
        self.group_size = None if group_size is None else int(group_size)

    def forward(self, device, data, gate=None):
        if gate is None:
            raise TypeError(f"{self._describe()}: needs gate= (an array of the input's shape)")
        x = data.array
        w = x.shape[-1]
        gs = self.group_size or w
        self.require(w % gs == 0, f"a width divisible by group_size={gs}", f"width {w}")
        self.require(tuple(gate.shape) == tuple(x.shape), f"gate of shape {tuple(x.shape)}",
                     f"gate of shape {tuple(gate.shape)}")
        h = x.astype(mx.float32) * F.activation(gate.astype(mx.float32), "silu", device=device)
        h = F.rms_norm(h.reshape(*x.shape[:-1], w // gs, gs), None, self.eps, device=device).reshape(x.shape)
        return Data(self.weight * h.astype(x.dtype), data.dims)

    def _extra_repr(self):
        return f"eps={self.eps}, group_size={self.group_size}"

"""`ShortConv`: the gated short-convolution token mixer of LFM2, with its decoding cache
`ShortConvCache`.

Input and output ``Data`` dims are ``(W=hidden, H=positions, D=batch)`` (a plain array
``[B, T, hidden]``). With ``C = hidden``::

    B, Cg, x = split(in_proj(x), 3)          # in_proj.weight [3C, C]: the B gate, the C gate, x
    y = out_proj(Cg * conv(B * x))           # conv: causal depthwise convolution of width L

``conv.weight`` is ``[C, 1, L]`` (``torch.nn.Conv1d`` with ``groups=C``): position ``t`` sees the
gated inputs of positions ``t - L + 1 .. t`` (zeros before the first). ``bias=True`` (the config's
``conv_bias``) gives all three of ``in_proj``, ``conv`` and ``out_proj`` a bias, as transformers'
``Lfm2ShortConv``. The convolution is a `Conv1D` (``metalnn.functional.conv``, with its Metal kernels)
over the inputs with the previous ``L - 1`` ones in front; no activation follows it.

For decoding pass a `ShortConvCache` to ``compile(device, data, cache=...)``: it keeps the last
``L - 1`` gated inputs ``[B, L - 1, C]``, so a new token costs one projection and one ``L``-wide
dot product per channel.
"""

from __future__ import annotations

from ..data import Data, MTLSize
from .base import Layer
from .conv import Conv1D, causal_conv
from .linear import Linear, float_dtype
from .state_cache import StateCache


class ShortConvCache(StateCache):
    """Decoding state of one `ShortConv`: ``conv_state`` ``[B, L - 1, C]``, the last ``L - 1`` gated
    convolution inputs ``B * x`` (zeros where the sequence had fewer tokens)."""

    fields = ("conv_state",)


class ShortConv(Layer):
    """LFM2's gated short convolution (see the module docstring).

    Args:
        kernel_size: the convolution's width ``L`` (transformers' ``conv_L_cache``).
        bias: biases on ``in_proj``, ``conv`` and ``out_proj`` (``conv_bias``).
        init: initializer of the two projections (default `Linear`'s).
        dtype: parameter dtype.
    """

    fixed_axes = ("W",)
    positional_hint = "{cls}({kernel_size}, bias=...)"

    def __init__(self, kernel_size: int = 3, *, bias: bool = False, init=None, dtype=None):
        super().__init__()
        if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1:
            raise ValueError(f"ShortConv: kernel_size must be a positive int, got {kernel_size!r}")
        self.kernel_size = int(kernel_size)
        self.use_bias = bool(bias)
        self._init, self._dtype = init, dtype

    def build(self, device, dims, dtype):
        dtype = self._dtype or float_dtype(dtype)
        c = dims.W
        kw = dict(bias=self.use_bias, init=self._init, dtype=dtype)
        self.in_proj = Linear(3 * c, **kw)
        self.conv = Conv1D(c, self.kernel_size, groups=c, bias=self.use_bias, dtype=dtype)
        self.out_proj = Linear(c, **kw)

    def forward(self, device, data, cache=None):
        d = data.dims
        b, t, c = d.D, d.H, d.W
        bcx = self.compile_child(self.in_proj, device, data).array.reshape(b, t, 3 * c)
        gate_b, gate_c, x = bcx[..., :c], bcx[..., c:2 * c], bcx[..., 2 * c:]
        bx = gate_b * x
        y = causal_conv(self, device, self.conv, bx, cache, self.kernel_size - 1)   # [B, T, C]
        if cache is not None:
            cache.offset += t
        y = gate_c * y
        return self.compile_child(self.out_proj, device, Data(y, MTLSize(c, t, b)))

    def _extra_repr(self):
        return f"kernel_size={self.kernel_size}" + (", bias=True" if self.use_bias else "")

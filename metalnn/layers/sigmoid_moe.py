"""DeepSeek-V3's mixture of experts: `SigmoidRouter` (sigmoid scores and a bias used for the choice
only) and `GroupLimitedMoE` (group-limited top-k routing, scaled weights, always-on shared experts).

Routing of a token with router logits ``l = gate.weight @ x`` (in float32), as transformers'
``DeepseekV3TopkRouter``:

1. scores ``s = sigmoid(l)`` ``[E]``; the choice uses ``s + e_score_correction_bias``;
2. the E experts form ``n_group`` groups of consecutive experts; a group's score is the sum of its
   two best choice scores; only the experts of the ``topk_group`` best groups can be picked;
3. the ``top_k`` best choice scores among them pick the experts; their weights are the plain scores
   ``s`` (without the bias), renormalised to sum to 1 when ``norm_topk_prob``, then multiplied by
   ``routed_scaling_factor``.

Names follow Hugging Face's DeepSeek-V3: ``gate.weight`` ``[E, W]``, ``gate.e_score_correction_bias``
``[E]``, ``experts.gate_up_proj`` ``[E, 2*I, W]``, ``experts.down_proj`` ``[E, W, I]`` and the shared
`SwiGLU` ``shared_experts.{gate,up,down}_proj`` (no gate of its own: its output is always added).
"""

from __future__ import annotations

import mlx.core as mx

from .. import init as initializers
from ..data import Data, MTLSize
from .base import Layer
from .linear import float_dtype
from .mlp import SwiGLU
from .moe import SparseMoE


class SigmoidRouter(Layer):
    """The router: logits ``x @ weight.T`` in float32, ``[N, E]`` for rows ``[N, W]``.

    Parameters: ``weight`` ``[E, W]`` and ``e_score_correction_bias`` ``[E]`` (zeros at first). The
    bias only steers the choice of experts (`GroupLimitedMoE.route`, no gradient reaches it: a
    checkpoint's value, adjusted by DeepSeek's training outside the loss).

    Args:
        num_experts: E.
        init: initializer of ``weight`` (default N(0, 0.02)).
        dtype: dtype of ``weight`` (the bias is float32, as transformers keeps both).
    """

    fixed_axes = ("W",)

    positional_hint = "{cls}({num_experts})"

    def __init__(self, num_experts: int, *, init=None, dtype=None):
        super().__init__()
        self.num_experts = int(num_experts)
        self._init = initializers.get(init, initializers.Normal(0.02))
        self._dtype = dtype

    def build(self, device, dims, dtype):
        dtype = self._dtype or float_dtype(dtype)
        self.weight = self._init((self.num_experts, dims.W), dims.W, self.num_experts, device.next_key(), dtype)
        self.e_score_correction_bias = mx.zeros((self.num_experts,), mx.float32)

    def forward(self, device, data):
        x = data.array.reshape(-1, data.dims.W).astype(mx.float32)
        logits = x @ self.weight.astype(mx.float32).T
        return Data(logits, MTLSize(self.num_experts, 1, logits.shape[0]))

    def _extra_repr(self):
        return f"num_experts={self.num_experts}"


class GroupLimitedMoE(SparseMoE):
    """DeepSeek-V3's sparse feed-forward block (see the module docstring): ``sum_j w_j * expert_j(x)
    + shared_experts(x)``.

    Input and output dims ``(W=dims, H, D)``. Gradients reach the router through the weights ``w``.

    Args:
        num_experts: routed experts E (``n_routed_experts``).
        top_k: experts per token (``num_experts_per_tok``).
        hidden_dims: hidden width of each expert (``moe_intermediate_size``).
        n_group, topk_group: groups of experts and how many of them a token may pick from; E must
            be a multiple of ``n_group`` with at least 2 experts a group, and ``top_k`` at most the
            experts of ``topk_group`` groups.
        norm_topk_prob: renormalise the chosen scores.
        routed_scaling_factor: multiplies the weights.
        shared_dims: hidden width of the shared `SwiGLU` (``moe_intermediate_size * n_shared_experts``);
            0 or None: none.
        activation: the experts' gate activation (``silu``).
        init: initializer of the router and the experts (default N(0, 0.02)).
        dtype: parameter dtype.
    """

    positional_hint = "{cls}({num_experts}, {top_k}, {hidden_dims}, n_group=..., topk_group=...)"

    def __init__(self, num_experts: int, top_k: int, hidden_dims: int, *, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, shared_dims: int | None = None,
                 activation: str = "silu", init=None, dtype=None):
        super().__init__(num_experts, top_k, hidden_dims, norm_topk_prob=norm_topk_prob, activation=activation,
                         init=init, dtype=dtype)
        e, g = self.num_experts, int(n_group)
        if g <= 0 or e % g or e // g < 2:
            raise ValueError(f"GroupLimitedMoE: num_experts ({e}) must be a multiple of n_group ({n_group}) with at "
                             "least 2 experts a group")
        if not 0 < int(topk_group) <= g:
            raise ValueError(f"GroupLimitedMoE: topk_group must be in [1, n_group={g}], got {topk_group}")
        if self.top_k > int(topk_group) * (e // g):
            raise ValueError(f"GroupLimitedMoE: top_k ({self.top_k}) exceeds the {int(topk_group) * (e // g)} experts "
                             f"of topk_group={topk_group} groups of {e // g}")
        self.n_group, self.topk_group = g, int(topk_group)
        self.routed_scaling_factor = float(routed_scaling_factor)
        init = initializers.get(init, initializers.Normal(0.02))
        self.gate = SigmoidRouter(e, init=init, dtype=dtype)
        if shared_dims:
            self.shared_experts = SwiGLU(int(shared_dims), activation=activation, init=init, init_out=init,
                                         dtype=dtype)

    def route(self, logits):
        """``(weights [N, k], expert ids [N, k])`` from router logits ``[N, E]``; weights in float32."""
        scores = mx.sigmoid(logits.astype(mx.float32))
        choice = mx.stop_gradient(scores) + self.gate.e_score_correction_bias
        n, e, g = choice.shape[0], self.num_experts, self.n_group
        if self.topk_group < g:
            grouped = choice.reshape(n, g, e // g)
            group_scores = mx.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)                  # [N, G]
            best = mx.argpartition(-group_scores, kth=self.topk_group - 1, axis=-1)[:, :self.topk_group]
            keep = (best[:, :, None] == mx.arange(g)[None, None, :]).any(axis=1)          # [N, G]
            choice = mx.where(keep[:, :, None], grouped, -mx.inf).reshape(n, e)
        k = self.top_k
        ids = mx.stop_gradient(mx.argpartition(-choice, kth=k - 1, axis=-1)[:, :k])
        weights = mx.take_along_axis(scores, ids, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids

    def shared_output(self, device, rows):
        """``shared_experts(x)`` ``[N, W]`` for token ``rows`` (no gate: always added); None without them.
        The rest of the forward pass is `SparseMoE`'s, with this class's `route`."""
        if "shared_experts" not in self:
            return None
        return self.compile_child(self.shared_experts, device, rows).array.reshape(-1, rows.dims.W)

    def _extra_repr(self):
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, n_group={self.n_group}, "
                f"topk_group={self.topk_group}, norm_topk_prob={self.norm_topk_prob}, "
                f"routed_scaling_factor={self.routed_scaling_factor}, shared_experts={'shared_experts' in self}")

"""Sparse mixture of experts: `SwitchGLU` (many gated MLPs in stacked weights), `ClampedSwitchGLU`
(gpt-oss's experts: biases and a clamped SwiGLU), `SwitchMLP` (ungated experts, Nemotron-H's), all three
sharing `_ExpertBank`'s per-(token, expert) dispatch, `SparseMoE` (router with top-k routing, experts,
optional shared expert) and `load_balancing_loss`.

The experts run as grouped matrix products (``mx.gather_mm``): each token multiplies only the
weights of the experts it was routed to, with no loop over experts. Names follow Hugging Face's
Qwen3-Next (and Qwen2-MoE / Qwen3-MoE in transformers 5): ``gate.weight`` (router ``[E, W]``),
``experts.gate_up_proj`` ``[E, 2*I, W]``, ``experts.down_proj`` ``[E, W, I]``, ``shared_expert.*``
and ``shared_expert_gate.weight`` ``[1, W]``.
"""

from __future__ import annotations

import mlx.core as mx

from .. import functional as F
from .. import init as initializers
from ..data import Data, MTLSize
from .base import Layer
from .linear import Linear, float_dtype
from .mlp import SwiGLU

#: Sort the (token, expert) pairs by expert before the grouped products from this many pairs on.
SORT_FROM = 64


class _ExpertBank(Layer):
    """What `SwitchGLU`, `ClampedSwitchGLU` and `SwitchMLP` share: the size checks and the per-(token, expert)
    dispatch around their expert bodies.

    ``compile(device, data, indices=idx)`` with ``data`` a `Data` of token rows ``[N, W]`` (dims
    ``(W, 1, N)``) and ``idx`` ``[N, k]`` expert ids gives `Data` ``[N, k, W]`` (dims ``(W, k, N)``).
    From `SORT_FROM` pairs on, the pairs are sorted by expert before the grouped products and put back
    in order after them. Subclasses build their weights and implement `expert_outputs`.
    """

    fixed_axes = ("W",)

    def __init__(self, num_experts: int, hidden_dims: int, *, init=None, dtype=None):
        super().__init__()
        if num_experts <= 0 or hidden_dims <= 0:
            raise ValueError(f"{type(self).__name__}: num_experts and hidden_dims must be positive, got "
                             f"{num_experts}, {hidden_dims}")
        self.num_experts = int(num_experts)
        self.hidden_dims = int(hidden_dims)
        self._init = initializers.get(init, initializers.Normal(0.02))
        self._dtype = dtype

    def expert_outputs(self, device, xe, idx, sorted_indices: bool):
        """The experts' outputs ``[..., 1, W]`` for rows ``xe`` (``[N*k, 1, W]`` against sorted ids ``idx``
        ``[N*k]``, or ``[N, 1, 1, W]`` against ids ``[N, k]``), as ``F.gather_matmul`` pairs them."""
        raise NotImplementedError

    def forward(self, device, data, indices=None):
        if indices is None:
            raise TypeError(f"{self._describe()}: needs indices= (expert ids [N, k])")
        x = data.array.reshape(-1, data.dims.W)
        n, k = indices.shape
        self.require(n == x.shape[0], f"indices for {x.shape[0]} rows", f"indices of shape {tuple(indices.shape)}")
        idx = mx.stop_gradient(indices)
        order = None
        if idx.size >= SORT_FROM:  # group the (token, expert) pairs by expert: contiguous weight reads
            flat = idx.flatten()
            order = mx.argsort(flat)
            xe = x[order // k][:, None, :]                               # [N*k, 1, W]
            idx = flat[order]                                            # [N*k]
        else:
            xe = x[:, None, None, :]                                     # [N, 1, 1, W] against idx [N, k]
        y = self.expert_outputs(device, xe, idx, order is not None)             # [..., 1, W]
        if order is not None:
            y = y[mx.argsort(order)].reshape(n, k, -1)
        else:
            y = y.reshape(n, k, -1)
        return Data(y, MTLSize(x.shape[-1], k, n))


class SwitchGLU(_ExpertBank):
    """``num_experts`` gated MLPs ``down_proj[e](act(gate[e] x) * up[e] x)`` applied per (token, expert) pair.

    ``compile(device, data, indices=idx)`` with ``data`` a `Data` of token rows ``[N, W]`` (dims
    ``(W, 1, N)``) and ``idx`` ``[N, k]`` expert ids gives `Data` ``[N, k, W]`` (dims ``(W, k, N)``):
    row ``n``'s output through each of its ``k`` experts.

    Parameters: ``gate_up_proj`` ``[E, 2*hidden, W]`` (gate rows then up rows of each expert) and
    ``down_proj`` ``[E, W, hidden]``.

    Args:
        num_experts: number of experts E.
        hidden_dims: hidden width of one expert (``moe_intermediate_size``).
        activation: the gate's activation (``silu``).
        init: initializer of both weights (default: N(0, 0.02), transformers' expert init).
        dtype: parameter dtype.
    """

    positional_hint = "{cls}({num_experts}, {hidden_dims}, activation=...)"

    def __init__(self, num_experts: int, hidden_dims: int, *, activation: str = "silu", init=None,
                 dtype=None):
        super().__init__(num_experts, hidden_dims, init=init, dtype=dtype)
        self.activation = F.check_activation(activation)

    def build(self, device, dims, dtype):
        dtype = self._dtype or float_dtype(dtype)
        e, h, w = self.num_experts, self.hidden_dims, dims.W
        self.gate_up_proj = self._init((e, 2 * h, w), w, 2 * h, device.next_key(), dtype)
        self.down_proj = self._init((e, w, h), h, w, device.next_key(), dtype)

    def expert_outputs(self, device, xe, idx, sorted_indices):
        h = F.gather_matmul(xe, self.gate_up_proj, idx, sorted_indices)
        gate, up = h[..., :self.hidden_dims], h[..., self.hidden_dims:]
        act = F.activation(gate, self.activation, device=device)
        return F.gather_matmul(act * up, self.down_proj, idx, sorted_indices)              # [..., 1, W]

    def _extra_repr(self):
        return f"num_experts={self.num_experts}, hidden_dims={self.hidden_dims}, activation={self.activation!r}"


class ClampedSwitchGLU(_ExpertBank):
    """gpt-oss's experts: ``num_experts`` biased gated MLPs with a clamped SwiGLU, per (token, expert) pair.

    For a token ``x`` and expert ``e``: ``h = x @ gate_up_proj[e] + gate_up_proj_bias[e]`` (``[2*hidden]``,
    gate and up interleaved: even entries gate, odd entries up), ``g = min(gate, limit)``,
    ``u = clip(up, -limit, limit)``, ``y = ((u + 1) * g * sigmoid(alpha * g)) @ down_proj[e] + down_proj_bias[e]``.

    Called as `SwitchGLU` (``compile(device, data, indices=idx)``: rows ``[N, W]``, ids ``[N, k]`` ->
    ``[N, k, W]``). Parameters in transformers' ``GptOssExperts`` layout (input-major):
    ``gate_up_proj`` ``[E, W, 2*hidden]``, ``gate_up_proj_bias`` ``[E, 2*hidden]``, ``down_proj``
    ``[E, hidden, W]``, ``down_proj_bias`` ``[E, W]``.

    Args:
        num_experts: number of experts E.
        hidden_dims: hidden width of one expert (gpt-oss's ``intermediate_size``).
        alpha: the sigmoid's gain (``swiglu_alpha``, 1.702).
        limit: the clamp (``swiglu_limit``, 7.0).
        init: initializer of both weights (default: N(0, 0.02), transformers' init); biases start at 0.
        dtype: parameter dtype.
    """

    positional_hint = "{cls}({num_experts}, {hidden_dims}, alpha=..., limit=...)"

    def __init__(self, num_experts: int, hidden_dims: int, *, alpha: float = 1.702, limit: float = 7.0, init=None,
                 dtype=None):
        super().__init__(num_experts, hidden_dims, init=init, dtype=dtype)
        if not limit > 0:
            raise ValueError(f"ClampedSwitchGLU: limit must be positive, got {limit!r}")
        self.alpha = float(alpha)
        self.limit = float(limit)

    def build(self, device, dims, dtype):
        dtype = self._dtype or float_dtype(dtype)
        e, h, w = self.num_experts, self.hidden_dims, dims.W
        self.gate_up_proj = self._init((e, w, 2 * h), w, 2 * h, device.next_key(), dtype)
        self.gate_up_proj_bias = mx.zeros((e, 2 * h), dtype)
        self.down_proj = self._init((e, h, w), h, w, device.next_key(), dtype)
        self.down_proj_bias = mx.zeros((e, w), dtype)

    def expert_outputs(self, device, xe, idx, sorted_indices):
        # (gather_matmul multiplies by the transpose of [E, out, in] weights: hand it the transposed views)
        h = F.gather_matmul(xe, self.gate_up_proj.swapaxes(-1, -2), idx, sorted_indices)
        h = h + self.gate_up_proj_bias[idx][..., None, :]
        gate = mx.minimum(h[..., ::2], self.limit)
        up = mx.clip(h[..., 1::2], -self.limit, self.limit)
        act = (up + 1) * (gate * mx.sigmoid(self.alpha * gate))
        y = F.gather_matmul(act, self.down_proj.swapaxes(-1, -2), idx, sorted_indices)      # [..., 1, W]
        return y + self.down_proj_bias[idx][..., None, :]

    def _extra_repr(self):
        return (f"num_experts={self.num_experts}, hidden_dims={self.hidden_dims}, alpha={self.alpha:g}, "
                f"limit={self.limit:g}")


class SwitchMLP(_ExpertBank):
    """``num_experts`` plain (ungated) MLPs ``down_proj[e](act(up_proj[e] x))`` applied per (token,
    expert) pair (Nemotron-H's experts, squared ReLU).

    Called as `SwitchGLU` (``compile(device, data, indices=idx)``: rows ``[N, W]``, ids ``[N, k]`` ->
    ``[N, k, W]``). Parameters in transformers' ``NemotronHExperts`` layout: ``up_proj``
    ``[E, hidden, W]`` and ``down_proj`` ``[E, W, hidden]``.

    Args:
        num_experts: number of experts E.
        hidden_dims: hidden width of one expert (``moe_intermediate_size``).
        activation: the activation between the projections (``relu2``).
        init: initializer of both weights (default: N(0, 0.02), transformers' expert init).
        dtype: parameter dtype.
    """

    positional_hint = "{cls}({num_experts}, {hidden_dims}, activation=...)"

    def __init__(self, num_experts: int, hidden_dims: int, *, activation: str = "relu2", init=None, dtype=None):
        super().__init__(num_experts, hidden_dims, init=init, dtype=dtype)
        self.activation = F.check_activation(activation)

    def build(self, device, dims, dtype):
        dtype = self._dtype or float_dtype(dtype)
        e, h, w = self.num_experts, self.hidden_dims, dims.W
        self.up_proj = self._init((e, h, w), w, h, device.next_key(), dtype)
        self.down_proj = self._init((e, w, h), h, w, device.next_key(), dtype)

    def expert_outputs(self, device, xe, idx, sorted_indices):
        h = F.activation(F.gather_matmul(xe, self.up_proj, idx, sorted_indices), self.activation, device=device)
        return F.gather_matmul(h, self.down_proj, idx, sorted_indices)                     # [..., 1, W]

    def _extra_repr(self):
        return f"num_experts={self.num_experts}, hidden_dims={self.hidden_dims}, activation={self.activation!r}"


class RouterRecord:
    """The router logits of a `SparseMoE`'s most recent call (kept outside the module's parameter
    tree, so it never enters ``parameters()``, checkpoints or compiled state)."""

    def __init__(self):
        self.logits = None

    def __repr__(self):
        return f"RouterRecord({None if self.logits is None else tuple(self.logits.shape)})"


class SparseMoE(Layer):
    """A sparse mixture-of-experts feed-forward block with top-k routing (Qwen3-Next's).

    For each token ``x``: ``p = softmax(gate(x))`` over the experts; the ``top_k`` largest
    probabilities pick the experts (renormalised to sum to 1 when ``norm_topk_prob``), and the output
    is ``sum_j p_j * expert_j(x)``, plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` when
    there is a shared expert. Gradients reach the router through the routing weights (the choice of
    experts itself is not differentiable).

    With ``record_router_logits`` the router logits of the most recent call are kept in
    ``router_logits`` (``[tokens, E]``) for the auxiliary `load_balancing_loss`; read them inside
    the loss function and call ``forget_router_logits()`` afterwards, so that the array (and the
    graph behind it) is not held until the next call.

    Args:
        num_experts: number of routed experts E.
        top_k: experts per token (``num_experts_per_tok``).
        hidden_dims: hidden width of each expert (``moe_intermediate_size``).
        norm_topk_prob: renormalise the selected probabilities.
        shared_expert_dims: hidden width of the shared `SwiGLU` expert (None: no shared expert).
        activation: the experts' gate activation (``silu``).
        record_router_logits: keep the router logits of each call (see above).
        router_bias: a bias on the router (``gate.bias`` ``[E]``; gpt-oss's).
        experts: the experts layer, called as `SwitchGLU` (default: a `SwitchGLU` of ``hidden_dims``
            with ``activation``; gpt-oss passes a `ClampedSwitchGLU`).
        init: initializer of the router, the experts and the shared expert (default: N(0, 0.02)).
        dtype: parameter dtype.
    """

    fixed_axes = ("W",)

    positional_hint = "{cls}({num_experts}, {top_k}, {hidden_dims}, norm_topk_prob=...)"

    def __init__(self, num_experts: int, top_k: int, hidden_dims: int, *, norm_topk_prob: bool = True,
                 shared_expert_dims: int | None = None, activation: str = "silu", record_router_logits: bool = False,
                 router_bias: bool = False, experts: Layer | None = None, init=None, dtype=None):
        super().__init__()
        if not 0 < int(top_k) <= int(num_experts):
            raise ValueError(f"SparseMoE: top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.norm_topk_prob = bool(norm_topk_prob)
        init = initializers.get(init, initializers.Normal(0.02))
        self.gate = Linear(self.num_experts, bias=bool(router_bias), init=init, bias_init=init if router_bias else None,
                           dtype=dtype)
        self.experts = (experts if experts is not None
                        else SwitchGLU(self.num_experts, hidden_dims, activation=activation, init=init, dtype=dtype))
        if shared_expert_dims:
            self.shared_expert = SwiGLU(int(shared_expert_dims), activation=activation, init=init, init_out=init,
                                        dtype=dtype)
            self.shared_expert_gate = Linear(1, bias=False, init=init, dtype=dtype)
        self.record_router_logits = bool(record_router_logits)
        self._record = RouterRecord()

    @property
    def router_logits(self):
        """Router logits ``[tokens, E]`` of the most recent call (None unless ``record_router_logits``)."""
        return self._record.logits

    def forget_router_logits(self):
        self._record.logits = None

    def route(self, logits):
        """``(weights [N, k], expert ids [N, k])`` from router logits ``[N, E]``; weights in float32."""
        probs = mx.softmax(logits.astype(mx.float32), axis=-1)
        k = self.top_k
        ids = mx.stop_gradient(mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k])
        weights = mx.take_along_axis(probs, ids, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        return weights, ids

    def forward(self, device, data):
        d = data.dims
        x = data.array.reshape(-1, d.W)
        rows = Data(x, MTLSize(d.W, 1, x.shape[0]))
        logits = self.compile_child(self.gate, device, rows).array.reshape(-1, self.num_experts)
        if self.record_router_logits:
            self._record.logits = logits
        weights, ids = self.route(logits)
        y = self.compile_child(self.experts, device, rows, indices=ids).array     # [N, k, W]
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=1)
        shared = self.shared_output(device, rows)
        if shared is not None:
            y = y + shared
        return Data(y.reshape(data.array.shape[:-1] + (d.W,)), d)

    def shared_output(self, device, rows):
        """The always-on term added to the routed experts' output for token ``rows`` (dims ``(W, 1, N)``):
        ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` ``[N, W]``; None without a shared expert."""
        if "shared_expert" not in self:
            return None
        w = rows.dims.W
        s = self.compile_child(self.shared_expert, device, rows).array.reshape(-1, w)
        g = self.compile_child(self.shared_expert_gate, device, rows).array.reshape(-1, 1)
        return F.activation(g, "sigmoid", device=device) * s

    def _extra_repr(self):
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}, "
                f"shared_expert={'shared_expert' in self}")


def load_balancing_loss(router_logits, num_experts: int, top_k: int):
    """The auxiliary load-balancing loss of Switch Transformer, as transformers computes it.

    ``E * sum_e f_e * P_e`` where, over all tokens of all given layers, ``f_e`` is the number of
    top-k selections of expert ``e`` per token and ``P_e`` the mean router probability of ``e``.
    It is ``top_k`` for perfectly balanced routing and grows as routing concentrates. Differentiable
    in the logits through ``P``.

    Args:
        router_logits: a list of ``[tokens, E]`` arrays (one per MoE layer) or one array.
        num_experts: E.
        top_k: experts per token.
    Returns:
        a scalar float32 array.
    """
    if isinstance(router_logits, mx.array):
        router_logits = [router_logits]
    if not router_logits:
        raise ValueError("load_balancing_loss: no router logits (run the model on some tokens first)")
    logits = mx.concatenate([lg.reshape(-1, num_experts) for lg in router_logits], axis=0).astype(mx.float32)
    probs = mx.softmax(logits, axis=-1)
    chosen = mx.argpartition(-mx.stop_gradient(probs), kth=top_k - 1, axis=-1)[:, :top_k]
    counts = (chosen[..., None] == mx.arange(num_experts)).astype(mx.float32).sum(axis=(0, 1))
    rows = logits.shape[0]
    return num_experts * mx.sum((counts / rows) * (probs.sum(axis=0) / rows))

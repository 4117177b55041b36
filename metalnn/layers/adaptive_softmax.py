"""`AdaptiveSoftmax`: the adaptive softmax of Grave et al. (2017), as PyTorch's
``torch.nn.AdaptiveLogSoftmaxWithLoss`` defines it.

Frequent classes (``[0, cutoffs[0])``) are scored by a head projection that also scores one entry
per tail cluster; the rarer classes of cluster ``i`` (``[cutoffs[i], cutoffs[i+1])``) are scored
through a reduced projection of width ``in_features // div_value**(i+1)``. Parameter names equal
PyTorch's state dict (``head.weight``, ``head.bias``, ``tail.<i>.0.weight``, ``tail.<i>.1.weight``),
so ``layer.load_weights([(k, mx.array(v.numpy())) for k, v in torch_layer.state_dict().items()])``
takes PyTorch's weights.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ..data import Data, MTLSize
from .base import Layer
from .linear import Linear


class AdaptiveSoftmaxOutput(NamedTuple):
    """``output``: the log-probability of each target ``[N]``; ``loss``: their negated mean."""

    output: mx.array
    loss: mx.array


class AdaptiveSoftmax(Layer):
    """Adaptive log-softmax over ``n_classes`` classes of ``[N, in_features]`` inputs.

    Args:
        in_features: input width.
        n_classes: number of classes.
        cutoffs: increasing class boundaries, ``0 < cutoffs[0] < ... < n_classes`` (the head holds
            the classes below ``cutoffs[0]``).
        div_value: the width of tail cluster ``i``'s projection is ``in_features // div_value**(i+1)``.
        head_bias: a bias on the head projection.
        dtype: parameter dtype.

    ``layer(x, target)`` returns `AdaptiveSoftmaxOutput` (``.output``, ``.loss``); ``log_prob(x)``
    gives ``[N, n_classes]`` log-probabilities, ``predict(x)`` the most likely class ``[N]``.
    As a builder layer (``compile(device, data)``), the output is ``log_prob`` with dims
    ``(W=n_classes, H, D)``.
    """

    fixed_axes = ("W",)
    positional_hint = "{cls}({in_features}, {n_classes}, {cutoffs}, div_value={extra[0]})"

    def __init__(self, in_features: int, n_classes: int, cutoffs, *, div_value: float = 4.0,
                 head_bias: bool = False, dtype=None):
        super().__init__()
        cutoffs = [int(c) for c in cutoffs]
        if (not cutoffs or cutoffs != sorted(cutoffs) or min(cutoffs) <= 0 or max(cutoffs) > n_classes - 1
                or len(set(cutoffs)) != len(cutoffs)):
            raise ValueError(f"AdaptiveSoftmax: cutoffs must be unique, increasing integers in (0, n_classes - 1] "
                             f"= (0, {n_classes - 1}], got {cutoffs}")
        self.in_features, self.n_classes = int(in_features), int(n_classes)
        self.cutoffs = cutoffs + [self.n_classes]
        self.div_value = float(div_value)
        self.shortlist_size = self.cutoffs[0]
        self.n_clusters = len(self.cutoffs) - 1
        self.head = Linear(self.shortlist_size + self.n_clusters, in_features=self.in_features, bias=head_bias,
                           dtype=dtype)
        self.tail = []
        for i in range(self.n_clusters):
            hsz = int(self.in_features // (self.div_value ** (i + 1)))
            osz = self.cutoffs[i + 1] - self.cutoffs[i]
            self.tail.append([Linear(hsz, in_features=self.in_features, bias=False, dtype=dtype),
                              Linear(osz, in_features=hsz, bias=False, dtype=dtype)])
        self.mark_built((self.in_features, 1, 1))

    def _tail_logprob(self, x, i, head_lp):
        proj, out = self.tail[i]
        logits = (x @ proj.weight.T) @ out.weight.T
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return lp + head_lp[:, self.shortlist_size + i:self.shortlist_size + i + 1]

    def _head_logprob(self, x):
        logits = x @ self.head.weight.T
        if self.head.use_bias:
            logits = logits + self.head.bias
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _rows(self, x):
        x = x if isinstance(x, mx.array) else mx.array(x)
        if x.ndim not in (1, 2) or x.shape[-1] != self.in_features:
            raise ValueError(f"{self._describe()}: input must be [N, {self.in_features}] or [{self.in_features}], "
                             f"got shape {tuple(x.shape)}")
        return x.reshape(-1, self.in_features)

    def log_prob(self, x) -> mx.array:
        """Log-probabilities of every class: ``[N, in_features]`` -> ``[N, n_classes]``."""
        x = self._rows(x)
        head = self._head_logprob(x)
        parts = [head[:, :self.shortlist_size]]
        parts += [self._tail_logprob(x, i, head) for i in range(self.n_clusters)]
        return mx.concatenate(parts, axis=-1)

    def predict(self, x) -> mx.array:
        """The most likely class of each row: ``[N]`` int."""
        return mx.argmax(self.log_prob(x), axis=-1)

    def __call__(self, x, target=None, *, device=None):
        if isinstance(x, Data):
            return self.compile(device, x)
        if target is None:
            raise TypeError(f"{self._describe()}: call it as layer(x, target) (or use log_prob(x) / predict(x))")
        x = self._rows(x)
        target = target if isinstance(target, mx.array) else mx.array(target)
        target = target.reshape(-1)
        if target.shape[0] != x.shape[0]:
            raise ValueError(f"{self._describe()}: input and target should have the same batch size, got "
                             f"{x.shape[0]} and {target.shape[0]}")
        if not mx.issubdtype(target.dtype, mx.integer):
            raise TypeError(f"{self._describe()}: targets must be integers, got {target.dtype}")
        bad = mx.logical_or(target < 0, target >= self.n_classes)
        if bad.any().item():
            raise ValueError(f"{self._describe()}: target values should be in [0, {self.n_classes - 1}], got "
                             f"{target.tolist() if target.size <= 16 else 'values outside'}")
        # The log-probability of each target: the head entry for shortlist targets, else the cluster's
        # entry in the head plus the target's log-probability within its cluster (every cluster is
        # evaluated for every row, which is exact; PyTorch evaluates only the rows that need it).
        head = self._head_logprob(x)
        out = mx.take_along_axis(head, mx.minimum(target, self.shortlist_size - 1)[:, None].astype(mx.int32),
                                 axis=-1)[:, 0]
        for i in range(self.n_clusters):
            lo, hi = self.cutoffs[i], self.cutoffs[i + 1]
            inside = mx.logical_and(target >= lo, target < hi)
            rel = mx.clip(target - lo, 0, hi - lo - 1)[:, None].astype(mx.int32)
            lp = mx.take_along_axis(self._tail_logprob(x, i, head), rel, axis=-1)[:, 0]
            out = mx.where(inside, lp, out)
        return AdaptiveSoftmaxOutput(out, -out.mean())

    def forward(self, device, data):
        d = data.dims
        lp = self.log_prob(data.array.reshape(-1, d.W))
        return Data(lp, MTLSize(self.n_classes, d.H, d.D))

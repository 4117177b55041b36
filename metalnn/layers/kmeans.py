"""`KMeans`: differentiable soft clustering against learned centroids."""

from __future__ import annotations

import mlx.core as mx

from .. import init as initializers
from ..data import Data, MTLSize
from .base import Layer


class KMeans(Layer):
    """Soft assignment of each row to ``clusters`` learned centroids ``[clusters, W]``.

    ``dist[k] = ||x - c_k||^2``, ``p = softmax(-dist / temperature)``.

    Args:
        clusters: number of centroids K.
        temperature: sharpness of the assignment.
        output: ``"probabilities"`` (output W = K) or ``"features"`` (``p @ centroids``, output W
            = input W: each row replaced by its soft centroid).
    """

    fixed_axes = ("W",)

    positional_hint = "{cls}({clusters}, temperature={extra[0]!r})"

    def __init__(self, clusters: int, *, temperature: float = 1.0, output: str = "probabilities", init=None):
        super().__init__()
        if output not in ("probabilities", "features"):
            raise ValueError(f"KMeans: output must be 'probabilities' or 'features', got {output!r}")
        self.clusters, self.temperature, self.output = int(clusters), float(temperature), output
        self.init = initializers.get(init, initializers.Normal(1.0))

    def build(self, device, dims, dtype):
        self.centroids = self.init((self.clusters, dims.W), dims.W, self.clusters, device.next_key(), mx.float32)

    def distances(self, x):
        """Squared distances ``[..., K]`` of rows of ``x`` to the centroids."""
        c = self.centroids
        return (x * x).sum(-1, keepdims=True) - 2 * x @ c.T + (c * c).sum(-1)

    def forward(self, device, data):
        p = mx.softmax(-self.distances(data.array) / self.temperature, axis=-1)
        d = data.dims
        if self.output == "probabilities":
            return Data(p, MTLSize(self.clusters, d.H, d.D))
        return Data(p @ self.centroids, d)

    def fit(self, x, iterations: int = 20, seed: int = 0):
        """Set the centroids by Lloyd's algorithm on rows ``x`` ``[N, W]``, seeded with k-means++."""
        import numpy as np

        x = mx.array(x).reshape(-1, x.shape[-1]).astype(mx.float32)
        pts = np.array(x)
        rng = np.random.default_rng(seed)
        chosen = [int(rng.integers(len(pts)))]
        for _ in range(1, self.clusters):
            d2 = ((pts[:, None] - pts[chosen][None]) ** 2).sum(-1).min(1)
            chosen.append(int(rng.choice(len(pts), p=d2 / d2.sum())) if d2.sum() > 0 else int(rng.integers(len(pts))))
        self.centroids = x[mx.array(chosen)]
        self.mark_built(MTLSize(x.shape[-1]))
        for _ in range(iterations):
            assign = mx.argmin(self.distances(x), axis=-1)
            onehot = (assign[:, None] == mx.arange(self.clusters)[None]).astype(mx.float32)
            counts = onehot.sum(0)[:, None]
            new = (onehot.T @ x) / mx.maximum(counts, 1)
            self.centroids = mx.where(counts > 0, new, self.centroids)
        mx.eval(self.centroids)
        return self

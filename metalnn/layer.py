"""`Layer` (base of every metalnn layer) and `Layers` (a chain of layers).

A layer is an ``mlx.nn.Module``, so ``mlx.optimizers``, ``nn.value_and_grad``, ``tree_flatten`` and
``save_weights`` work on it as on any MLX model. What metalnn adds is the builder call
``layer.compile(device, data) -> Data``: on the first call the layer reads ``data.dims``, creates its
parameters with its initializer, and wires its MLX operations into MLX's lazy graph; later calls
check the dims against the first and reuse the parameters.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .data import Data, MTLSize
from .device import Device, resolve
from .errors import ShapeError


def as_data(x) -> Data:
    return x if isinstance(x, Data) else Data(x)


class Layer(nn.Module):
    """Base class of metalnn layers.

    Subclasses implement:

    * ``build(device, dims, dtype)`` (optional): create parameters from the first input's dims.
    * ``forward(device, data) -> Data``: the computation.
    * ``fixed_axes`` (class attribute): the axes of the input dims (``"W"``, ``"H"``, ``"D"``) that
      must stay equal to the first input's on later calls (e.g. ``("W",)`` for Linear, whose weight
      depends on the input width).
    """

    fixed_axes: tuple = ()

    def __init__(self):
        super().__init__()
        self._built = False
        self._built_dims = None
        self._path = ""

    # -- builder API -------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """Dotted name of this layer inside the model it was compiled in (class name at top level)."""
        return self._path or type(self).__name__

    def compile(self, device: Device | None, data, **kwargs) -> Data:
        """Wire this layer into MLX's lazy graph; returns its output `Data`.

        Extra keywords (e.g. ``cache=`` for attention layers) are passed on to ``forward``.
        """
        device = resolve(device)
        data = as_data(data)
        with mx.stream(device.stream):
            if not self._built:
                self.build(device, data.dims, data.dtype)
                self._built = True
                self._built_dims = data.dims
            else:
                self._check_dims(data.dims)
            return self.forward(device, data, **kwargs)

    def build(self, device: Device, dims: MTLSize, dtype) -> None:
        """Create parameters for inputs of ``dims``. Layers without parameters need not override."""

    def forward(self, device: Device, data: Data) -> Data:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def __call__(self, x, device: Device | None = None):
        """Plain-array call: compile on ``Data(x)`` and return the output array.

        When the output keeps the input's rows (``D*H`` unchanged) it comes back with the input's
        leading shape, so ``[B, F_in]`` in gives ``[B, F_out]`` out; otherwise the output is
        ``(D, H, W)``.
        """
        if isinstance(x, Data):
            return self.compile(device, x).array
        x = x if isinstance(x, mx.array) else mx.array(x)
        out = self.compile(device, Data(x)).array
        lead = tuple(x.shape[:-1]) if x.ndim > 1 else ()
        rows = 1
        for s in lead:
            rows *= s
        d = out.shape
        if x.ndim <= 3 and d[0] * d[1] == rows:
            return out.reshape(*lead, d[2]) if lead else out.reshape(d[2])
        return out

    def _check_dims(self, dims: MTLSize) -> None:
        for axis in self.fixed_axes:
            want, got = getattr(self._built_dims, axis), getattr(dims, axis)
            if want != got:
                raise ShapeError(self._describe(), f"input {axis}={want} (built for {self._built_dims})",
                                 f"{axis}={got} ({dims})")

    def _describe(self) -> str:
        name = type(self).__name__
        return f"{self._path} ({name})" if self._path else name

    def compile_child(self, name: str, child: "Layer", device: Device, data) -> Data:
        """Compile a sub-layer, giving it its dotted path for error messages."""
        child._path = f"{self._path}.{name}" if self._path else name
        return child.compile(device, data)

    def require(self, ok: bool, expected, given, detail: str = ""):
        if not ok:
            raise ShapeError(self._describe(), expected, given, detail)

    @property
    def built(self) -> bool:
        return self._built

    # -- parameters and weights --------------------------------------------------------------
    def for_update(self) -> dict:
        """Trainable parameters as a flat ``{dotted.name: mx.array}`` dict."""
        return dict(tree_flatten(self.trainable_parameters()))

    def named_parameters(self) -> dict:
        return dict(tree_flatten(self.parameters()))

    def num_parameters(self) -> int:
        return sum(v.size for v in self.for_update().values())

    def load_from_provider(self, provider, strict: bool = True, cast: bool = True):
        """Load parameters by dotted name from a provider (dict, .safetensors file, HF folder, .npz).

        With ``strict=True`` every missing, unexpected and mismatched name is collected into one
        `WeightLoadError` and nothing is loaded. See `metalnn.weights.load_into`.
        """
        from .weights import load_into

        return load_into(self, provider, strict=strict, cast=cast)

    def save(self, path) -> None:
        """Write all parameters to a safetensors file atomically (temp file + rename)."""
        from .weights import save_safetensors

        save_safetensors(path, self.named_parameters())

    def build_for(self, dims, dtype=mx.float32, device: Device | None = None) -> "Layer":
        """Create parameters for inputs of ``dims`` without real data (so weights can be loaded)."""
        dims = MTLSize(*dims)
        self.compile(device, Data(mx.zeros(dims.shape, dtype=dtype), dims))
        return self


class Layers(Layer):
    """A chain of layers: the output of each is the input of the next.

    Parameters are named ``layers.<i>.<name>`` (e.g. ``layers.0.weight``).
    """

    def __init__(self, layers):
        super().__init__()
        self.layers = list(layers)
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"Layers: item {i} is {type(layer).__name__}, not a metalnn Layer")

    def forward(self, device, data):
        for i, layer in enumerate(self.layers):
            data = self.compile_child(f"layers.{i}", layer, device, data)
        return data

    def __getitem__(self, i):
        if isinstance(i, int):
            return self.layers[i]
        return super().__getitem__(i)

    def append(self, layer: Layer) -> "Layers":
        self.layers.append(layer)
        return self

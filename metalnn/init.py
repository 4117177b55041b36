"""Weight initializers.

Each initializer is a callable ``init(shape, fan_in, fan_out, key, dtype) -> mx.array``. Layers pass
the fan-in/fan-out of their weight and a key: one drawn from the `Device` for parameters created
at the first compile, or ``None`` (MLX's global random state, ``mx.random.seed``) for parameters
created at construction. Give a layer's ``init=`` as an `Initializer`, a name
(``Linear(10, init="kaiming_normal")``) or an ``mlx.nn.init`` function (``nn.init.normal(std=0.02)``:
it receives an array of the parameter's shape and dtype).

Defaults per layer family (mlx.nn's, or PyTorch's where mlx.nn has no such layer):

=====================================  ===============================================================
family                                 default
=====================================  ===============================================================
Linear, attention projections, MLPs    weight and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in))
Conv*, ConvTransposed*                 weight U(-1/sqrt(fan_in), 1/sqrt(fan_in)), bias zeros
Embedding                              N(0, 1/dims)
RNN, LSTM, GRU                         every weight and bias U(-1/sqrt(hidden), 1/sqrt(hidden))
RMSNorm, LayerNorm, MulRows            ones (LayerNorm bias zeros)
KMeans                                 N(0, 1)
=====================================  ===============================================================
"""

from __future__ import annotations

import contextlib
import math

import mlx.core as mx


class Initializer:
    """Base class: subclasses implement ``sample(shape, fan_in, fan_out, key, dtype)``."""

    name = "initializer"

    def __call__(self, shape, fan_in=None, fan_out=None, key=None, dtype=mx.float32):
        shape = tuple(int(s) for s in shape)
        if fan_in is None or fan_out is None:
            fi, fo = fans(shape)
            fan_in = fi if fan_in is None else fan_in
            fan_out = fo if fan_out is None else fan_out
        return self.sample(shape, fan_in, fan_out, key, dtype)

    def sample(self, shape, fan_in, fan_out, key, dtype):  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}()"


def fans(shape):
    """(fan_in, fan_out) of a weight shaped ``[out, in, *kernel]`` (PyTorch convention)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = math.prod(shape[2:]) if len(shape) > 2 else 1
    return shape[1] * receptive, shape[0] * receptive


class KaimingNormal(Initializer):
    """He normal: N(0, gain^2 / fan_in), gain = sqrt(2) (ReLU)."""

    def __init__(self, gain=math.sqrt(2.0), mode="fan_in"):
        self.gain, self.mode = gain, mode

    def sample(self, shape, fan_in, fan_out, key, dtype):
        fan = fan_in if self.mode == "fan_in" else fan_out
        std = self.gain / math.sqrt(max(fan, 1))
        return (mx.random.normal(shape, key=key) * std).astype(dtype)


class KaimingUniform(Initializer):
    """He uniform: U(-b, b), b = gain * sqrt(3 / fan_in), gain = sqrt(2) (ReLU)."""

    def __init__(self, gain=math.sqrt(2.0), mode="fan_in"):
        self.gain, self.mode = gain, mode

    def sample(self, shape, fan_in, fan_out, key, dtype):
        fan = fan_in if self.mode == "fan_in" else fan_out
        bound = self.gain * math.sqrt(3.0 / max(fan, 1))
        return mx.random.uniform(-bound, bound, shape, key=key).astype(dtype)


class XavierNormal(Initializer):
    """Glorot normal: N(0, gain^2 * 2 / (fan_in + fan_out)), gain = 1 (linear)."""

    def __init__(self, gain=1.0):
        self.gain = gain

    def sample(self, shape, fan_in, fan_out, key, dtype):
        std = self.gain * math.sqrt(2.0 / max(fan_in + fan_out, 1))
        return (mx.random.normal(shape, key=key) * std).astype(dtype)


class XavierUniform(Initializer):
    """Glorot uniform: U(-b, b), b = gain * sqrt(6 / (fan_in + fan_out))."""

    def __init__(self, gain=1.0):
        self.gain = gain

    def sample(self, shape, fan_in, fan_out, key, dtype):
        bound = self.gain * math.sqrt(6.0 / max(fan_in + fan_out, 1))
        return mx.random.uniform(-bound, bound, shape, key=key).astype(dtype)


class FanInUniform(Initializer):
    """U(-b, b), b = scale / sqrt(fan_in): mlx.nn's and PyTorch's default for Linear."""

    def __init__(self, scale=1.0):
        self.scale = scale

    def sample(self, shape, fan_in, fan_out, key, dtype):
        bound = self.scale / math.sqrt(max(fan_in, 1))
        return mx.random.uniform(-bound, bound, shape, key=key).astype(dtype)


class Uniform(Initializer):
    """U(low, high) regardless of fans."""

    def __init__(self, low=-0.05, high=0.05):
        self.low, self.high = low, high

    def sample(self, shape, fan_in, fan_out, key, dtype):
        return mx.random.uniform(self.low, self.high, shape, key=key).astype(dtype)


class Normal(Initializer):
    """N(mean, std^2) regardless of fans (GPT-2 style: std 0.02)."""

    def __init__(self, std=0.02, mean=0.0):
        self.std, self.mean = std, mean

    def sample(self, shape, fan_in, fan_out, key, dtype):
        return (mx.random.normal(shape, key=key) * self.std + self.mean).astype(dtype)


class Constant(Initializer):
    """Every element equal to ``value``."""

    def __init__(self, value):
        self.value = value

    def sample(self, shape, fan_in, fan_out, key, dtype):
        return mx.full(shape, self.value, dtype=dtype)


class Zeros(Constant):
    def __init__(self):
        super().__init__(0.0)


class Ones(Constant):
    def __init__(self):
        super().__init__(1.0)


class Fixed(Initializer):
    """Given values (any array-like of the right shape)."""

    def __init__(self, values):
        self.values = mx.array(values)

    def sample(self, shape, fan_in, fan_out, key, dtype):
        if tuple(self.values.shape) != tuple(shape):
            raise ValueError(f"Fixed initializer: expected values of shape {tuple(shape)}, "
                             f"got {tuple(self.values.shape)}")
        return self.values.astype(dtype)


kaiming_normal = KaimingNormal()
kaiming_uniform = KaimingUniform()
xavier_normal = XavierNormal()
xavier_uniform = XavierUniform()
zeros = Zeros()
ones = Ones()

_BY_NAME = {
    "fan_in_uniform": FanInUniform,
    "uniform": Uniform,
    "kaiming_normal": KaimingNormal,
    "kaiming_uniform": KaimingUniform,
    "xavier_normal": XavierNormal,
    "xavier_uniform": XavierUniform,
    "normal": Normal,
    "zeros": Zeros,
    "ones": Ones,
}


def get(init, default: Initializer | None = None) -> Initializer:
    """An `Initializer` from an instance, a name, or an ``mlx.nn.init`` function ``f(array) -> array``.

    ``None`` gives ``default`` (a layer family's default).
    """
    if init is None and default is not None:
        return default
    if isinstance(init, Initializer):
        return init
    if isinstance(init, str):
        try:
            return _BY_NAME[init]()
        except KeyError:
            raise ValueError(f"unknown initializer {init!r}; choose from {sorted(_BY_NAME)}") from None
    if callable(init):
        return _Callable(init)
    raise TypeError(f"initializer must be an Initializer, a name or an mlx.nn.init function, got "
                    f"{type(init).__name__}")


class _Callable(Initializer):
    """An ``mlx.nn.init``-style function: called with an array of the parameter's shape and dtype
    (metalnn's weights use PyTorch layouts, e.g. ``[out, in]`` for Linear, ``[out, in, kh, kw]`` for
    Conv2D); it draws from MLX's global random state."""

    def __init__(self, fn):
        self.fn = fn

    def sample(self, shape, fan_in, fan_out, key, dtype):
        out = self.fn(mx.zeros(shape, dtype=dtype))
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"initializer {getattr(self.fn, '__name__', self.fn)!r} returned shape "
                             f"{tuple(out.shape)} for a parameter of shape {tuple(shape)}")
        return out.astype(dtype)

    def __repr__(self):
        return f"Callable({getattr(self.fn, '__qualname__', self.fn)})"


_seeded_keys: list = []


def construction_key():
    """The key for a parameter created at construction: a fresh split of the innermost `seeded`
    block's key, or ``None`` (MLX's global random state) outside such a block."""
    if not _seeded_keys:
        return None
    key, sub = mx.random.split(_seeded_keys[-1])
    _seeded_keys[-1] = key
    return sub


@contextlib.contextmanager
def seeded(seed: int):
    """Parameters created at construction inside the block draw from ``seed`` instead of MLX's global
    random state (which is left untouched). For building a model reproducibly."""
    # a branch of the seed's key tree that a Device(seed), which splits keys in two, never draws
    _seeded_keys.append(mx.random.split(mx.random.key(int(seed)), 3)[2])
    try:
        yield
    finally:
        _seeded_keys.pop()

"""`Layer` (base of every metalnn layer) and `Layers` (a chain of layers).

A layer is an ``mlx.nn.Module``, so ``mlx.optimizers``, ``nn.value_and_grad``, ``tree_flatten``,
``save_weights`` and ``train()`` / ``eval()`` work on it as on any MLX model. What metalnn adds is
the builder call ``layer.compile(device, data) -> Data``: on the first call the layer reads
``data.dims``, creates the parameters it could not create at construction (their sizes depend on
the input) and wires its MLX operations into MLX's lazy graph; later calls check the dims against
the first and reuse the parameters.

Calling a layer on a plain array, ``layer(x)``, is the same with mlx.nn's batch-first layouts: the
array becomes ``Data(x)`` (``[B, F]`` -> ``MTLSize(F, 1, B)``, see `metalnn.data`) and the output
comes back with as many axes as ``x`` had, where its dims allow (`Data.to_array`). Image layers
take and give channels-last arrays ``[N, H, W, C]`` (``[N, L, C]``, ``[N, D, H, W, C]``), as
``mx.conv2d`` and mlx.nn do; a model whose image input ends in features (after `Flatten` or
`GlobalAvgPool`) gives ``[N, features]``. Token embeddings add a feature axis.

Randomness of initialisation: parameters whose sizes are known at construction are drawn from
MLX's global random state (``mx.random.seed``), as mlx.nn's are; parameters created at the first
compile are drawn from the `Device`'s key (``Device(seed=...)``), one fresh key per parameter.
"""

from __future__ import annotations

import functools
import inspect
import re
import string
import types

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..data import Data, MTLSize
from ..device import Device, resolve
from ..errors import ShapeError


def as_data(x) -> Data:
    return x if isinstance(x, Data) else Data(x)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _plain(value) -> bool:
    """Whether ``repr(value)`` reads as a literal in a suggested call (else the parameter's name is shown)."""
    if isinstance(value, (tuple, list)):
        return len(value) <= 8 and all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _derived_hint(positional: list, keyword_only: list):
    """The call suggested where none is declared: ``cls(<the positional arguments>, <first keyword>=...)``."""

    def hint(a) -> str:
        shown = [repr(getattr(a, n)) if _plain(getattr(a, n)) else n for n in positional]
        return f"{a.cls}({', '.join(shown + [f'{k}=...' for k in keyword_only[:1]])})"

    return hint


def _check_hint(hint: str, names: set, where: str) -> None:
    """A format-string hint may name only the parameters, ``cls`` and ``extra``."""
    for _, field, _, _ in string.Formatter().parse(hint):
        if field is None:
            continue
        root = re.match(r"[^.\[]*", field).group()
        if root not in names | {"cls", "extra"}:
            raise TypeError(f"{where}: positional_hint {hint!r} names {{{field}}}, which is not one of its "
                            f"parameters ({', '.join(sorted(names)) or 'none'}), cls or extra")


def guard_positional(hint=None):
    """Decorator: a call of the function (or ``__init__``) with more positional arguments than it
    takes raises a TypeError that names the right call, instead of Python's count of arguments.
    The signature stays the function's own (``functools.wraps``: ``inspect.signature`` and
    ``help`` show it).

    ``hint`` is the right call: a format string over the arguments by parameter name (the
    positional ones given, keywords given, defaults otherwise; a required one not given reads as
    its own name), ``cls`` (the class's name for an ``__init__``, the function's otherwise) and
    ``extra`` (the tuple of surplus positional arguments), e.g.
    ``"{cls}({extra[0]}, in_features={out_features})"``; or a callable taking them as attributes
    of one namespace (``a.cls``, ``a.extra``, ``a.out_features``) and returning the call; or None:
    ``cls(<positional arguments>, <first keyword-only parameter>=...)``. Every `Layer` subclass
    gets this on its ``__init__`` with its ``positional_hint``.
    """
    return lambda fn: _guard(fn, hint)


def _guard(fn, hint, method: bool | None = None):
    """`guard_positional`'s wrapper of ``fn`` (a method when its first parameter is ``self``)."""
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return fn  # takes any number of positional arguments
    if method is None:
        method = bool(params) and params[0].name == "self"
    named = [p for p in (params[1:] if method else params) if p.kind is not p.VAR_KEYWORD]
    names = {p.name for p in named}
    if isinstance(hint, str):
        if names & {"cls", "extra"}:
            raise TypeError(f"{fn.__qualname__}: a positional_hint cannot name a parameter called cls or extra")
        _check_hint(hint, names, fn.__qualname__)
    elif hint is None:
        hint = _derived_hint([p.name for p in named if p.kind in _POSITIONAL],
                             [p.name for p in named if p.kind is p.KEYWORD_ONLY])
    limit = sum(p.kind in _POSITIONAL for p in params)

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        if len(args) > limit:
            title = type(args[0]).__name__ if method else fn.__name__
            given = dict(zip([p.name for p in params[:limit]], args))
            given.update(kwargs)
            values = {p.name: given.get(p.name, p.name if p.default is p.empty else p.default) for p in named}
            ns = types.SimpleNamespace(**{**values, "cls": title, "extra": args[limit:]})
            call = hint.format_map(vars(ns)) if isinstance(hint, str) else hint(ns)
            raise TypeError(f"{title}: too many positional arguments {ns.extra!r}; metalnn takes the sizes it "
                            f"cannot infer positionally and everything else by keyword, e.g. {call}")
        return fn(*args, **kwargs)

    guarded.__positional_guard__ = True
    return guarded


# Counts assignments of parameters or sub-layers to any layer (see `parameter_epoch`).
_PARAMETER_EPOCH = [0]


def parameter_epoch() -> int:
    """A number that changes whenever a parameter or sub-layer of any `Layer` is assigned (``layer.w =
    ...``, ``Module.update``, ``load_weights``, adapters wrapping a projection), so that what is derived
    from a model's parameters can be cached until they change."""
    return _PARAMETER_EPOCH[0]


class Layer(nn.Module):
    """Base class of metalnn layers.

    Subclasses implement:

    * ``build(device, dims, dtype)`` (optional): create parameters from the first input's dims.
    * ``forward(device, data, **kwargs) -> Data``: the computation.
    * ``fixed_axes`` (class attribute): the axes of the input dims (``"W"``, ``"H"``, ``"D"``) that
      must stay equal to the first input's on later calls (e.g. ``("W",)`` for Linear, whose weight
      depends on the input width).
    * ``to_data(x)`` / ``from_data(out, x)`` (optional): how a plain-array call maps its input to
      `Data` and the output back, where the batch-first default does not fit (images, token ids).
    * ``positional_hint`` (class attribute, optional): the right call that the TypeError names when
      the constructor gets more positional arguments than it takes (mlx.nn's argument order, say):
      see `guard_positional`. It is read from the body of the class that defines ``__init__`` (a
      subclass with an ``__init__`` of its own declares its own, or gets the derived one).

    Constructors take the sizes metalnn cannot infer positionally and everything else by keyword
    (``def __init__(self, out_features, *, in_features=None, ...)``); every subclass's ``__init__``
    is wrapped by `guard_positional` when the class is created.
    """

    fixed_axes: tuple = ()
    #: a repeated block of a deep model (a transformer block): what `checkpoint_blocks` selects
    is_block: bool = False
    #: the call named by the TypeError for too many positional arguments (see `guard_positional`)
    positional_hint = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "__positional_guard__", False):
            cls.__init__ = _guard(init, cls.__dict__.get("positional_hint"), method=True)

    @guard_positional()
    def __init__(self):
        super().__init__()
        self._built = False
        self._built_dims = None
        self._path = ""
        self.grad_checkpoint = False

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        _PARAMETER_EPOCH[0] += 1

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
                self.mark_built(data.dims)
            else:
                self._check_dims(data.dims)
            if self.grad_checkpoint and kwargs.get("cache") is None:
                return self._checkpointed_forward(device, data, **kwargs)
            return self.forward(device, data, **kwargs)

    def _checkpointed_forward(self, device, data, **kwargs) -> Data:
        """``forward`` under ``mx.checkpoint``: its activations are recomputed in the backward pass
        instead of kept. The block gets a random stream of its own (one key from the device), so the
        recomputation draws the same dropout masks."""
        out_dims = []
        key = device.next_key()  # not an input of the checkpointed function: random draws have no VJP

        def inner(params, x):
            self.update(params)
            out = self.forward(device.fork(key), Data(x, data.dims), **kwargs)
            out_dims[:] = [out.dims]
            return out.array

        # Every parameter is an input, frozen ones included: values computed from a closure's
        # constants alone (a dequantized weight, say) would be merged by mx.compile with the
        # forward's copies, which then stay alive until the backward (measured on SmolLM2 QLoRA:
        # 11 MiB kept per block instead of 1). Gradients of frozen parameters are never evaluated.
        y = mx.checkpoint(inner)(self.parameters(), data.array)
        return Data(y, out_dims[0])

    def build(self, device: Device, dims: MTLSize, dtype) -> None:
        """Create parameters for inputs of ``dims``. Layers without parameters need not override."""

    def mark_built(self, dims: MTLSize) -> None:
        """Record that the parameters exist, for inputs of ``dims`` (used by eager constructors)."""
        self._built = True
        self._built_dims = MTLSize(*dims)

    def forward(self, device: Device, data: Data, **kwargs) -> Data:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.forward")

    def __call__(self, x, *args, device: Device | None = None, **kwargs):
        """``layer(x)``: a `Data` in gives a `Data` out (as ``compile``); a plain array in gives a
        plain array out (mlx.nn's batch-first layouts; see the module docstring)."""
        if args:
            raise TypeError(f"{self._describe()}: call it as layer(x, device=..., ...); options are keywords, "
                            f"got {len(args)} extra positional argument(s)")
        if isinstance(x, Data):
            return self.compile(device, x, **kwargs)
        x = x if isinstance(x, mx.array) else mx.array(x)
        return self.from_data(self.compile(device, self.to_data(x), **kwargs), x)

    def to_data(self, x: mx.array) -> Data:
        """The `Data` a plain-array call compiles on: batch-first ``Data(x)``."""
        return Data(x)

    def from_data(self, out: Data, x: mx.array) -> mx.array:
        """The array a plain-array call returns: ``x``'s number of axes where the dims allow it
        (an image input that ends in features gives ``[N, features]``)."""
        return out.to_array(x.ndim if x.ndim <= 3 else 2)

    def _check_dims(self, dims: MTLSize) -> None:
        for axis in self.fixed_axes:
            want, got = getattr(self._built_dims, axis), getattr(dims, axis)
            if want != got:
                raise ShapeError(self._describe(), f"input {axis}={want} (built for {self._built_dims})",
                                 f"{axis}={got} ({dims})")

    def _describe(self) -> str:
        name = type(self).__name__
        return f"{self._path} ({name})" if self._path else name

    def compile_child(self, child: "Layer", device: Device, data, **kwargs) -> Data:
        """Compile a sub-layer, giving it its dotted path (found from where ``self`` holds it, so it
        cannot drift from the attribute's name) for error messages."""
        name = self.child_name(child)
        child._path = f"{self._path}.{name}" if self._path else name
        return child.compile(device, data, **kwargs)

    def compile_child_array(self, child: "Layer", device: Device, x: mx.array, **kwargs) -> mx.array:
        """Run a sub-layer on a plain array (its own ``to_data`` / ``from_data`` layouts)."""
        return child.from_data(self.compile_child(child, device, child.to_data(x), **kwargs), x)

    def child_name(self, child: "Layer") -> str:
        """The dotted name under which ``self`` holds ``child`` (``"norm"``, ``"layers.3"``); raises
        ValueError when ``child`` is not one of its sub-layers."""
        for key, value in self.items():
            if value is child:
                return key
            if isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if item is child:
                        return f"{key}.{i}"
            elif isinstance(value, dict):
                for k, item in value.items():
                    if item is child:
                        return f"{key}.{k}"
        raise ValueError(f"{self._describe()}: {type(child).__name__} is not one of its sub-layers "
                         "(assign it to an attribute, a list or a dict of this layer first)")

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
        from ..weights import load_into

        return load_into(self, provider, strict=strict, cast=cast)

    def save(self, path) -> None:
        """Write all parameters to a safetensors file atomically (temp file + rename)."""
        from ..weights import save_safetensors

        save_safetensors(path, self.named_parameters())

    def build_for(self, dims, dtype=mx.float32, device: Device | None = None) -> "Layer":
        """Create parameters for inputs of ``dims`` without real data (so weights can be loaded)."""
        dims = MTLSize(*dims)
        self.compile(device, Data(mx.zeros(dims.shape, dtype=dtype), dims))
        return self


def path_order(path: str) -> list:
    """Sort key of a module path that puts ``layers.2`` before ``layers.10`` (numbers before names)."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split(".")]


def module_at(model: nn.Module, path: str):
    """The submodule at dotted ``path`` (list entries by index: ``model.layers.3.mlp``)."""
    m = model
    for part in path.split(".") if path else ():
        m = m[int(part)] if isinstance(m, list) else m[part]
    return m


def set_module(model: nn.Module, path: str, module) -> None:
    """Put ``module`` at dotted ``path`` in place of what is there."""
    parent_path, _, name = path.rpartition(".")
    parent = module_at(model, parent_path)
    if isinstance(parent, list):
        parent[int(name)] = module
    else:
        parent[name] = module


def blocks(model: nn.Module) -> list:
    """``[(path, layer)]`` of the model's repeated blocks (``is_block`` layers), in model order."""
    return sorted(((p, m) for p, m in model.named_modules() if isinstance(m, Layer) and m.is_block),
                  key=lambda item: path_order(item[0]))


def checkpoint_blocks(model: nn.Module, enabled: bool = True) -> int:
    """Turn gradient checkpointing on (or off) for every block (``is_block``) of ``model``; returns
    how many blocks there are. Each block's activations are then recomputed in the backward pass:
    memory falls from all activations to one block's plus the blocks' inputs."""
    found = blocks(model)
    for _, b in found:
        b.grad_checkpoint = enabled
    return len(found)


class Layers(Layer):
    """A chain of layers: the output of each is the input of the next.

    ``Layers(a, b, c)`` (as ``mlx.nn.Sequential``) or ``Layers([a, b, c])``; `Sequential` is the
    same class. Parameters are named ``layers.<i>.<name>`` (e.g. ``layers.0.weight``).
    """

    def __init__(self, *layers):
        super().__init__()
        if len(layers) == 1 and isinstance(layers[0], (list, tuple)):
            layers = tuple(layers[0])
        self.layers = list(layers)
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"Layers: item {i} is {type(layer).__name__}, not a metalnn Layer")

    def forward(self, device, data):
        for i, layer in enumerate(self.layers):
            data = self.compile_child(layer, device, data)
        return data

    def __getitem__(self, i):
        if isinstance(i, int):
            return self.layers[i]
        return super().__getitem__(i)

    def to_data(self, x):
        return self.layers[0].to_data(x) if self.layers else Data(x)

    def from_data(self, out, x):
        return self.layers[-1].from_data(out, x) if self.layers else super().from_data(out, x)

    def append(self, layer: Layer) -> "Layers":
        self.layers.append(layer)
        return self


Sequential = Layers

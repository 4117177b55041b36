"""Layer constructors show their real signatures, and the mlx.nn-style positional call still names
metalnn's call."""

import ast
import inspect
import pydoc
import sys

import mlx.core as mx
import numpy as np
import pytest

import metalnn as mn
import metalnn.layers as L
from metalnn.layers.base import Layer, guard_positional

CLASSES = [getattr(L, n) for n in L.__all__ if isinstance(getattr(L, n), type)]
LAYERS = [c for c in CLASSES if issubclass(c, Layer)]
#: chains whose ``*layers`` is their real signature, as mlx.nn.Sequential's ``*modules``
CHAINS = {L.Layers, L.Residual}


def _init_source(cls):
    """The class that defines ``cls.__init__``, its module and the ``ast.FunctionDef`` of it."""
    owner = next(k for k in cls.__mro__ if "__init__" in k.__dict__)
    module = sys.modules[owner.__module__]
    tree = ast.parse(inspect.getsource(module))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner.__name__)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return owner, module, init


def _source_parameters(init: ast.FunctionDef, module):
    """``[(name, kind, annotation text, default value)]`` as the ``def`` line writes them."""
    P = inspect.Parameter
    a = init.args
    positional = a.posonlyargs + a.args
    defaults = [P.empty] * (len(positional) - len(a.defaults)) + list(a.defaults)
    rows = [(arg, P.POSITIONAL_ONLY if arg in a.posonlyargs else P.POSITIONAL_OR_KEYWORD, d)
            for arg, d in zip(positional, defaults)]
    if a.vararg:
        rows.append((a.vararg, P.VAR_POSITIONAL, P.empty))
    rows += [(arg, P.KEYWORD_ONLY, P.empty if d is None else d) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        rows.append((a.kwarg, P.VAR_KEYWORD, P.empty))
    out = []
    for arg, kind, default in rows[1:]:  # self
        ann = P.empty if arg.annotation is None else ast.unparse(arg.annotation)
        value = P.empty if default is P.empty else eval(ast.unparse(default), vars(module))
        out.append((arg.arg, kind, ann, value))
    return out


def _ann(annotation):
    return annotation if isinstance(annotation, str) or annotation is inspect.Parameter.empty else \
        inspect.formatannotation(annotation)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_no_catch_all_positional_parameter(cls):
    params = inspect.signature(cls).parameters.values()
    var = [p.name for p in params if p.kind is p.VAR_POSITIONAL]
    if cls in CHAINS or any(issubclass(cls, c) for c in CHAINS):
        assert var == ["layers"]
    else:
        assert var == [], f"{cls.__name__}{inspect.signature(cls)}"
    assert "extra" not in [p.name for p in params]


@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_signature_is_the_init_source(cls):
    owner, module, init = _init_source(cls)
    want = _source_parameters(init, module)
    got = [(p.name, p.kind, _ann(p.annotation), p.default) for p in inspect.signature(cls).parameters.values()]
    assert got == want, f"{cls.__name__} (its __init__ from {owner.__name__})"
    # sizes metalnn cannot infer come first, positionally; everything after them is keyword-only
    kinds = [k for _, k, _, _ in want]
    assert kinds == sorted(kinds), kinds


def test_help_shows_the_real_signature():
    doc = pydoc.render_doc(mn.Linear, renderer=pydoc.plaintext)
    assert "Linear(out_features: 'int', *, in_features: 'int | None' = None, bias: 'bool' = True" in doc
    assert "extra" not in str(inspect.signature(mn.Conv2D))
    assert str(inspect.signature(mn.RMSNorm)) == (
        "(dims: 'int | None' = None, *, eps: 'float' = 1e-05, affine: 'bool' = True, offset: 'float' = 0.0, "
        "dtype=None)")


@pytest.mark.parametrize("cls", [c for c in LAYERS if c not in CHAINS and not any(issubclass(c, k) for k in CHAINS)],
                         ids=lambda c: c.__name__)
def test_every_layer_refuses_one_positional_argument_too_many(cls):
    n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in inspect.signature(cls).parameters.values())
    with pytest.raises(TypeError, match=rf"^{cls.__name__}: too many positional arguments \(7,\); metalnn takes "
                                        r"the sizes it cannot infer positionally and everything else by keyword"):
        cls(*[1] * n, 7)


TOO_MANY = "{}: too many positional arguments {!r}; metalnn takes the sizes it cannot infer positionally and " \
           "everything else by keyword, e.g. {}"

MLX_NN_STYLE = [
    (lambda: mn.Linear(64, 128), "Linear", (128,), "Linear(128, in_features=64) for mlx.nn's Linear(64, 128)"),
    (lambda: mn.QuantizedLinear(64, 16), "QuantizedLinear", (16,), "QuantizedLinear(16, in_features=64, bits=...)"),
    (lambda: mn.Conv1D(3, 16, 5), "Conv1D", (5,), "Conv1D(16, 5, in_channels=3) for mlx.nn's Conv1d(3, 16, 5)"),
    (lambda: mn.Conv2D(3, 16, 3), "Conv2D", (3,), "Conv2D(16, 3, in_channels=3) for mlx.nn's Conv2d(3, 16, 3)"),
    (lambda: mn.ConvTransposed3D(4, 8, 2), "ConvTransposed3D", (2,),
     "ConvTransposed3D(8, 2, in_channels=4) for mlx.nn's ConvTransposed3d(4, 8, 2)"),
    (lambda: mn.LSTM(8, 32), "LSTM", (32,),
     "LSTM(32) for mlx.nn's LSTM(8, 32): the input size is taken from the first input"),
    (lambda: mn.GRU(8, 32), "GRU", (32,), "GRU(32) for mlx.nn's GRU(8, 32): the input size is taken from the first input"),
    (lambda: mn.RNN(8, 32), "RNN", (32,), "RNN(32) for mlx.nn's RNN(8, 32): the input size is taken from the first input"),
    (lambda: mn.RMSNorm(512, 1e-6), "RMSNorm", (1e-6,), "RMSNorm(512, eps=1e-06)"),
    (lambda: mn.LayerNorm(512, 1e-6), "LayerNorm", (1e-6,), "LayerNorm(512, eps=1e-06)"),
    (lambda: mn.GatedRMSNorm(64, 1e-5), "GatedRMSNorm", (1e-5,), "GatedRMSNorm(64, eps=1e-05)"),
    (lambda: mn.MaxPool2D(2, 1), "MaxPool2D", (1,), "MaxPool2D(2, stride=1)"),
    (lambda: mn.AvgPool2D(3, 2, 1), "AvgPool2D", (2, 1), "AvgPool2D(3, stride=2)"),
    (lambda: mn.MLP(64, "relu"), "MLP", ("relu",), "MLP(64, activation='relu')"),
    (lambda: mn.SwiGLU(64, "silu"), "SwiGLU", ("silu",), "SwiGLU(64, activation=...)"),
    (lambda: mn.Softmax("standard", 2.0), "Softmax", (2.0,), "Softmax('standard', temperature=2.0)"),
    (lambda: mn.KMeans(3, 0.5), "KMeans", (0.5,), "KMeans(3, temperature=0.5)"),
    (lambda: mn.Parallel([mn.ReLU()], "sum"), "Parallel", ("sum",), "Parallel(branches, combine='sum')"),
    (lambda: mn.GatedDeltaNet(2, 4), "GatedDeltaNet", (4,), "GatedDeltaNet(2, num_v_heads=4)"),
    (lambda: mn.AdaptiveSoftmax(8, 100, [10, 50], 2.0), "AdaptiveSoftmax", (2.0,),
     "AdaptiveSoftmax(8, 100, [10, 50], div_value=2.0)"),
    (lambda: mn.SelfAttention(512, 8), "SelfAttention", (8,), "SelfAttention(512, num_kv_heads=...)"),
    (lambda: mn.Embedding(100, 16, None), "Embedding", (None,), "Embedding(100, 16, init=...)"),
    (lambda: mn.QuantizedEmbedding(100, 64, 4), "QuantizedEmbedding", (4,), "QuantizedEmbedding(100, 64, bits=...)"),
    (lambda: mn.SwitchGLU(4, 8, 16), "SwitchGLU", (16,), "SwitchGLU(4, 8, activation=...)"),
    (lambda: mn.SparseMoE(4, 2, 8, False), "SparseMoE", (False,), "SparseMoE(4, 2, 8, norm_topk_prob=...)"),
    (lambda: mn.TransformerBlock(4, 64, 2), "TransformerBlock", (2,), "TransformerBlock(4, 64, num_kv_heads=...)"),
    (lambda: mn.DecoderBlock(mn.Identity(), mn.Identity(), "mixer"), "DecoderBlock", ("mixer",),
     "DecoderBlock(mixer, mlp, mixer_name=..., eps=...)"),
    (lambda: mn.SandwichBlock(mn.Identity(), mn.Identity(), 1e-6), "SandwichBlock", (1e-6,),
     "SandwichBlock(attn, mlp, eps=..., norm_offset=...)"),
]


@pytest.mark.parametrize("call, name, extra, right", MLX_NN_STYLE, ids=[row[1] for row in MLX_NN_STYLE])
def test_mlx_nn_style_positional_call_names_the_metalnn_call(call, name, extra, right):
    with pytest.raises(TypeError) as err:
        call()
    assert str(err.value) == TOO_MANY.format(name, extra, right)


def test_a_subclass_without_its_own_init_reports_its_own_name():
    class Dense(mn.Linear):
        pass

    with pytest.raises(TypeError, match=r"^Dense: .*e.g. Dense\(128, in_features=64\)"):
        Dense(64, 128)
    assert inspect.signature(Dense) == inspect.signature(mn.Linear)


def test_the_right_calls_still_work():
    x = mx.random.normal((2, 64))
    assert mn.Linear(128, in_features=64)(x).shape == (2, 128)
    assert mn.Linear(out_features=128, in_features=64, bias=False)(x).shape == (2, 128)
    assert mn.QuantizedLinear(16, in_features=64, bits=8, group_size=32)(x).shape == (2, 16)
    assert mn.Conv2D(16, 3, in_channels=3, padding=1)(mx.zeros((1, 8, 8, 3))).shape == (1, 8, 8, 16)
    assert mn.LSTM(32)(mx.zeros((2, 5, 8))).shape == (2, 5, 32)
    rnn = mn.RNN(32, nonlinearity="relu", bias=False, return_sequences=False)
    assert (rnn.nonlinearity, rnn.use_bias, rnn.return_sequences) == ("relu", False, False)
    assert rnn(mx.zeros((2, 5, 8))).shape == (2, 1, 32)  # the last state
    norm = mn.RMSNorm(512, eps=1e-6)
    assert norm.eps == 1e-6 and norm.weight.shape == (512,)
    assert mn.LayerNorm(eps=1e-6, bias=False)(x).shape == (2, 64)
    pool = mn.AvgPool2D(3, stride=2, padding=1, count_include_pad=False)
    assert (pool.kernel_size, pool.stride, pool.padding, pool.count_include_pad) == ((3, 3), (2, 2), (1, 1), False)
    assert mn.MaxPool2D(2)(mx.zeros((1, 8, 8, 3))).shape == (1, 4, 4, 3)
    assert mn.SwiGLU(32, activation="silu")(x).shape == (2, 64)
    assert mn.Embedding(100, 16)(mx.array([[1, 2, 3]])).shape == (1, 3, 16)
    assert mn.TransformerBlock(4, 64, num_kv_heads=2)(mx.zeros((1, 3, 32))).shape == (1, 3, 32)
    assert mn.Softmax("standard", temperature=2.0).temperature == 2.0
    np.testing.assert_allclose(np.array(mn.Softmax(temperature=2.0)(mx.zeros((1, 4)))), np.full((1, 4), 0.25))


def test_a_layer_without_a_declared_hint_gets_one_from_its_signature():
    class Scale(Layer):
        def __init__(self, width: int, *, factor: float = 1.0, bias: bool = False):
            super().__init__()
            self.width, self.factor = width, factor

    assert str(inspect.signature(Scale)) == "(width: int, *, factor: float = 1.0, bias: bool = False)"
    with pytest.raises(TypeError, match=r"^Scale: too many positional arguments \(2.0,\);.* e.g. Scale\(4, factor=...\)$"):
        Scale(4, 2.0)
    assert Scale(4, factor=2.0).factor == 2.0


def test_a_hint_naming_no_parameter_is_refused_when_the_class_is_made():
    with pytest.raises(TypeError, match=r"names \{widht\}, which is not one of its parameters \(factor, width\)"):
        class Typo(Layer):  # noqa: F841
            positional_hint = "{cls}({widht}, factor={extra[0]})"

            def __init__(self, width: int, *, factor: float = 1.0):
                super().__init__()


def test_the_guard_works_on_a_plain_function_with_keyword_overrides():
    """As a model's config builder would use it: ``**overrides`` stay in the signature."""

    @guard_positional("{cls}({vocab_size}, hidden_size={extra[0]})")
    def tiny_config(vocab_size: int, *, hidden_size: int = 256, **extra) -> dict:
        return {"vocab_size": vocab_size, "hidden_size": hidden_size, **extra}

    assert str(inspect.signature(tiny_config)) == "(vocab_size: int, *, hidden_size: int = 256, **extra) -> dict"
    with pytest.raises(TypeError, match=r"^tiny_config: too many positional arguments \(64,\);.* "
                                        r"e\.g\. tiny_config\(1000, hidden_size=64\)$"):
        tiny_config(1000, 64)
    assert tiny_config(1000, hidden_size=64, rope_theta=1e4) == {"vocab_size": 1000, "hidden_size": 64,
                                                                 "rope_theta": 1e4}

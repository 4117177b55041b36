"""Each native primitive's ``name()`` and ``is_equivalent()``, seen through ``mx.compile``.

``mx.compile`` merges two nodes of one primitive type that read the same inputs when
``is_equivalent`` says so, without looking at their shapes. So for every primitive of
``metalnn.cpu._fastmath``:

- two applications with the same parameters must become one node (is_equivalent is not
  always false), and
- two applications that differ in any single parameter must stay two nodes: an
  ``is_equivalent`` that forgot a field would merge them and silently compute the wrong op.

The nodes are counted by name on the compiled graph (``mx.export_to_dot`` labels each node with
its primitive's ``name()``). Parameters that cannot differ between two nodes reading the same
inputs are not varied: a weight's presence (RMSNorm), given periods (RoPE) or per-sequence
positions (the cache writes' and the decoding steps' ``row_positions``) add an input; a
packed weight fixes ``bits`` and ``group_size`` together; and the backward primitives that
read their forward's outputs (the logsumexp of CrossEntropyVJP, the softmax of
ScaledSoftmaxVJP) get different inputs whenever their forwards differ.
"""

import io
import platform
import re
import sys
from pathlib import Path

import numpy as np
import pytest

import mlx.core as mx
from metalnn.cpu import native_ext

NATIVE_PLATFORM = sys.platform.startswith("linux") and platform.machine() == "x86_64"
pytestmark = pytest.mark.skipif(not NATIVE_PLATFORM, reason="the native extension is built on Linux x86_64 only")

SOURCES = Path(__file__).resolve().parents[2] / "metalnn" / "cpu" / "native" / "fastmath"
UNARY = "Exp|Sigmoid|Silu|Tanh|GeluTanh"


def _arrays():
    rng = np.random.default_rng(0)

    def a(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    w, s, b = mx.quantize(a(64, 64), group_size=64, bits=4)
    # 8 rows of two 18-byte blocks: a packed weight of K = 64 read as Q4_0 or as IQ4_NL alike
    wg = mx.array(rng.integers(0, 256, size=(8, 36), dtype=np.uint8))
    arrays = {
        "x": a(2, 3, 8, 16), "g": a(2, 3, 8, 16), "w16": a(16), "image": a(2, 3, 9), "cols": a(2, 12, 3),
        "xq": a(3, 64), "wq": w, "sq": s, "bq": b, "wg": wg,
        "logits": a(6, 10), "targets": mx.array([0, 3, 9, 1, 2, 5]), "g6": a(6), "scores": a(2, 8, 8),
        "p": a(4, 8), "gp": a(4, 8), "m": a(4, 8), "v": mx.abs(a(4, 8)), "lr": mx.array(1e-3), "step": mx.array(3.0),
        # a decoder block: width 16, 2 query heads and 1 key/value head of 8, MLP width 24, cache of 4
        "bx": a(1, 1, 16), "w16b": a(16), "wq16": a(16, 16), "wk8": a(8, 16), "wv8": a(8, 16), "wo16": a(16, 16),
        "wg24": a(24, 16), "wu24": a(24, 16), "wd16": a(16, 24), "kc": a(1, 1, 4, 8), "vc": a(1, 1, 4, 8),
        "inv4": mx.abs(a(4)), "sc": a(1, 2, 1, 1, 4, 8),  # (the stack's cache of that one block)
        # a stack's cache of two such blocks and two positions' keys and values for one of them
        "sc2": a(2, 2, 1, 1, 4, 8), "kn": a(1, 1, 2, 8), "vn": a(1, 1, 2, 8),
        # causal attention q [1, 2, 8, 32] over 1 key/value head (output [1, 8, 2, 32]); gated delta [B 1, T 6, H 2, K 8, V 8]
        "aq": a(1, 2, 8, 32), "ak": a(1, 1, 8, 32), "av": a(1, 1, 8, 32), "ag": a(1, 8, 2, 32),
        "dq": a(1, 6, 2, 8), "dk": a(1, 6, 2, 8), "dv": a(1, 6, 2, 8), "dg": -mx.abs(a(1, 6, 2)),
        "db": mx.sigmoid(a(1, 6, 2)), "dh": a(1, 2, 8, 8),
    }
    mx.eval(arrays)
    return arrays


def _vjp(fn, n_wrt):
    """The VJP of fn with respect to its first n_wrt arguments (the last argument is the cotangent)."""
    def grads(*args):
        *primals, cot = args
        rest = primals[n_wrt:]
        return mx.vjp(lambda *p: fn(*p, *rest), primals[:n_wrt], [cot])[1]
    return grads


def _cases(ext):
    """name: (label pattern, op(**params) -> fn(*inputs), input names, base params, {field: params})."""
    win = dict(kernel=[3], stride=[3], padding=[1], dilation=[1])  # L = 3 output positions on 9 (or 8) inputs
    win_variants = {"kernel": {"kernel": [4]}, "stride": {"stride": [4]}, "padding": {"padding": [0]},
                    "dilation": {"dilation": [2]}}
    qmm = dict(group_size=64, bits=4)
    # the same packed weight and scales read as 8-bit values in groups of 32 (x @ W: x fits either)
    qmm_bits = {"bits": {"group_size": 32, "bits": 8}}
    # the same packed bytes read as another GGML type of the same block layout (Q4_0 -> IQ4_NL)
    ggml_type = {"type": {"type_id": 20}}
    rope = dict(dims=16, traditional=False, base=10000.0, scale=1.0, offset=0)
    softmax = dict(scale=0.5, causal=True, q_len=8, offset=0)
    adam = dict(b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, bias_correction=True)
    step = dict(heads=2, kv_heads=1, head_dim=8, rope_dims=8, rope_traditional=False, rope_scale=1.0, attn_scale=0.3,
                eps=1e-5, qk_eps=1e-6, window=0, qk_norm=False, gelu=False, types=[-1] * 7, bias=[False] * 7,
                offset=1)
    step_inputs = ["bx", "w16", "w16b", "wq16", "wk8", "wv8", "wo16", "wg24", "wu24", "wd16", "kc", "vc", "inv4"]
    # the stack step of that one block: its parameters held by a `StackParams` (the block step's
    # inputs without x and the caches), and the numbers of `step` as StackParams lists them (ints:
    # heads, kv_heads, head_dim, rope_dims, rope_traditional, window, qk_norm, gelu, 7 types, 7
    # biases; floats: rope_scale, attn_scale, eps, qk_eps). Two StackParams are two parameter sets
    # (even of equal numbers): a step's node is equivalent only to one of the same StackParams.
    ints = [2, 1, 8, 8, 0, 0, 0, 0] + [-1] * 7 + [0] * 7
    floats = [1.0, 0.3, 1e-5, 1e-6]
    held = _arrays()
    params = [held[n] for n in step_inputs[1:-3] + ["inv4"]]
    stacks = {"base": ext.StackParams(params, ints, floats), "other": ext.StackParams(params, ints, [0.5] + floats[1:])}
    stack = dict(which="base", offset=1)

    def stack_step(which, offset):
        return lambda x, cache: ext.decoder_stack_step(x, cache, stacks[which], offset=offset)

    return {
        "FastUnary": (f"Fast({UNARY})", lambda kind: getattr(ext, kind), ["x"], {"kind": "silu"},
                      {"kind": {"kind": "tanh"}}),
        # silu and gelu_tanh: both gradients read the input x (the others read the output)
        "FastUnaryGrad": (f"Fast({UNARY})Grad", lambda kind: _vjp(getattr(ext, kind), 1), ["x", "g"],
                          {"kind": "silu"}, {"kind": {"kind": "gelu_tanh"}}),
        "FastSoftmax": ("FastSoftmax", lambda: ext.softmax, ["x"], {}, {}),
        "FastSoftmaxGrad": ("FastSoftmaxGrad", lambda: ext.softmax_grad, ["x", "g"], {}, {}),
        "Im2Col": ("Im2Col", lambda **w: lambda t: ext.im2col(t, **w), ["image"], win, win_variants),
        "Col2Im": ("Col2Im", lambda **w: lambda c: ext.col2im(c, **w), ["cols"], dict(output_size=[9], **win),
                   {"output_size": {"output_size": [8]}, **win_variants}),
        "AffineQuantizedMatmul": ("AffineQuantizedMatmul", lambda **p: lambda *a: ext.quantized_matmul(*a, **p),
                                  ["xq", "wq", "sq", "bq"], dict(transpose=False, **qmm),
                                  {"transpose": {"transpose": True}, **qmm_bits}),
        "AffineDequantize": ("AffineDequantize", lambda **p: lambda *a: ext.dequantize(*a, **p), ["wq", "sq", "bq"],
                             qmm, qmm_bits),
        "GGMLMatmul": ("GGMLMatmul", lambda type_id: lambda x, w: ext.ggml_matmul(x, w, type_id), ["xq", "wg"],
                       {"type_id": 2}, ggml_type),
        "GGMLDequantize": ("GGMLDequantize", lambda type_id: lambda w: ext.ggml_dequantize(w, type_id), ["wg"],
                           {"type_id": 2}, ggml_type),
        "RmsNorm": ("MetalnnRMSNorm", lambda eps: lambda t, w: ext.rms_norm(t, w, eps), ["x", "w16"],
                    {"eps": 1e-5}, {"eps": {"eps": 1e-3}}),
        "RmsNormVJP": ("MetalnnRMSNormVJP", lambda eps: _vjp(lambda t, w: ext.rms_norm(t, w, eps), 2),
                       ["x", "w16", "g"], {"eps": 1e-5}, {"eps": {"eps": 1e-3}}),
        "Rope": ("MetalnnRoPE", lambda **p: lambda t: ext.rope(t, **p), ["x"], rope,
                 {"dims": {"dims": 8}, "traditional": {"traditional": True}, "inv_freq": {"base": 500.0},
                  "scale": {"scale": 0.5}, "offset": {"offset": 3}}),
        "Gated": ("MetalnnGated", lambda act: lambda a, b: ext.gated(a, b, act), ["x", "g"], {"act": "silu"},
                  {"kind": {"act": "gelu_tanh"}}),
        "GatedVJP": ("MetalnnGatedVJP", lambda act: _vjp(lambda a, b: ext.gated(a, b, act), 2), ["x", "g", "g"],
                     {"act": "silu"}, {"kind": {"act": "gelu_tanh"}}),
        "CrossEntropy": ("MetalnnCrossEntropy", lambda ls: lambda x, t: ext.cross_entropy(x, t, ls),
                         ["logits", "targets"], {"ls": 0.0}, {"label_smoothing": {"ls": 0.1}}),
        "CrossEntropyVJP": ("MetalnnCrossEntropyVJP", lambda ls: _vjp(lambda x, t: ext.cross_entropy(x, t, ls), 1),
                            ["logits", "targets", "g6"], {"ls": 0.1}, {}),
        "ScaledSoftmax": ("MetalnnScaledSoftmax", lambda **p: lambda t: ext.scaled_softmax(t, **p), ["scores"],
                          softmax, {"scale": {"scale": 0.25}, "causal": {"causal": False}, "q_len": {"q_len": 4},
                                    "offset": {"offset": 1}}),
        "ScaledSoftmaxVJP": ("MetalnnScaledSoftmaxVJP", lambda **p: _vjp(lambda t: ext.scaled_softmax(t, **p), 1),
                             ["scores", "scores"], softmax, {}),
        "LayoutCopy": ("MetalnnLayoutCopy", lambda: ext.contiguous, ["x"], {}, {}),
        "AdamWUpdate": ("MetalnnAdamW", lambda **h: lambda *a: ext.adamw_update(*a, **h),
                        ["p", "gp", "m", "v", "lr", "step"], adam,
                        {"b1": {"b1": 0.8}, "b2": {"b2": 0.99}, "eps": {"eps": 1e-6},
                         "weight_decay": {"weight_decay": 0.0}, "bias_correction": {"bias_correction": False}}),
        "CausalAttention": ("MetalnnCausalAttention", lambda scale: lambda q, k, v: ext.causal_attention(q, k, v, scale),
                            ["aq", "ak", "av"], {"scale": 0.2}, {"scale": {"scale": 0.3}}),
        "CausalAttentionVJP": ("MetalnnCausalAttentionVJP",
                               lambda scale: _vjp(lambda q, k, v: ext.causal_attention(q, k, v, scale), 3),
                               ["aq", "ak", "av", "ag"], {"scale": 0.2}, {"scale": {"scale": 0.3}}),
        # no parameters: the recurrence is fixed (its backward reads its forward's outputs)
        "GatedDelta": ("MetalnnGatedDelta", lambda: lambda *a: ext.gated_delta(*a)[0],
                       ["dq", "dk", "dv", "dg", "db", "dh"], {}, {}),
        "GatedDeltaVJP": ("MetalnnGatedDeltaVJP", lambda: _vjp(lambda *a: ext.gated_delta(*a)[0], 6),
                          ["dq", "dk", "dv", "dg", "db", "dh", "dv"], {}, {}),
        "DecoderBlockStep": ("DecoderBlockStep", lambda **p: lambda *a: ext.decoder_block_step(list(a), **p),
                             step_inputs, step,
                             {"rope_traditional": {**step, "rope_traditional": True},
                              "rope_scale": {**step, "rope_scale": 0.5}, "attn_scale": {**step, "attn_scale": 0.2},
                              "eps": {**step, "eps": 1e-3}, "qk_eps": {**step, "qk_eps": 1e-3},
                              "window": {**step, "window": 1}, "gelu": {**step, "gelu": True},
                              "offset": {**step, "offset": 2}}),
        "DecoderStackStep": ("DecoderStackStep", stack_step, ["bx", "sc"], stack,
                             {"params": {**stack, "which": "other"}, "offset": {**stack, "offset": 2}}),
        # its cache write (output 1)
        "CacheColumnWrite": ("CacheColumnWrite", lambda offset: lambda *a: stack_step("base", offset)(*a)[1],
                             ["bx", "sc"], {"offset": 1}, {"offset": {"offset": 2}}),
        "StackColumnsWrite": ("StackColumnsWrite",
                              lambda **p: lambda c, k, v: ext.stack_columns_write(c, k, v, **p), ["sc2", "kn", "vn"],
                              {"slot": 0, "start": 1}, {"slot": {"slot": 1, "start": 1}, "start": {"slot": 0, "start": 2}}),
    }


CASE_NAMES = ["FastUnary", "FastUnaryGrad", "FastSoftmax", "FastSoftmaxGrad", "Im2Col", "Col2Im",
              "AffineQuantizedMatmul", "AffineDequantize", "GGMLMatmul", "GGMLDequantize", "RmsNorm", "RmsNormVJP",
              "Rope", "Gated", "GatedVJP", "CrossEntropy", "CrossEntropyVJP", "ScaledSoftmax", "ScaledSoftmaxVJP",
              "LayoutCopy", "AdamWUpdate", "CausalAttention", "CausalAttentionVJP", "GatedDelta", "GatedDeltaVJP",
              "DecoderBlockStep", "DecoderStackStep", "CacheColumnWrite", "StackColumnsWrite"]
VARIED = [(name, field) for name, fields in [
    ("FastUnary", ["kind"]), ("FastUnaryGrad", ["kind"]),
    ("Im2Col", ["kernel", "stride", "padding", "dilation"]),
    ("Col2Im", ["output_size", "kernel", "stride", "padding", "dilation"]),
    ("AffineQuantizedMatmul", ["transpose", "bits"]), ("AffineDequantize", ["bits"]),
    ("GGMLMatmul", ["type"]), ("GGMLDequantize", ["type"]),
    ("RmsNorm", ["eps"]), ("RmsNormVJP", ["eps"]),
    ("Rope", ["dims", "traditional", "inv_freq", "scale", "offset"]),
    ("Gated", ["kind"]), ("GatedVJP", ["kind"]), ("CrossEntropy", ["label_smoothing"]),
    ("ScaledSoftmax", ["scale", "causal", "q_len", "offset"]),
    ("AdamWUpdate", ["b1", "b2", "eps", "weight_decay", "bias_correction"]),
    ("CausalAttention", ["scale"]), ("CausalAttentionVJP", ["scale"]),
    ("DecoderBlockStep", ["rope_traditional", "rope_scale", "attn_scale", "eps", "qk_eps", "window", "gelu", "offset"]),
    ("DecoderStackStep", ["params", "offset"]), ("CacheColumnWrite", ["offset"]),
    ("StackColumnsWrite", ["slot", "start"]),
] for field in fields]


@pytest.fixture(scope="module")
def ext():
    mod = native_ext.extension()
    assert mod is not None, native_ext.unavailable_reason()
    return mod


@pytest.fixture(scope="module")
def arrays():
    return _arrays()


def _flat(out):
    return [a for o in (out if isinstance(out, (list, tuple)) else [out])
            for a in (o if isinstance(o, (list, tuple)) else [o])]


def _nodes(ext, arrays, name, params_a, params_b):
    """Nodes named like the primitive `name` in the compiled graph of op(params_a) and op(params_b)."""
    pattern, op, inputs, _, _ = _cases(ext)[name]
    fa, fb = op(**params_a), op(**params_b)

    def both(*args):
        return sum(mx.sum(a) for a in _flat(fa(*args)) + _flat(fb(*args)))

    out = mx.compile(both)(*[arrays[i] for i in inputs])
    buf = io.StringIO()
    mx.export_to_dot(buf, out)
    labels = re.findall(r'label ="([^"]*)"', buf.getvalue())
    return [label for label in labels if re.fullmatch(pattern, label)]


def test_every_primitive_is_covered(ext):
    """Each primitive declares its name and is_equivalent through METALNN_PRIMITIVE, and has a case here."""
    sources = "".join(p.read_text() for p in sorted(SOURCES.glob("*.cpp")))
    assert "is_equivalent" not in sources
    assert sources.count("METALNN_PRIMITIVE(") == len(CASE_NAMES) == 29
    assert list(_cases(ext)) == CASE_NAMES


@pytest.mark.parametrize("name", CASE_NAMES)
def test_same_parameters_make_one_node(ext, arrays, name):
    base = _cases(ext)[name][3]
    found = _nodes(ext, arrays, name, base, base)
    assert len(found) == 1, f"{name}: two applications with the same parameters were not merged: {found}"


@pytest.mark.parametrize(("name", "field"), VARIED, ids=[f"{n}-{f}" for n, f in VARIED])
def test_each_parameter_keeps_two_nodes(ext, arrays, name, field):
    _, _, _, base, variants = _cases(ext)[name]
    found = _nodes(ext, arrays, name, base, {**base, **variants[field]})
    assert len(found) == 2, f"{name}: applications differing in {field} were merged: {found}"

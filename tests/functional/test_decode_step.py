"""The fused decoding step (`metalnn.functional.decoder_block_step`, one native node per block when
decoding one position on the CPU, and `decoder_stack_step`, one node for a model's whole stack of
such blocks plus one in-place cache write per buffer) against transformers and against the op-by-op
block.

Oracles: transformers' logits of the whole sequence without a cache (float32 models of each block
variant the step runs: GQA, q/k/v biases, q/k norms, sliding windows, Llama 3 RoPE frequencies, no RoPE;
partial and interleaved RoPE, GeGLU and output biases on a block built directly), and for GGML-packed weights the same model run op by op on the ``"reference"`` device
(weights decoded by the MLX decoders, products in MLX).

Tolerances: float32 models 2e-4 of the logits' scale (float32 sums of width <= 128 in a different
order than PyTorch's, through two blocks). GGML weights with float32 products (int8 inputs off)
1e-4. With the int8 inputs of the register kernels (`metalnn.cpu.ggml.set_int8_input_rows`: each 32
inputs rounded to int8 levels of max|x|/127) the check is of the wiring only, 0.1: on these random weights
(whose products cancel far more than trained ones) the logits move by about 3% of their scale,
while a wrong scale or level order moves them by the order of the logits themselves. The products'
own error bound is tested in tests/cpu/test_ggml_native.py.
"""

import io
import re

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

import metalnn as mn
from metalnn.cpu import decode_step as native
from metalnn.cpu import ggml as cpu_ggml
from metalnn.functional.decode_step import StackCache
from metalnn.layers.attention import KVCache
from metalnn.llm.models import load_pretrained
from tests.support import gguf_files
from tests.support.hf_models import hf_logits, hf_model
from native_platform import require_native



@pytest.fixture(autouse=True)
def _native():
    require_native(native.available(), "the fused decoding step")

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
            tie_word_embeddings=False)

VARIANTS = {
    "llama_gqa": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3_rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16))),
    "qwen2_biases": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3_qk_norm": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=16)),
    "mistral_window": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=3)),
    # layer 1 without RoPE (rope_dims 0 in the step) and with a 3-token window
    "smollm3_nope": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, dict(
        no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=3)),
}


def node_names(arr) -> list:
    buf = io.StringIO()
    mx.export_to_dot(buf, arr)
    return re.findall(r'label ?= ?"([A-Za-z_]+)', buf.getvalue())


def decode_logits(model, toks, prompt_len, device=None, batch=False):
    """Logits ``[B, T - prompt_len, vocab]`` of positions prompt_len.. decoded one at a time after a
    prefill of the first prompt_len tokens; also the node names of the last step's graph."""
    cache = model.make_cache()
    model(mx.array(toks[:, :prompt_len]), cache=cache, device=device)
    out, names = [], None
    for t in range(prompt_len, toks.shape[1]):
        logits = model(mx.array(toks[:, t:t + 1]), cache=cache, device=device)
        names = node_names(logits)
        mx.eval(logits)
        out.append(np.array(logits[:, 0]))
    return np.stack(out, axis=1), names


@pytest.fixture
def float_products():
    """GGML products with float32 inputs (the int8 and split inputs of the register kernels off)."""
    ext = cpu_ggml._ext
    old = ext.ggml_get_int8_rows(), ext.ggml_get_split_inputs()
    ext.ggml_set_int8_rows(0)
    ext.ggml_set_split_inputs(False)
    yield
    ext.ggml_set_int8_rows(old[0])
    ext.ggml_set_split_inputs(old[1])


def variant_models(variant, folder):
    """transformers' random model of `VARIANTS[variant]` and metalnn's load of it (saved in ``folder``)."""
    cfg_cls, model_cls, extra = VARIANTS[variant]
    hf = hf_model(cfg_cls, model_cls, **BASE, **extra)
    hf.save_pretrained(folder)
    return hf, load_pretrained(folder)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_decoding_matches_transformers(variant, tmp_path):
    hf, model = variant_models(variant, tmp_path)
    toks = np.random.default_rng(3).integers(0, BASE["vocab_size"], (2, 12))
    got, names = decode_logits(model, toks, 4)
    assert names.count("DecoderStackStep") == 1, names
    assert names.count("CacheColumnWrite") == 1, names  # (every block's new key and value: one write)
    want = hf_logits(hf, toks)[:, 4:]
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-4, f"{variant}: relative error {err:.3g}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_several_positions_run_as_one_stack_node(tmp_path, variant):
    # a prompt of 3, then runs of 4, 1 and 4 new positions (a prompt's rest after a cached prefix,
    # draft tokens to verify), each call one fused node for every block, the final norm and the head:
    # position t of a run attends to the cache and to the run's positions up to its own (the windows
    # of 3 cross from the cache into the run); the logits are transformers' for the whole sequence at
    # once (a relative 2e-4, as decoding one position at a time); a run's last position alone
    # (last_only) is that run's last row
    hf, model = variant_models(variant, tmp_path)
    toks = np.random.default_rng(11).integers(0, BASE["vocab_size"], (2, 12))
    want = hf_logits(hf, toks)
    cache = model.make_cache()
    got, start = [], 0
    for n in (3, 4, 1, 4):
        logits = model(mx.array(toks[:, start:start + n]), cache=cache)
        names = node_names(logits)
        assert names.count("DecoderStackStep") == 1 and "Matmul" not in names, names
        got.append(np.array(logits))
        start += n
    got = np.concatenate(got, axis=1)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-4, f"{variant}: relative error {err:.3g}"
    assert [c.offset for c in cache] == [12] * len(cache)
    for c in cache:
        c.offset -= 4
    last = np.array(model(mx.array(toks[:, 8:]), cache=cache, last_only=True))
    assert last.shape == (2, 1, BASE["vocab_size"])
    np.testing.assert_allclose(last[:, 0], got[:, -1], rtol=0, atol=1e-5 * np.abs(got).max())
    # one position a row with last_only as a list of rows (each row's position 0) is fused too
    for c in cache:
        c.offset -= 1
    one = model(mx.array(toks[:, 11:]), cache=cache, last_only=[0, 0])
    assert "DecoderStackStep" in node_names(one)
    np.testing.assert_allclose(np.array(one)[:, 0], got[:, -1], rtol=0, atol=1e-5 * np.abs(got).max())


def test_several_positions_past_the_stack_limit_run_block_by_block(tmp_path):
    # more new positions than STACK_POSITIONS: the blocks run one by one (a long prompt's products
    # are faster dequantised into a float product than read row by row)
    from metalnn.functional.decode_step import STACK_POSITIONS

    hf = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, **BASE)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    cache = model.make_cache()
    toks = np.random.default_rng(12).integers(0, BASE["vocab_size"], (1, STACK_POSITIONS + 1))
    logits = model(mx.array(toks), cache=cache)
    assert "DecoderStackStep" not in node_names(logits)
    want = hf_logits(hf, toks)
    assert np.abs(np.array(logits) - want).max() / np.abs(want).max() < 2e-4


def test_cache_growth_while_fused(tmp_path, monkeypatch):
    # capacity grows in blocks of KVCache.step; the cached positions are copied into the bigger
    # buffers the fused step then writes into
    monkeypatch.setattr(KVCache, "step", 3)
    hf = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, **BASE)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    toks = np.random.default_rng(4).integers(0, BASE["vocab_size"], (1, 14))
    got, _ = decode_logits(model, toks, 2)
    want = hf_logits(hf, toks)[:, 2:]
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-4


def test_fused_step_falls_back_for_other_devices_and_adapters(tmp_path):
    hf = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, **BASE)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    toks = np.random.default_rng(5).integers(0, BASE["vocab_size"], (1, 7))
    want = hf_logits(hf, toks)[:, 4:]
    got, names = decode_logits(model, toks, 4, device=mn.Device(kernels="reference"))
    assert "DecoderBlockStep" not in names and "DecoderStackStep" not in names
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-4
    # a LoRA adapter on a projection: the block runs op by op (the adapter's output counts)
    mn.lora.apply(model, rank=2, targets=("q_proj",))
    _, names = decode_logits(model, toks, 4)
    assert "DecoderBlockStep" not in names and "DecoderStackStep" not in names


# relative error of the logits allowed with float32 inputs, split inputs (each input within 1/254 of
# an int8 level's rounding: the int8 tolerance / 254 is 4e-4, 1e-3 allowed) and int8 inputs
INPUT_TOLERANCE = {"float": 1e-4, "split": 1e-3, "int8": 0.1}


@pytest.mark.parametrize("inputs", sorted(INPUT_TOLERANCE))
def test_fused_decoding_with_ggml_weights(tmp_path, inputs, float_products):
    hf = gguf_files.hf_model("llama", vocab=400, seed=2)
    path = tmp_path / "m.gguf"
    # block types only (the half-precision types load as float16 layers, which run op by op)
    gguf_files.write(path, hf, types={**gguf_files.TYPES, "attn_output.weight": gguf_files.Q.Q5_0,
                                      "ffn_up.weight": gguf_files.Q.Q5_1})
    model = load_pretrained(path)
    cpu_ggml._ext.ggml_set_int8_rows(4 if inputs == "int8" else 0)
    cpu_ggml._ext.ggml_set_split_inputs(inputs == "split")
    toks = np.random.default_rng(6).integers(0, 400, (2, 10))
    got, names = decode_logits(model, toks, 3)
    assert names.count("DecoderStackStep") == 1, names
    cpu_ggml._ext.ggml_set_int8_rows(0)
    cpu_ggml._ext.ggml_set_split_inputs(False)
    want, ref_names = decode_logits(model, toks, 3, device=mn.Device(kernels="reference"))
    assert "DecoderStackStep" not in ref_names
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < INPUT_TOLERANCE[inputs], err


@pytest.mark.parametrize("head", ["gguf_q4_1", "gguf_tied_q8_0", "float", "float_tied"])
def test_fused_head_equals_the_model_head(tmp_path, monkeypatch, head, float_products):
    # the stack step ends with the final norm and the output head (lm_head, or the token table when
    # tied): the logits are the stack node's output, no head node after it. With a GGML head they
    # equal the model's own norm and head bit for bit (the same norm and product kernels); with a
    # float32 head they are the same sums in another order than MLX's matmul (a relative 1e-5).
    from metalnn.llm.models.decoder import DecoderStack

    tied = "tied" in head
    if head.startswith("gguf"):
        hf = gguf_files.hf_model("llama", vocab=400, tie=tied, seed=4)
        path = tmp_path / "m.gguf"
        gguf_files.write(path, hf, types={**gguf_files.TYPES, "attn_output.weight": gguf_files.Q.Q5_0,
                                          "ffn_up.weight": gguf_files.Q.Q5_1})
        vocab = 400
    else:
        hf = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, **{**BASE, "tie_word_embeddings": tied})
        hf.save_pretrained(tmp_path)
        path, vocab = tmp_path, BASE["vocab_size"]
    model = load_pretrained(path)
    toks = np.random.default_rng(7).integers(0, vocab, (2, 9))
    fused, names = decode_logits(model, toks, 4)
    assert names.count("DecoderStackStep") == 1 and not {"GGMLMatmul", "Matmul", "MetalnnRMSNorm"} & set(names), names
    # (the prompt's 4 positions through the fused head in both runs: the caches then hold the same numbers)
    fused_logits = DecoderStack.fused_logits
    monkeypatch.setattr(DecoderStack, "fused_logits", lambda self, device, ids, cache, head, **kw: fused_logits(
        self, device, ids, cache, head, **kw) if ids.shape[1] > 1 else None)
    own, own_names = decode_logits(model, toks, 4)
    assert own_names.count("DecoderStackStep") == 1 and {"GGMLMatmul", "Matmul"} & set(own_names), own_names
    if head.startswith("gguf"):
        np.testing.assert_array_equal(fused, own)
    else:
        assert np.abs(fused - own).max() <= 1e-5 * np.abs(own).max()
    assert np.abs(own).max() > 0


def test_fused_head_falls_back_where_it_does_not_apply(tmp_path):
    # an adapter on lm_head: the stack step ends at the last block and the model's own norm and head
    # (with the adapter's product) follow
    hf = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, **BASE)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    toks = np.random.default_rng(8).integers(0, BASE["vocab_size"], (1, 6))
    mn.lora.apply(model, rank=2, targets=("lm_head",))
    _, names = decode_logits(model, toks, 4)
    assert names.count("DecoderStackStep") == 1 and "Matmul" in names, names


def test_fused_step_has_no_gradient(tmp_path):
    hf = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, **BASE)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    x = mx.random.normal((1, 1, BASE["hidden_size"]))

    def f(x):
        cache = KVCache()
        return model.model.layers[0](x, cache=cache).sum()

    with pytest.raises(ValueError, match="decoding only"):
        mx.grad(f)(x)


def test_bad_inputs_name_the_tensor():
    D, hd, H, G, I = 32, 8, 4, 2, 48
    f32 = lambda *s: mx.zeros(s, mx.float32)  # noqa: E731
    weights = [f32(H * hd, D), f32(G * hd, D), f32(G * hd, D), f32(D, H * hd), f32(I, D), f32(I, D), f32(D, I)]
    kw = dict(offset=0, heads=H, kv_heads=G, head_dim=hd, rope_dims=hd, rope_traditional=False, rope_scale=1.0,
              attn_scale=hd ** -0.5, eps=1e-5)
    args = lambda ws, cap=4: (f32(1, 1, D), (f32(D), f32(D)), ws, [-1] * 7, [None] * 7,  # noqa: E731
                              f32(1, G, cap, hd), f32(1, G, cap, hd), f32(hd // 2))
    out, k, v = native.decoder_block_step(*args(weights), **kw)
    assert out.shape == (1, 1, D) and k.shape == v.shape == (1, G, 1, hd)
    bad = list(weights)
    bad[1] = f32(G * hd + 1, D)
    with pytest.raises(ValueError, match=r"k_proj must be float32 of shape \(16, 32\), got float32 of shape \(17, 32\)"):
        native.decoder_block_step(*args(bad), **kw)
    with pytest.raises(ValueError, match="outside the cache capacity 4"):
        native.decoder_block_step(*args(weights), **{**kw, "offset": 4})
    bad = list(weights)
    bad[4] = mx.zeros((I, D // 32 * 34), mx.uint8)
    with pytest.raises(ValueError, match="gate_proj must be uint8 of shape"):
        t = [-1] * 7
        t[4] = 2  # Q4_0: 18 bytes a block
        native.decoder_block_step(*args(bad)[:3], t, *args(bad)[4:], **kw)
    with pytest.raises(ValueError, match="activation must be silu or gelu_tanh"):
        native.decoder_block_step(*args(weights), **kw, activation="relu")


def last_step_fused_and_op_by_op(block, x):
    """``(fused, reference, fused cache, reference cache)``: the block built and given random
    parameters (gains near 1), ``x [B, T, D]``'s first T - 1 positions run into two caches op by op,
    then position T through the fused step (which must be what ran) and op by op."""
    from mlx.utils import tree_flatten, tree_unflatten

    block(x[:, :2])  # builds it
    params = tree_flatten(block.parameters())
    block.update(tree_unflatten([(k, mx.random.normal(v.shape, key=mx.random.key(i)) * 0.3 + (1.0 if "norm" in k else 0.0))
                                 for i, (k, v) in enumerate(params)]))
    ref, fused = KVCache(), KVCache()
    dev = mn.Device(kernels="reference")
    t = x.shape[1] - 1
    block(x[:, :t], cache=ref, device=dev)
    block(x[:, :t], cache=fused, device=dev)
    want = block(x[:, t:], cache=ref, device=dev)
    got = block(x[:, t:], cache=fused)
    assert "DecoderBlockStep" in node_names(got)
    return got, want, fused, ref


def test_single_step_matches_op_by_op_block_with_gelu_and_partial_interleaved_rope():
    # a block built directly: GeGLU (tanh) gate, interleaved RoPE pairs on half of each head, biases
    block = mn.layers.TransformerBlock(4, 40, num_kv_heads=2, rope_traditional=True, rope_dims=4, attention_bias=True,
                                       attention_out_bias=True, mlp_bias=True, activation="gelu_tanh")
    got, want, fused, ref = last_step_fused_and_op_by_op(block, mx.random.normal((3, 5, 32), key=mx.random.key(0)))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4 * float(mx.abs(want).max()))
    assert fused.offset == ref.offset == 5
    np.testing.assert_allclose(np.array(fused.state[0]), np.array(ref.state[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [12, 40, 64, 128, 264])
def test_attention_over_a_long_cache_matches_op_by_op(head_dim):
    """The step's attention kernels (decode_attention.h): the AVX2 one for head sizes that are a
    multiple of 8 up to 256 (64 and 128 compiled for their size, 40 the general one), the portable
    loop for 12 and 264; 2 query heads a key/value head, 300 cached positions. Tolerance as the other
    single-step checks (1e-4 of the output's scale): float32 sums of <= 300 terms in another order."""
    heads = 4
    block = mn.layers.TransformerBlock(heads, 48, num_kv_heads=2)
    x = mx.random.normal((2, 301, heads * head_dim), key=mx.random.key(head_dim))
    got, want, _, _ = last_step_fused_and_op_by_op(block, x)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4 * float(mx.abs(want).max()))


def test_new_weights_reach_the_fused_step(tmp_path):
    # the block's plan is cached until a parameter is assigned: loading other weights must be seen
    hf = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, **BASE)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    toks = np.random.default_rng(7).integers(0, BASE["vocab_size"], (1, 6))
    before, _ = decode_logits(model, toks, 4)
    attn = model.model.layers[1].self_attn
    attn.q_proj.weight = attn.q_proj.weight * 1.5
    model.update({"model": {"layers": [{}, {"mlp": {"down_proj": {"weight": -model.model.layers[1].mlp.down_proj.weight}}}]}})
    got, names = decode_logits(model, toks, 4)
    assert names.count("DecoderStackStep") == 1
    want, _ = decode_logits(model, toks, 4, device=mn.Device(kernels="reference"))
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-4
    assert np.abs(got - before).max() > 0.1 * np.abs(before).max()


def prefilled_llama(tmp_path):
    """A random Llama of `BASE` and its caches after a 3-token prompt."""
    hf = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, **BASE)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    cache = model.make_cache()
    mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
    return model, cache


def test_cache_is_written_in_place(tmp_path):
    # the stack step only reads the caches (kept in one buffer for the whole stack after the first
    # step); its cache write then puts the new position into that same buffer (a copy of every
    # layer's cache per token would cost O(context) a token)
    model, cache = prefilled_llama(tmp_path)
    before = [np.array(cache[i].keys)[:, :, :3] for i in range(len(cache))]
    buffers = set()
    for t in range(6):
        logits = model(mx.array([[4 + t]]), cache=cache)
        assert "DecoderStackStep" in node_names(logits)
        mx.eval(logits)
        store = cache[1].store
        assert isinstance(store, StackCache) and all(c.store is store for c in cache)
        view = np.array(store.buffer, copy=False)
        buffers.add(view.__array_interface__["data"][0])
        del view
    assert len(buffers) == 1, buffers
    assert [c.offset for c in cache] == [9] * len(cache)
    # reading a cache's keys ends its binding: it then owns a view of what it held, the prompt's
    # positions unchanged and the six new ones written
    for i, c in enumerate(cache):
        keys = np.array(c.keys)
        assert c.store is None and keys.shape[2] >= 9
        np.testing.assert_array_equal(keys[:, :, :3], before[i])
        assert (np.abs(keys[:, :, 3:9]).max(axis=-1) > 0).all()


def test_several_positions_go_into_the_stack_cache_in_place(tmp_path):
    # after fused steps the caches are bound to one buffer; a call of several positions (verifying
    # draft tokens) writes them into that buffer, in place, and the caches stay bound, so the next
    # fused step needs no copy of every layer's cache; the logits are those of the whole sequence
    # run at once (a relative 2e-4: the fused step's sums run in another order)
    model, cache = prefilled_llama(tmp_path)
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    for t in toks[3:5]:
        mx.eval(model(mx.array([[t]]), cache=cache))
    store = cache[0].store
    before = np.array(store.buffer, copy=False).__array_interface__["data"][0]
    several = model(mx.array([toks[5:8]]), cache=cache)
    mx.eval(several)
    assert all(c.store is store for c in cache) and [c.offset for c in cache] == [8] * len(cache)
    assert np.array(store.buffer, copy=False).__array_interface__["data"][0] == before
    last = model(mx.array([toks[8:]]), cache=cache)
    mx.eval(last)
    assert np.array(store.buffer, copy=False).__array_interface__["data"][0] == before
    want = np.array(model(mx.array([toks])))
    got = np.concatenate([np.array(several), np.array(last)], axis=1)
    assert np.abs(got - want[:, 5:]).max() <= 2e-4 * np.abs(want).max()


def test_stack_columns_write_puts_its_columns_into_the_buffer_in_place():
    # several positions of one block written into the stack's cache: exactly those columns of that
    # block's keys and values change (checked against NumPy's slice assignment), in the buffer itself
    # (the address does not depend on how far MLX's stream thread has got: the write never asks MLX's
    # donation test); keys given as a transposed view are read through their strides
    rng = np.random.default_rng(3)
    base = rng.standard_normal((3, 2, 2, 2, 8, 4)).astype(np.float32)
    keys = rng.standard_normal((2, 2, 4, 3)).astype(np.float32)  # [B, G, hd, T]: transposed below
    values = rng.standard_normal((2, 2, 3, 4)).astype(np.float32)
    cache = mx.array(base)
    mx.eval(cache)
    before = np.array(cache, copy=False).__array_interface__["data"][0]
    held = cache[2]  # a view of the buffer held elsewhere: MLX would not donate it
    written = native.stack_columns_write(cache, mx.array(keys).transpose(0, 1, 3, 2), mx.array(values),
                                         slot=1, start=5)
    mx.eval(written, held)
    want = base.copy()
    want[1, 0, :, :, 5:8] = keys.transpose(0, 1, 3, 2)
    want[1, 1, :, :, 5:8] = values
    np.testing.assert_array_equal(np.array(written), want)
    assert np.array(written, copy=False).__array_interface__["data"][0] == before


def test_stack_columns_write_copies_a_buffer_it_does_not_own_whole():
    # a view into a larger array is not a buffer of its own: the write goes into a copy and the
    # array it views keeps its numbers
    big = mx.zeros((2, 2, 2, 1, 1, 4, 2))
    mx.eval(big)
    view = big[1]
    written = native.stack_columns_write(view, mx.ones((1, 1, 2, 2)), mx.ones((1, 1, 2, 2)), slot=0, start=2)
    assert np.array(written)[0, :, :, :, 2:].min() == 1 and np.abs(np.array(big)).max() == 0


@pytest.mark.parametrize(("shapes", "options", "message"), [
    (((2, 2, 1, 1, 4, 2), (1, 1, 2, 2), (1, 1, 2, 2)), {"slot": 2, "start": 0}, "slot 2 is outside the cache's 2"),
    (((2, 2, 1, 1, 4, 2), (1, 1, 2, 2), (1, 1, 2, 2)), {"slot": 0, "start": 3}, "columns 3 .. 5 are outside"),
    (((2, 2, 1, 1, 4, 2), (1, 2, 2, 2), (1, 1, 2, 2)), {"slot": 0, "start": 0}, r"keys must be float32 \[1, 1, T, 2\]"),
    (((2, 2, 1, 1, 4, 2), (1, 1, 2, 2), (1, 1, 1, 2)), {"slot": 0, "start": 0}, "different numbers of positions"),
    (((2, 1, 1, 4, 2), (1, 1, 2, 2), (1, 1, 2, 2)), {"slot": 0, "start": 0}, "the cache must be float32"),
])
def test_stack_columns_write_refuses_what_does_not_fit(shapes, options, message):
    cache, keys, values = (mx.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        native.stack_columns_write(cache, keys, values, **options)


def test_stack_step_equals_the_blocks_one_by_one(tmp_path, monkeypatch):
    # the stack runs each block's native step as decoder_block_step does: the same numbers, bit for
    # bit (same kernels, same order); also for a batch of sequences of different lengths
    # (`BatchKVCache`: each row at its own position, its new key and value at its own column)
    from metalnn.layers.batch_cache import merge_rows
    from metalnn.llm.models.decoder import DecoderStack

    hf = hf_model(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, **BASE, head_dim=16)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    toks = np.random.default_rng(8).integers(0, BASE["vocab_size"], (2, 9))

    def ragged_steps():
        groups = []
        for n in (3, 6):
            caches = model.make_cache()
            model(mx.array(toks[:1, :n]), cache=caches)
            groups.append(caches)
        caches = merge_rows(groups)
        out = []
        for t in range(3):
            logits = model(mx.array(toks[:, 6 + t:7 + t]), cache=caches)
            names = node_names(logits)
            out.append(np.array(logits))
        return np.stack(out), [c.lengths for c in caches], names

    # (the final norm and head as the model runs them, in both: see test_fused_head_equals_the_model_head)
    monkeypatch.setattr(DecoderStack, "fused_logits", lambda self, device, ids, cache, head, **kw: None)
    stacked, names = decode_logits(model, toks, 4)
    ragged, lengths, ragged_names = ragged_steps()
    assert names.count("DecoderStackStep") == 1 and ragged_names.count("DecoderStackStep") == 1
    monkeypatch.setattr(DecoderStack, "_fused_step", lambda self, device, h, cache, head=None, **kw: None)
    blocks, block_names = decode_logits(model, toks, 4)
    ragged_blocks, block_lengths, _ = ragged_steps()
    assert block_names.count("DecoderBlockStep") == 2 and "DecoderStackStep" not in block_names
    np.testing.assert_array_equal(stacked, blocks)
    np.testing.assert_array_equal(ragged, ragged_blocks)
    assert lengths == block_lengths == [[6, 9]] * 2


def test_stack_step_leaves_a_buffer_someone_holds(tmp_path):
    # a cache buffer still held elsewhere (here: `held`, the caches' buffer after a first fused step,
    # and `own`, a cache's own buffer before it) is not written: the step writes a copy
    model, cache = prefilled_llama(tmp_path)
    own = cache[0].keys
    own_before = np.array(own)
    mx.eval(model(mx.array([[4]]), cache=cache))
    np.testing.assert_array_equal(np.array(own), own_before)
    held = cache[0].store.buffer
    before = np.array(held)
    mx.eval(model(mx.array([[5]]), cache=cache))
    np.testing.assert_array_equal(np.array(held), before)
    assert cache[0].offset == 5
    new = np.array(cache[0].store.buffer)
    np.testing.assert_array_equal(new[:, :, :, :, :4], before[:, :, :, :, :4])
    assert np.abs(new[:, :, :, :, 4]).max() > 0 and np.abs(before[:, :, :, :, 4]).max() == 0
    np.testing.assert_array_equal(before[0, 0, :, :, :3], own_before[:, :, :3])


def _stack_block(D=32, hd=8, H=4, G=2, I=48, seed=0):
    rng = np.random.default_rng(seed)
    f32 = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32) * 0.2)  # noqa: E731
    weights = [f32(H * hd, D), f32(G * hd, D), f32(G * hd, D), f32(D, H * hd), f32(I, D), f32(I, D), f32(D, I)]
    return dict(gains=(f32(D) + 1, f32(D) + 1), weights=weights, types=[-1] * 7, biases=[None] * 7,
                inv_freq=mx.abs(f32(hd // 2)), heads=H, kv_heads=G, head_dim=hd, rope_dims=hd, rope_traditional=False,
                rope_scale=1.0, attn_scale=hd ** -0.5, eps=1e-5)


def test_bad_stack_inputs_name_the_block():
    D, hd, G = 32, 8, 2
    f32 = lambda *s: mx.zeros(s, mx.float32)  # noqa: E731
    block = _stack_block(D, hd, G=G)
    blocks = native.StackBlocks([block, block])
    cache = f32(2, 2, 1, G, 4, hd)
    out, written = native.decoder_stack_step(f32(1, 1, D), blocks, cache, offset=0)
    assert out.shape == (1, 1, D) and written.shape == (2, 2, 1, G, 4, hd)
    with pytest.raises(ValueError, match=r"the cache must be float32 \[2, 2, 1, 2, capacity, 8\] .*got \(2, 2, 1, 2, 4, 4\)"):
        native.decoder_stack_step(f32(1, 1, D), blocks, f32(2, 2, 1, G, 4, 4), offset=0)
    with pytest.raises(ValueError, match=r"the cache must be float32 .*got a non-float32 array \(2, 2, 1, 2, 4, 8\)"):
        native.decoder_stack_step(f32(1, 1, D), blocks, cache.astype(mx.float16), offset=0)
    with pytest.raises(ValueError, match=r"positions 4 .. 4 are outside the cache capacity 4"):
        native.decoder_stack_step(f32(1, 1, D), blocks, cache, offset=4)
    with pytest.raises(ValueError, match=r"positions 2 .. 4 are outside the cache capacity 4"):
        native.decoder_stack_step(f32(1, 3, D), blocks, cache, offset=2)
    with pytest.raises(ValueError, match=r"x must be float32 \[B, T, 32\] .*got \(1, 1, 16\)"):
        native.decoder_stack_step(f32(1, 1, 16), blocks, cache, offset=0)
    with pytest.raises(ValueError, match=r"x must be float32 \[B, T, 32\] .*got \(1, 0, 32\)"):
        native.decoder_stack_step(f32(1, 0, D), blocks, cache, offset=0)
    with pytest.raises(ValueError, match=r"the cache must be float32 \[1, 2, 1, 2, capacity, 8\]"):
        native.decoder_stack_step(f32(1, 1, D), native.StackBlocks([block]), cache, offset=0)
    with pytest.raises(ValueError, match=r"positions must be int32 of shape \(1,\)"):
        native.decoder_stack_step(f32(1, 1, D), blocks, cache, offset=0, positions=mx.zeros((2,), mx.int32))
    with pytest.raises(ValueError, match=r"block 1: kv_heads 1 and head_dim 8 differ from block 0's \(2, 8\)"):
        native.decoder_stack_step(f32(1, 1, D), native.StackBlocks([block, _stack_block(D, hd, H=4, G=1)]), cache,
                                  offset=0)
    with pytest.raises(ValueError, match="activation must be silu or gelu_tanh"):
        native.StackBlocks([{**block, "activation": "relu"}])
    # the parameters are checked once, when the blocks are prepared
    bad = {**block, "gains": (f32(D), f32(D + 1))}
    with pytest.raises(ValueError, match=r"block 1: post_attention_layernorm gain must be float32 of shape \(32,\)"):
        native.StackBlocks([block, bad])
    with pytest.raises(ValueError, match=r"block 0: down_proj must be float32 of shape \(32, 48\)"):
        native.StackBlocks([{**block, "weights": block["weights"][:6] + [f32(D, 40)]}])


def test_stack_with_token_table_and_head():
    # a stack step that begins with the token table (ids in, the rows scaled) and ends with the final
    # norm and head (logits out) equals the rows looked up, the plain stack step, then the norm and
    # head in NumPy (a relative 1e-5: float32 sums in another order); an id outside the table reads
    # the nearest row (the native step never reads outside the table)
    D, hd, G, V = 32, 8, 2, 11
    rng = np.random.default_rng(9)
    table = mx.array(rng.standard_normal((V, D)).astype(np.float32))
    head_w = mx.array(rng.standard_normal((V + 2, D)).astype(np.float32) * 0.3)
    gain = mx.array(rng.uniform(0.5, 1.5, D).astype(np.float32))
    block = _stack_block(D, hd, G=G, seed=5)
    plain = native.StackBlocks([block, block])
    ends = native.StackBlocks([block, block], head=dict(gain=gain, eps=1e-5, weight=head_w, type=-1),
                              embedding=dict(weight=table, type=-1, scale=1.5))
    cache = mx.zeros((2, 2, 3, G, 4, hd))
    ids = mx.array([[3], [V + 4], [-2]], dtype=mx.int32)
    logits, written = native.decoder_stack_step(ids, ends, cache, offset=0)
    rows = np.array(table)[[3, V - 1, 0]] * np.float32(1.5)
    h, want_written = native.decoder_stack_step(mx.array(rows[:, None, :]), plain, cache, offset=0)
    h = np.array(h)[:, 0]
    normed = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-5) * np.array(gain)
    want = normed @ np.array(head_w).T
    assert logits.shape == (3, 1, V + 2)
    assert np.abs(np.array(logits)[:, 0] - want).max() <= 1e-5 * np.abs(want).max()
    np.testing.assert_array_equal(np.array(written), np.array(want_written))
    u32, _ = native.decoder_stack_step(ids[:1].astype(mx.uint32), ends, cache[:, :, :1], offset=0)
    np.testing.assert_array_equal(np.array(u32), np.array(logits)[:1])
    with pytest.raises(ValueError, match=r"the token ids must be int32 or uint32 \[B, T\] .*got \(3, 1, 32\)"):
        native.decoder_stack_step(mx.zeros((3, 1, D)), ends, cache, offset=0)
    with pytest.raises(ValueError, match=r"the token table must be float32 of shape \(11, 32\), got float16"):
        native.StackBlocks([block], embedding=dict(weight=table.astype(mx.float16), type=-1))
    with pytest.raises(ValueError, match=r"the output head: GGML type id 99 has no native kernel"):
        native.StackBlocks([block], head=dict(gain=gain, eps=1e-5, weight=head_w, type=99))
    with pytest.raises(ValueError, match=r"the final norm's gain must be float32 of shape \(32,\)"):
        native.StackBlocks([block], head=dict(gain=gain[:4], eps=1e-5, weight=head_w, type=-1))


def test_stack_parameters_are_held_and_made_contiguous():
    # the prepared blocks keep their parameters (the caller's references may go) and read a
    # parameter that is a strided view (here a transpose) as its row-major values
    D, hd, G = 32, 8, 2
    block = _stack_block(D, hd, G=G, seed=3)
    x = mx.array(np.random.default_rng(4).standard_normal((2, 1, D)).astype(np.float32))

    def step(blocks):
        out, written = native.decoder_stack_step(x, blocks, mx.zeros((2, 2, 2, G, 4, hd)), offset=0)
        return np.array(out), [np.array(written)]

    want = step(native.StackBlocks([block, block]))
    down = np.array(block["weights"][6])
    strided = dict(block, weights=block["weights"][:6] + [mx.array(np.ascontiguousarray(down.T)).T])  # (a view)
    held = native.StackBlocks([strided, block])
    del strided
    got = step(held)
    np.testing.assert_array_equal(got[0], want[0])
    for a, b in zip(got[1], want[1]):
        np.testing.assert_array_equal(a, b)
    assert np.abs(want[0]).max() > 0


def test_stack_node_reads_only_x_and_the_cache():
    # the parameters live in the prepared blocks, not in the graph: a step's node reads x and the
    # stack's one cache buffer only (before: also every block's ~12 parameters, then every block's
    # two cache buffers)
    D, hd, G = 32, 8, 2
    blocks = native.StackBlocks([_stack_block(D, hd, G=G), _stack_block(D, hd, G=G, seed=1)])
    out, _ = native.decoder_stack_step(mx.zeros((1, 1, D)), blocks, mx.zeros((2, 2, 1, G, 4, hd)), offset=0)
    buf = io.StringIO()
    mx.export_to_dot(buf, out)
    dot = buf.getvalue()
    stack = re.search(r'(\S+) \[label ="DecoderStackStep"', dot).group(1)
    inputs = re.findall(r"(\S+) -> " + re.escape(stack), dot)
    assert len(inputs) == 2, dot

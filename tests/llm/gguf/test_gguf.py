"""GGUF files: models, tokenizers and chat templates read by metalnn against transformers' reading
of the same files (``from_pretrained(folder, gguf_file=...)``, which dequantizes every tensor to
float32 with the gguf package).

The files are written by the tests (`gguf_files`) as llama.cpp writes them: gguf-py's tensor names,
the Llama Q/K row permutation, F32 / F16 / BF16 / Q8_0 / Q4_0 / Q4_1 tensors, byte-level BPE and
SentencePiece vocabularies. Both sides use the exact dequantized values, so logits agree to float32
rounding: 1e-4 absolute on O(1) logits of a 2-layer model.
"""

import os

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

import gguf_files as G
import metalnn as mn
from metalnn import ggml
from metalnn.llm.chat_template import ChatTemplateError
from metalnn.llm.models import load_pretrained, load_tokenizer, read_gguf

transformers.logging.set_verbosity_error()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ATOL = 1e-4
TOKENS = np.random.default_rng(0).integers(0, 400, (2, 11)).tolist()


def _hf(folder, name):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def _hf_tok(folder, name):
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: (folder, file name)} of the GGUF files, written once per module."""
    out = {}
    specs = {
        "llama": dict(model=G.hf_model("llama")),
        "llama_tied": dict(model=G.hf_model("llama", tie=True, seed=1)),
        "qwen2": dict(model=G.hf_model("qwen2"), arch="qwen2"),
        "qwen3": dict(model=G.hf_model("qwen3"), arch="qwen3"),
        "spm": dict(model=None, tokenizer="llama"),
        "spm_nobos": dict(model=None, tokenizer="llama", add_bos=False),
        "llama3_bpe": dict(model=None, pre="llama-bpe", add_bos=True),
        "qwen2_bpe": dict(model=None, pre="qwen2"),
    }
    for name, kw in specs.items():
        folder = tmp_path_factory.mktemp(name)
        G.write(folder / f"{name}.gguf", kw.pop("model"), **kw)
        out[name] = (folder, f"{name}.gguf")
    return out


def _logits(model, tokens):
    return np.array(model(mx.array(tokens)).astype(mx.float32))


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_gguf_llama_matches_transformers(files, name):
    folder, file = files[name]
    hf = _hf(folder, file)
    model = load_pretrained(folder / file)
    with torch.no_grad():
        ref = hf(torch.tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(_logits(model, TOKENS), ref, atol=ATOL, rtol=ATOL)
    # the quantized tensors stay quantized, with the block formats' bits and group size
    layer = model.model.layers[0]
    # the quantized tensors keep the file's blocks
    assert isinstance(layer.self_attn.q_proj, mn.GGMLLinear) and layer.self_attn.q_proj.ggml_type == "Q4_0"
    assert isinstance(layer.mlp.gate_proj, mn.GGMLLinear) and layer.mlp.gate_proj.ggml_type == "Q8_0"
    assert isinstance(model.model.embed_tokens, mn.GGMLEmbedding) and model.model.embed_tokens.ggml_type == "Q8_0"
    assert type(layer.self_attn.o_proj) is mn.Linear  # F16
    assert ("lm_head" in model) == (name == "llama")
    # a folder holding the file loads the same way
    np.testing.assert_array_equal(_logits(load_pretrained(folder), TOKENS[:1]), _logits(model, TOKENS[:1]))


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_gguf_qwen_models_match_transformers(files, name):
    """Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms) GGUF files, end to end."""
    folder, file = files[name]
    hf = _hf(folder, file)
    model = load_pretrained(folder / file)
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[name]
    with torch.no_grad():
        ref = hf(torch.tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(_logits(model, TOKENS), ref, atol=ATOL, rtol=ATOL)


def test_gguf_greedy_generation_matches_transformers(files):
    folder, file = files["llama"]
    hf, model = _hf(folder, file), load_pretrained(folder / file)
    prompt = TOKENS[0][:5]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert mn.generate(model, prompt, 12, eos_token_id=()) == ref


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tensor_names_values_and_config_match_transformers(files, arch):
    """Our reading of the file (renamed, Q/K rows restored, dequantized) equals transformers' state
    dict, for every architecture in the table (Qwen models need no metalnn class for this)."""
    folder, file = files[arch]
    hf = _hf(folder, file)
    ck = read_gguf(folder / file)
    q = ck.config.get("quantization", {})
    ours = {}
    for name, a in ck.tensors.items():
        stem = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")):
            continue
        if name.endswith(".weight") and f"{stem}.scales" in ck.tensors:
            s = q.get(stem, q)
            a = mx.dequantize(a, ck.tensors[f"{stem}.scales"].astype(mx.float32),
                              ck.tensors[f"{stem}.biases"].astype(mx.float32), s["group_size"], s["bits"])
        elif name.endswith(".weight") and isinstance(q.get(stem), dict) and "ggml_type" in q[stem]:   # GGML blocks
            a = ggml.get_type(q[stem]["ggml_type"]).decode(a)
        ours[name] = np.array(a.astype(mx.float32))
    ref = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert set(ours) == set(ref)
    for k in ours:
        np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)
    rc, c = hf.config, ck.config
    assert c["architectures"] == [type(hf).__name__] and c["model_type"] == rc.model_type
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert c[key] == getattr(rc, key), key
    assert c["head_dim"] == (getattr(rc, "head_dim", None) or rc.hidden_size // rc.num_attention_heads)
    assert c["rms_norm_eps"] == pytest.approx(rc.rms_norm_eps, rel=1e-6)
    assert c["rope_theta"] == rc.rope_parameters["rope_theta"]


@pytest.mark.parametrize("name", ["llama", "spm", "spm_nobos", "llama3_bpe", "qwen2_bpe"])
def test_gguf_tokenizer_matches_transformers(files, name):
    folder, file = files[name]
    ref, ours = _hf_tok(folder, file), load_tokenizer(folder / file)
    assert ours.vocab_size == len(ref)
    for text in G.SAMPLES + ["Hello", " Hello", "x<s>y</s>", "<|im_end|><|im_end|>"]:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    assert ours.eos_token_id == ref.eos_token_id and ours.bos_token_id == ref.bos_token_id


def test_gguf_chat_template_matches_transformers(files):
    folder, file = files["llama"]
    ref, ours = _hf_tok(folder, file), load_tokenizer(folder / file)
    chats = [[{"role": "user", "content": "Who begat Enos?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And then?"}]]
    for chat in chats:
        for gen in (True, False):
            want = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True, return_dict=False)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == list(want)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == \
                ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
    # <|im_end|> ends a turn: it is the EOS here, and the model loaded from the file stops at it
    assert ours.eos_token_ids == {ours.token_to_id("<|im_end|>")}
    assert load_pretrained(folder / file).eos_token_ids == ours.eos_token_ids


def test_gguf_quantized_save_round_trip_is_exact(files, tmp_path):
    folder, file = files["llama"]
    model = load_pretrained(folder / file)
    again = load_pretrained(model.save_pretrained(tmp_path / "mlx"))
    assert again.model.layers[1].self_attn.k_proj.ggml_type == "Q4_1"
    np.testing.assert_array_equal(_logits(again, TOKENS), _logits(model, TOKENS))


# -- bad files ----------------------------------------------------------------------------------

def _tiny_model():
    return G.hf_model("llama", vocab=400, seed=3)


def test_truncated_and_corrupt_files(files, tmp_path):
    folder, file = files["llama"]
    data = (folder / file).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(mn.WeightLoadError, match="truncated") as e:
        load_pretrained(cut)
    assert str(cut) in str(e.value) and "(output.weight)" in str(e.value)  # the last tensor in the file
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:5000])  # inside the metadata
    with pytest.raises(mn.WeightLoadError, match="corrupt or truncated GGUF"):
        load_pretrained(head)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(mn.WeightLoadError, match="not a GGUF file"):
        load_pretrained(bad)


def test_tensors_no_model_uses_and_types_no_model_file_holds_are_named(tmp_path):
    extra = {"blk.0.extra_a.weight": (np.zeros((4, 144), np.uint8), Q.Q4_K),  # 256 values per row
             "blk.1.extra_a.weight": (np.zeros((4, 144), np.uint8), Q.Q4_K),
             "blk.0.extra_b.weight": (np.zeros((4, 44), np.uint8), Q.Q5_0)}  # 64 values per row
    path = G.write(tmp_path / "extra.gguf", _tiny_model(), extra_tensors=extra)
    with pytest.raises(mn.WeightLoadError) as e:
        load_pretrained(path)
    msg = str(e.value)
    assert str(path) in msg and "blk.0.extra_a.weight" in msg and "blk.0.extra_b.weight" in msg
    # Q8_K is ggml's intermediate type for products, never a model's weights
    extra = {"blk.0.extra_c.weight": (np.zeros((4, 292), np.uint8), Q.Q8_K)}
    path = G.write(tmp_path / "q8k.gguf", _tiny_model(), extra_tensors=extra)
    with pytest.raises(mn.WeightLoadError, match=r"q8k.gguf: 1 tensor\(s\) cannot be read: blk.0.extra_c.weight "
                       r"\(Q8_K \[4, 256\]: unknown GGML type 'Q8_K'"):
        load_pretrained(path)


def test_unknown_architecture_and_missing_tensor(files, tmp_path):
    path = G.write(tmp_path / "mamba.gguf", None, arch="mamba")
    with pytest.raises(mn.UnsupportedConfigError, match="'mamba' is not supported") as e:
        load_pretrained(path)
    assert str(path) in str(e.value)
    # a file lacking one tensor: one strict error naming it
    folder, file = files["llama"]
    model = G.hf_model("llama")
    sd = model.state_dict()
    del sd["model.layers.1.mlp.up_proj.weight"]

    class Partial(torch.nn.Module):  # what `write` needs: config + state_dict
        config = model.config

        def state_dict(self):
            return sd

    path = G.write(tmp_path / "partial.gguf", Partial())
    with pytest.raises(mn.WeightLoadError, match="1 missing: model.layers.1.mlp.up_proj.weight") as e:
        load_pretrained(path)
    assert str(path) in str(e.value)


def test_chat_template_errors():
    from metalnn.llm.chat_template import render

    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        render(strict, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render("{% for m in messages %}", [])
    # the sandbox refuses attribute tricks
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        render("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])


def _llama_cpp_rope_factors(head_dim, base, scaling):
    """The ``rope_freqs`` tensor llama.cpp's converter writes for Llama 3 rope scaling."""
    import math

    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / scaling["low_freq_factor"], old / scaling["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(scaling["factor"])
        else:
            smooth = (old / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] -
                                                                    scaling["low_freq_factor"])
            out.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_factors_match_transformers_llama3_scaling(tmp_path):
    """Llama 3.x GGUF files carry the rope scaling as per-frequency factors (``rope_freqs``);
    transformers' GGUF reader ignores them, so the oracle is transformers' Llama with the
    original ``rope_scaling`` on the same (float32) weights."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    torch.manual_seed(2)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=10000.0, rope_scaling=scaling, max_position_embeddings=256,
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    factors = _llama_cpp_rope_factors(16, 10000.0, scaling)
    assert factors.max() > 1.0  # the scaling changes some frequencies
    path = G.write(tmp_path / "llama3.gguf", hf, types={}, extra_tensors={"rope_freqs.weight": (factors, Q.F32)})
    model = load_pretrained(path)
    assert model.config["rope_freq_factors"] == pytest.approx(factors.tolist())
    tokens = np.random.default_rng(1).integers(0, 400, (1, 60)).tolist()  # positions past 32
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(_logits(model, tokens), ref, atol=ATOL, rtol=ATOL)

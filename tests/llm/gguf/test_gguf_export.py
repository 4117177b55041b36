"""GGUF export (`metalnn.llm.gguf.export`, ``metalnn export``, ``CausalLM.save_gguf``) against
independent readers: transformers' GGUF reader (it dequantizes with gguf-py) and gguf-py's
``GGUFReader``, and the per-tensor types llama.cpp's ``llama-quantize`` chose for SmolLM2 in each mix.

Tolerances:
* F32 export: logits equal the model's within float32 rounding (1e-4 absolute on O(1) logits).
* F16 / BF16: the same model with its weights rounded to half / bfloat16 (1e-4), so the only
  difference to the model's logits is the weights' rounding.
* Quantized mixes: transformers' logits of the file equal metalnn's logits of its own reading of the
  file (1e-4: both use the exact dequantized values); against the float model, the logits' relative
  RMS error is bounded by `BOUNDS`: a b-bit block quantizer's error is uniform within half a step,
  amax / 2^b, so it halves with each bit; the random weights of these models (no outliers, small
  logits) carry it to the logits as measured: Q8_0 1.7%, Q6_K < 4%, Q5_K_M ~10%, Q4_K_M ~13%,
  Q4_0 ~24%; about twice that is allowed.
  On the tiny models every row is shorter than 256, so Q4_K_M / Q5_K_M are mostly Q5_0 / Q5_1 / Q8_0.
"""

import os

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from gguf import GGUFReader

import gguf_files as G
import gguf_py_cache
from bundled_model import smollm2_gguf_py
from metalnn.cli import main as cli
from metalnn.errors import UnsupportedConfigError
from metalnn.llm.gguf.export import EXPORT_TYPES, save_gguf, tensor_types
from metalnn.llm.models import load_pretrained, load_tokenizer

transformers.logging.set_verbosity_error()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ATOL = 1e-4
TOKENS = np.random.default_rng(0).integers(0, 400, (2, 11)).tolist()
ARCHS = ["llama", "llama_tied", "qwen2", "qwen3"]
#: relative RMS error of a quantized export's logits against the float model's (see the module doc)
BOUNDS = {"Q8_0": 0.035, "Q6_K": 0.06, "Q5_K_M": 0.22, "Q4_K_M": 0.28, "Q4_0": 0.5}

#: the layers whose attn_v / ffn_down llama.cpp's Q4_K_M and Q5_K_M give more bits, on SmolLM2 (30 layers)
MORE = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
#: the types ``llama-quantize F16.gguf OUT.gguf MIX`` wrote for SmolLM2 (rows of 576, ffn_down rows of
#: 1536); a pair is (type in `MORE` layers, type elsewhere); norms are F32
LLAMACPP_TYPES = {
    "Q4_K_M": {"token_embd": "Q8_0", "other": "Q5_0", "attn_v": ("Q8_0", "Q5_0"), "ffn_down": ("Q6_K", "Q4_K")},
    "Q5_K_M": {"token_embd": "Q8_0", "other": "Q5_1", "attn_v": ("Q8_0", "Q5_1"), "ffn_down": ("Q6_K", "Q5_K")},
    "Q6_K": {"token_embd": "Q8_0", "other": "Q8_0", "attn_v": ("Q8_0", "Q8_0"), "ffn_down": ("Q6_K", "Q6_K")},
    "Q8_0": {"token_embd": "Q8_0", "other": "Q8_0", "attn_v": ("Q8_0", "Q8_0"), "ffn_down": ("Q8_0", "Q8_0")},
    "Q4_0": {"token_embd": "Q8_0", "other": "Q4_0", "attn_v": ("Q4_0", "Q4_0"), "ffn_down": ("Q4_0", "Q4_0")},
}


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def _hf_logits(path, tokens=TOKENS):
    with torch.no_grad():
        return _hf(path)(torch.tensor(tokens)).logits.numpy()


def _logits(model, tokens=TOKENS):
    return np.array(model(mx.array(tokens)).astype(mx.float32))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """{name: float32 GGUF file} of tiny random transformers models, written as llama.cpp writes them."""
    specs = {"llama": dict(model=G.hf_model("llama")), "llama_tied": dict(model=G.hf_model("llama", tie=True, seed=1)),
             "qwen2": dict(model=G.hf_model("qwen2"), arch="qwen2"), "qwen3": dict(model=G.hf_model("qwen3"), arch="qwen3")}
    out = {}
    for name, kw in specs.items():
        folder = tmp_path_factory.mktemp(name)
        out[name] = G.write(folder / f"{name}.gguf", kw.pop("model"), types={}, **kw)
    return out


@pytest.fixture(scope="module")
def exports(sources, tmp_path_factory):
    """{(name, type): exported file}: each tiny model (loaded by metalnn) exported to each type with its
    metalnn `Tokenizer` (the tokenizer writer, not a metadata copy)."""
    out = {}
    for name, src in sources.items():
        model, tok = load_pretrained(src), load_tokenizer(src)
        folder = tmp_path_factory.mktemp(f"export_{name}")
        for t in EXPORT_TYPES:
            out[name, t] = model.save_gguf(folder / f"{name}-{t}.gguf", type=t, tokenizer=tok)
    return out


@pytest.mark.parametrize("name", ARCHS)
def test_names_config_and_tokenizer_read_back(sources, exports, name):
    src, out = sources[name], exports[name, "Q4_K_M"]
    want, got = GGUFReader(str(src)), GGUFReader(str(out))
    # tensor names and shapes as llama.cpp's converter (gguf-py's name table) writes them
    assert {t.name: tuple(t.shape) for t in got.tensors} == {t.name: tuple(t.shape) for t in want.tensors}
    assert str(bytes(got.fields["general.architecture"].parts[-1]), "utf-8") == want.fields[
        "general.architecture"].contents()
    a, b = _hf(src).config, _hf(out).config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(a, key) == getattr(b, key), key
    assert a.rope_parameters["rope_theta"] == b.rope_parameters["rope_theta"]
    original, exported = load_tokenizer(src), load_tokenizer(out)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    for text in G.SAMPLES:
        ids = original.encode(text)
        assert exported.encode(text) == ids, text
        assert hf_tok.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False), text
    assert exported.chat_template == original.chat_template == G.CHATML
    assert got.fields["general.file_type"].contents() == 15


@pytest.mark.parametrize("name", ARCHS)
def test_float_exports_equal_the_model(sources, exports, name):
    model = load_pretrained(sources[name])
    want = _logits(model)
    np.testing.assert_allclose(_hf_logits(exports[name, "F32"]), want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(_logits(load_pretrained(exports[name, "F32"])), want, atol=ATOL, rtol=0)
    # F16 / BF16: the model with its weights rounded so (norms stay float32 in the file, as in llama.cpp's)
    for t, dtype in (("F16", torch.float16), ("BF16", torch.bfloat16)):
        hf = _hf(sources[name])
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if p.ndim == 2:
                    p.copy_(p.to(dtype).to(torch.float32))
            rounded = hf(torch.tensor(TOKENS)).logits.numpy()
        np.testing.assert_allclose(_hf_logits(exports[name, t]), rounded, atol=ATOL, rtol=0)
        assert np.abs(rounded - want).max() < (0.02 if t == "F16" else 0.1)


@pytest.mark.parametrize("t", ["Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0"])
@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen3"])
def test_quantized_exports_read_back_exactly_and_stay_close(sources, exports, name, t):
    out = exports[name, t]
    theirs = _hf_logits(out)
    # metalnn reading its own export (packed) and transformers' dequantized reading: the same model
    np.testing.assert_allclose(_logits(load_pretrained(out)), theirs, atol=ATOL, rtol=0)
    want = _logits(load_pretrained(sources[name]))
    error = np.linalg.norm(theirs - want) / np.linalg.norm(want)
    assert error < BOUNDS[t], (t, error)


def test_mix_types_match_llama_quantize_on_smollm2():
    """`tensor_types` on SmolLM2's tensors gives the types llama-quantize chose (`LLAMACPP_TYPES`)."""
    reader = smollm2_gguf_py()
    shapes = {t.name: tuple(int(s) for s in reversed(t.shape)) for t in reader.tensors}
    for mix, table in LLAMACPP_TYPES.items():
        got = tensor_types(shapes, mix)
        for name, shape in shapes.items():
            parts = name.split(".")
            kind = parts[2] if parts[0] == "blk" else parts[0]
            if len(shape) == 1:
                want = "F32"
            elif kind == "token_embd":
                want = table["token_embd"]
            elif kind in ("attn_v", "ffn_down"):
                want = table[kind][0 if int(parts[1]) in MORE else 1]
            else:
                want = table["other"]
            assert got[name] == want, (mix, name)
    assert set(tensor_types(shapes, "F16").values()) == {"F16", "F32"}


def test_smollm2_export_loads_and_matches(tmp_path):
    """SmolLM2 (Q4_1 file, dequantized) exported to Q8_0 by the command: llama.cpp's metadata and
    tokenizer copied; every tensor, as gguf-py dequantizes it, is the source's within Q8_0's rounding
    (half a step, amax / 254 of its block; checked as relative RMS <= 1%: measured 0 to 0.65%, the same
    every run: one file, one rounding), so names,
    shapes and layouts survive; metalnn's reading of the export decodes as the source's.
    (transformers' reading of a Q8_0 export equals metalnn's in `test_quantized_exports_read_back_exactly_and_stay_close`
    on the small models; on this file it takes transformers half a minute to parse the vocabulary.)"""
    from gguf import dequantize

    from metalnn.llm.bundled import smollm2_path

    src = smollm2_path()
    out = tmp_path / "smollm2-q8_0.gguf"
    assert cli(["export", str(src), str(out), "--type", "q8_0"]) == 0
    want, got = smollm2_gguf_py(), gguf_py_cache.parse(out)
    assert sorted(t.name for t in got.tensors) == sorted(t.name for t in want.tensors)
    assert {t.tensor_type.name for t in got.tensors} == {"Q8_0", "F32"}
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template", "llama.block_count",
                "llama.rope.freq_base", "llama.attention.head_count_kv", "llama.context_length"):
        assert got.fields[key].contents() == want.fields[key].contents(), key
    sources = {t.name: t for t in want.tensors}
    for t in got.tensors:
        a = dequantize(sources[t.name].data, sources[t.name].tensor_type).astype(np.float64)
        b = dequantize(t.data, t.tensor_type).astype(np.float64)
        assert a.shape == b.shape, t.name
        rel = np.sqrt(np.mean((a - b) ** 2) / max(np.mean(a ** 2), 1e-30))
        assert rel <= 0.01, f"{t.name}: relative RMS error {rel:.4f} against the source"
    original, exported = load_tokenizer(src), load_tokenizer(out)
    for text in G.SAMPLES:
        assert exported.encode(text) == original.encode(text)
    tokens = [original.encode("In the beginning God created the heaven and the earth.")]
    ours = _logits(load_pretrained(out), tokens)
    base = _logits(load_pretrained(src), tokens)  # the Q4_1 model the export started from
    assert (ours.argmax(-1) == base.argmax(-1)).mean() >= 0.9


def test_lora_fused_model_exports(sources, tmp_path):
    """A fine-tuned model: adapters fused, then exported; the export equals the fused model."""
    from metalnn.llm.tuner import lora

    model = load_pretrained(sources["llama"])
    lora.apply(model, rank=4, targets=("q_proj", "v_proj"))
    for _, m in model.named_modules():
        if isinstance(m, lora.LoRALinear):
            m.lora_B.weight = mx.full(m.lora_B.weight.shape, 0.05)
    tuned = _logits(model)
    assert np.abs(tuned - _logits(load_pretrained(sources["llama"]))).max() > 1e-2  # the adapters change it
    lora.fuse(model)
    out = save_gguf(model, tmp_path / "fused.gguf", type="F32", tokenizer=load_tokenizer(sources["llama"]))
    np.testing.assert_allclose(_hf_logits(out), tuned, atol=ATOL, rtol=0)


def test_errors(sources, tmp_path, capsys):
    model, tok = load_pretrained(sources["llama"]), load_tokenizer(sources["llama"])
    with pytest.raises(ValueError, match="Q4_K_M"):
        model.save_gguf(tmp_path / "x.gguf", type="Q3_K_S", tokenizer=tok)
    with pytest.raises(ValueError, match="tokenizer"):
        model.save_gguf(tmp_path / "x.gguf")
    model.save_gguf(tmp_path / "x.gguf", type="F16", tokenizer=tok)
    with pytest.raises(FileExistsError):
        save_gguf(model, tmp_path / "x.gguf", type="F16", tokenizer=tok, force=False)

    class Other:
        model_type = "gpt2"

    with pytest.raises(UnsupportedConfigError, match="llama"):
        save_gguf(Other(), tmp_path / "y.gguf", tokenizer=tok)
    assert cli(["export", str(sources["llama"]), str(tmp_path / "x.gguf"), "--type", "Q8_0"]) == 1
    assert "--force" in capsys.readouterr().err
    assert cli(["export", str(sources["llama"]), str(tmp_path / "z.gguf"), "--type", "Q9_9"]) == 1
    assert "Q9_9" in capsys.readouterr().err
    assert cli(["export", str(sources["llama"]), str(tmp_path / "x.gguf"), "--type", "Q8_0", "--force"]) == 0
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no partial file left

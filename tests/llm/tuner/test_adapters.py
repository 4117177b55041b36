"""LoRA adapters at inference (`metalnn.llm.tuner.adapters`, `metalnn.llm.tuner.multi_lora`) against PEFT
on transformers: adapters saved by PEFT for the tiny chat model of tests/support/app_models.py.

Tolerance: float32 logits of a 2-block, width-64 model: 1e-4 absolute (as tests/llm/tuner/test_lora.py;
measured differences are about 2e-7).
"""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

import metalnn as mn
from metalnn.llm.batching import BatchGenerator, PromptLookup
from metalnn.llm.prefix_cache import PrefixCache
from metalnn.llm.tuner import lora
from metalnn.llm.tuner.adapters import AdapterError, read_adapter, use_adapter
from metalnn.llm.tuner.multi_lora import MultiLoRALinear, install_adapters

from app_models import save_tiny_model
from peft_adapters import peft_greedy, peft_logits, save_peft_adapter

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"qv": save_peft_adapter(tiny, root / "qv", targets=("q_proj", "v_proj"), seed=1),
            "mlp": save_peft_adapter(tiny, root / "mlp", targets=("o_proj", "down_proj", "up_proj"), r=8, alpha=4,
                                     seed=2)}


def tokens(shape, seed=0):
    return np.random.default_rng(seed).integers(0, 90, size=shape)


@pytest.mark.parametrize("fuse", [None, True, False])
def test_use_adapter_gives_peft_logits(tiny, adapters, fuse):
    toks = tokens((2, 11))
    for folder in adapters.values():
        model = mn.models.load_pretrained(tiny)
        how = use_adapter(model, folder, fuse=fuse)
        assert how == ("kept" if fuse is False else "fused")  # float32 base: fused by default
        assert bool(lora.adapters(model)) == (how == "kept")
        ours = np.array(model(mx.array(toks)))
        want = peft_logits(tiny, folder, toks)
        np.testing.assert_allclose(ours, want, atol=ATOL, rtol=0)
        assert np.abs(want - peft_logits(tiny, None, toks)).max() > 100 * ATOL  # the adapter changes the answers


def test_use_adapter_greedy_tokens_equal_peft(tiny, adapters):
    from metalnn.llm.generation import generate

    prompt = tokens((9,), seed=3).tolist()
    model = mn.models.load_pretrained(tiny)
    use_adapter(model, adapters["mlp"])
    ours = np.array(generate(model, prompt, 16, temperature=0.0)).reshape(-1).tolist()
    assert ours == peft_greedy(tiny, adapters["mlp"], prompt, 16)
    assert ours != peft_greedy(tiny, None, prompt, 16)


def test_half_precision_bases_keep_the_adapter_unmerged(tiny, adapters):
    model = mn.models.load_pretrained(tiny)
    model.update(tree_map(lambda a: a.astype(mx.bfloat16), model.parameters()))
    assert use_adapter(model, adapters["qv"]) == "kept"
    layer = next(iter(lora.adapters(model).values()))
    assert layer.lora_A.weight.dtype == mx.float32  # as PEFT: adapters over half precision run in float32


def test_several_adapters_chosen_per_row_equal_peft_row_by_row(tiny, adapters):
    toks = tokens((4, 10), seed=5)
    model = mn.models.load_pretrained(tiny)
    rows = install_adapters(model, {name: read_adapter(f) for name, f in adapters.items()})
    assert isinstance(model.model.layers[0].self_attn.q_proj, MultiLoRALinear)
    per_row = ["mlp", None, "qv", "mlp"]
    with rows.selected(per_row):
        ours = np.array(model(mx.array(toks)))
    for b, name in enumerate(per_row):
        want = peft_logits(tiny, adapters[name] if name else None, toks[b:b + 1])[0]
        np.testing.assert_allclose(ours[b], want, atol=ATOL, rtol=0, err_msg=f"row {b} ({name})")
    # outside a selection the model is the base model
    np.testing.assert_allclose(np.array(model(mx.array(toks[:1])))[0], peft_logits(tiny, None, toks[:1])[0],
                               atol=ATOL, rtol=0)
    with pytest.raises(KeyError, match="'sql'.*installed"):
        with rows.selected(["sql"]):
            pass


@pytest.mark.parametrize("drafter", [None, "prompt_lookup"])
def test_a_batch_mixing_adapters_decodes_each_row_as_alone(tiny, adapters, drafter):
    """`BatchGenerator` rows with different adapters (and none), the same prompt (the prefix cache must
    keep each adapter's keys and values apart), each equal to PEFT's greedy answer alone; with
    speculative decoding, the drafts are checked with each row's adapter."""
    model = mn.models.load_pretrained(tiny)
    rows = install_adapters(model, {name: read_adapter(f) for name, f in adapters.items()})
    prompt = (tokens((10,), seed=7).tolist()) * 2  # repeats: prompt lookup finds drafts
    cache = PrefixCache(min_tokens=4)
    gen = BatchGenerator(model, prefill_chunk=8, max_batch=4, prefix_cache=cache, adapters=rows,
                         drafter=PromptLookup(min_rate=0.0) if drafter else None)
    names = [None, "qv", "mlp", "qv", None, "mlp"]
    seqs = [gen.add(prompt, 10, adapter=n) for n in names]
    while gen:
        gen.step()
    want = {n: peft_greedy(tiny, adapters[n] if n else None, prompt, 10) for n in set(names)}
    assert [s.tokens for s in seqs] == [want[n] for n in names]
    assert len(set(map(tuple, want.values()))) == 3  # three different answers
    assert cache.hits >= 3  # the later rows of each adapter started from its own cached prompt
    if drafter:
        assert sum(s.drafted for s in seqs) > 0
    with pytest.raises(ValueError, match="adapter 'sql' is not installed"):
        gen.add(prompt, 4, adapter="sql")


def test_bad_adapter_folders_are_named_with_the_problem(tiny, adapters, tmp_path):
    model = mn.models.load_pretrained(tiny)
    with pytest.raises(FileNotFoundError, match=f"adapter {tmp_path / 'none'}: no such folder"):
        use_adapter(model, tmp_path / "none")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        read_adapter(empty)
    # an adapter for a wider model: every mismatching projection is named, with the adapter's base
    wide = save_tiny_model(tmp_path / "wide", hidden_size=96)
    wide_adapter = save_peft_adapter(wide, tmp_path / "wide-adapter", targets=("q_proj",))
    with pytest.raises(AdapterError) as e:
        use_adapter(model, wide_adapter)
    message = str(e.value)
    assert str(wide_adapter) in message and f"trained for {wide}" in message
    assert "model.layers.0.self_attn.q_proj: the model's projection is 64 -> 64, the adapter's 96 -> 96" in message
    assert not lora.adapters(model)  # nothing changed
    # a module the model does not have
    cfg = json.loads((adapters["qv"] / "adapter_config.json").read_text())
    deep = save_tiny_model(tmp_path / "deep", num_hidden_layers=3)
    deep_adapter = save_peft_adapter(deep, tmp_path / "deep-adapter", targets=cfg["target_modules"])
    with pytest.raises(AdapterError, match="model.layers.2.self_attn.[qv]_proj: the model has no such module"):
        install_adapters(model, {"deep": read_adapter(deep_adapter)})
    # DoRA is not plain LoRA
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((adapters["qv"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterError, match=f"adapter {dora}: use_dora set"):
        read_adapter(dora)


def test_an_adapter_on_a_gguf_model_gives_pefts_logits_on_transformers_reading_of_it(tmp_path):
    """Packed GGML projections (Q4_0, Q8_0, F16) become float layers holding dequantize(W) + scale B A:
    PEFT on transformers' reading of the same file (every tensor dequantized to float32) is the
    reference, to float32 rounding (1e-4, as tests/llm/gguf/test_gguf.py)."""
    import peft
    import torch
    import transformers

    import gguf_files
    from metalnn.layers.ggml import GGMLLinear
    from metalnn.layers.linear import Linear

    gguf_files.write(tmp_path / "m.gguf", gguf_files.hf_model("llama"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    torch.manual_seed(6)
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                            "o_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    peft_model.eval().save_pretrained(tmp_path / "adapter")
    toks = tokens((2, 12), seed=8)
    with torch.no_grad():
        want = peft_model(torch.tensor(toks)).logits.numpy()
        with peft_model.disable_adapter():
            without = peft_model(torch.tensor(toks)).logits.numpy()
    model = mn.models.load_pretrained(tmp_path / "m.gguf")
    assert type(model.model.layers[0].self_attn.q_proj) is GGMLLinear
    assert use_adapter(model, tmp_path / "adapter") == "fused"
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj) is Linear and layer.self_attn.q_proj.weight.dtype == mx.float32
    assert type(layer.self_attn.k_proj) is GGMLLinear  # only the adapted projections are converted
    np.testing.assert_allclose(np.array(model(mx.array(toks))), want, atol=ATOL, rtol=0)
    assert np.abs(want - without).max() > 100 * ATOL

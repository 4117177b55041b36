"""metalnn.generate / stream_generate against transformers' greedy generate, KV-cache behaviour,
sampling options and tokenizers."""

import os

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

import metalnn as mn
from metalnn.llm.models import load_pretrained

transformers.logging.set_verbosity_error()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=16, attention_bias=True, tie_word_embeddings=True,
             rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
GPT2 = dict(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, initializer_range=0.2, bos_token_id=None,
                                                                eos_token_id=None, pad_token_id=None)).eval()
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder, safe_serialization=True)
    out["llama"] = (hf, load_pretrained(folder))
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2, initializer_range=0.2, bos_token_id=None,
                                                              eos_token_id=None)).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    hf.save_pretrained(folder, safe_serialization=True)
    out["gpt2"] = (hf, load_pretrained(folder))
    return out


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor(prompt), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return out[:, len(prompt[0]):].numpy()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_greedy_matches_transformers(name, models):
    hf, model = models[name]
    prompt = np.random.default_rng(0).integers(0, model.vocab_size, (1, 9))
    ref = _hf_greedy(hf, prompt.tolist(), 32)[0].tolist()
    assert len(set(ref)) > 3  # the random model does not just repeat one token
    assert mn.generate(model, prompt[0].tolist(), 32) == ref
    assert list(mn.stream_generate(model, mx.array(prompt[0]), 32)) == ref


def test_batched_greedy_matches_transformers(models):
    hf, model = models["llama"]
    prompt = np.random.default_rng(1).integers(0, model.vocab_size, (3, 6))
    out = mn.generate(model, mx.array(prompt), 12)
    assert isinstance(out, mx.array) and out.shape == (3, 12)
    np.testing.assert_array_equal(np.array(out), _hf_greedy(hf, prompt.tolist(), 12))


class _Spy:
    """Wraps a model and records the length of every input it is called with."""

    def __init__(self, model):
        self.model, self.lengths = model, []

    def make_cache(self):
        return self.model.make_cache()

    def __call__(self, tokens, cache=None, device=None):
        self.lengths.append(tokens.shape[-1])
        assert cache is not None
        return self.model(tokens, cache=cache, device=device)


def test_decoding_feeds_one_token_per_step(models):
    _, model = models["gpt2"]
    spy = _Spy(model)
    out = mn.generate(spy, list(range(10)), 8)
    assert len(out) == 8
    # prefill once (all but the last prompt token only fill the cache, so the output projection
    # runs for the last one alone), then one new token per step
    assert spy.lengths == [9, 1] + [1] * 7


def test_each_step_finishes_before_the_next_is_queued(models, monkeypatch):
    # MLX decides when a step is queued whether its in-place cache writes may take over the cache
    # buffers; while the previous step still holds them, every layer's whole cache is copied per
    # token. So generation builds step n + 1, waits for step n, then queues step n + 1.
    _, model = models["llama"]
    log = []
    real_eval, real_async = mx.eval, mx.async_eval
    monkeypatch.setattr(mn.llm.generation.mx, "eval", lambda *a: (log.append(("eval", a[0])), real_eval(*a))[1])
    monkeypatch.setattr(mn.llm.generation.mx, "async_eval", lambda *a: (log.append(("queue", a[0])), real_async(*a))[1])
    out = list(mn.stream_generate(model, list(range(5)), 6, eos_token_id=()))
    assert len(out) == 6
    kinds = [k for k, _ in log]
    assert kinds == ["queue"] + ["eval", "queue"] * 5, kinds
    for i in range(1, len(log), 2):  # each wait is for the step queued just before
        assert log[i][1] is log[i - 1][1]


def test_max_context_rebuilds_cache_from_recent_tokens(models):
    _, model = models["gpt2"]
    prompt = list(range(6))
    spy = _Spy(model)
    out = mn.generate(spy, prompt, 30, max_context=16)
    # prefill 6 (5 + 1), then single tokens until 16 positions are used, then re-prefill the last 8 (7 + 1), ...
    assert spy.lengths[:14] == [5, 1] + [1] * 10 + [7, 1]
    assert max(spy.lengths) <= 16 and len(out) == 30
    assert out[:11] == mn.generate(model, prompt, 11)
    # the step after a rebuild sees exactly the last 8 tokens
    seq = prompt + out
    assert out[11] == mn.generate(model, seq[9:17], 1)[0]
    # GPT-2 cannot go past n_positions without it
    with pytest.raises(ValueError, match="positions"):
        mn.generate(model, list(range(120)), 20)
    assert len(mn.generate(model, list(range(120)), 20, max_context=128)) == 20


def test_eos_stops_generation(models):
    _, model = models["llama"]
    prompt = [5, 6, 7, 8]
    full = mn.generate(model, prompt, 20)
    stop = full[6]
    out = mn.generate(model, prompt, 20, eos_token_id=stop)
    assert out == full[:full.index(stop) + 1]
    assert mn.generate(model, prompt, 0) == []


def test_sampling_options(models):
    _, model = models["llama"]
    prompt = [1, 2, 3]
    greedy = mn.generate(model, prompt, 10)
    assert mn.generate(model, prompt, 10, temperature=1.0, top_k=1, seed=3) == greedy
    assert mn.generate(model, prompt, 10, temperature=1.0, top_p=1e-6, seed=3) == greedy
    a = mn.generate(model, prompt, 16, temperature=1.5, seed=7)
    b = mn.generate(model, prompt, 16, temperature=1.5, seed=7)
    c = mn.generate(model, prompt, 16, temperature=1.5, seed=8)
    assert a == b and a != c and all(0 <= t < model.vocab_size for t in a)


def test_sample_logits_top_k_top_p():
    logits = mx.array([[0.0, 1.0, 2.0, 3.0, 4.0]])
    key = mx.random.key(0)
    seen = set()
    for i in range(200):
        seen.add(mn.sample_logits(logits, 1.0, top_k=2, key=mx.random.key(i)).item())
    assert seen == {3, 4}
    # softmax of the logits: [.012, .032, .087, .237, .644]; p=0.8 keeps {4, 3}
    seen = {mn.sample_logits(logits, 1.0, top_p=0.8, key=mx.random.key(i)).item() for i in range(200)}
    assert seen == {3, 4}
    seen = {mn.sample_logits(logits, 1.0, top_p=0.9, key=mx.random.key(i)).item() for i in range(300)}
    assert seen == {2, 3, 4}
    assert mn.sample_logits(logits, 0.0, key=key).item() == 4


def test_generate_rejects_bad_prompts(models):
    _, model = models["gpt2"]
    with pytest.raises(ValueError, match="prompt"):
        mn.generate(model, [], 3)
    with pytest.raises(TypeError, match="integers"):
        mn.generate(model, [0.5, 1.5], 3)


def test_char_tokenizer_round_trip(tmp_path):
    text = "In the beginning God created the heaven and the earth.\n\nAnd the earth was without form"
    tok = mn.models.char_tokenizer(text)
    ids = tok.encode("the earth\n")
    assert len(ids) == len("the earth\n") and tok.decode(ids) == "the earth\n"
    tok.eos_token_id = tok.token_to_id("\n")
    tok.save(tmp_path)
    again = mn.models.load_tokenizer(tmp_path)
    assert again.encode(text) == tok.encode(text) and again.decode(again.encode(text)) == text
    assert again.eos_token_id == tok.eos_token_id
    # transformers reads the same file
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert fast.encode(text) == tok.encode(text)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        mn.models.load_tokenizer(tmp_path / "missing")

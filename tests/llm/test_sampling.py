"""`metalnn.llm.sampling` against independent references: transformers' logits processors and
warpers run in PyTorch on the same logits, OpenAI's presence / frequency formula written out in
NumPy, torch's log_softmax, a chi-square test of the drawn tokens, and transformers' Llama for the
log-probabilities of a whole generation."""

import math
import os

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from scipy import stats
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

import metalnn as mn
from metalnn.llm.generation import stream_choices
from metalnn.llm.sampling import (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, Sampler, SamplingParams, TokenChoice,
                                  propose_batch, sample_batch, truncate)

transformers.logging.set_verbosity_error()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 64


def random_logits(seed, shape=(VOCAB,), scale=3.0):
    return np.random.default_rng(seed).normal(0.0, scale, shape).astype(np.float32)


def reference_processed(logits, prompt, generated, params: SamplingParams):
    """The processed logits by the references: bias added, transformers' repetition penalty over
    prompt + generated, then OpenAI's presence / frequency formula (float64 NumPy)."""
    x = torch.tensor(logits, dtype=torch.float32)[None].clone()
    for token, bias in (params.logit_bias or {}).items():
        x[0, token] += bias
    if params.repetition_penalty != 1.0:
        ids = torch.tensor([list(prompt) + list(generated)], dtype=torch.long)
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, x)
    x = x[0].numpy().astype(np.float64)
    # https://platform.openai.com/docs/advanced-usage (frequency and presence penalties):
    # mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
    counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=len(logits)).astype(np.float64)
    return x - counts * params.frequency_penalty - (counts > 0) * params.presence_penalty


def reference_warped(logits, temperature, top_k=None, top_p=None, min_p=None):
    """transformers' warpers in their order in ``generate``: temperature, top-k, top-p, min-p."""
    x = torch.tensor(np.asarray(logits), dtype=torch.float32)
    x = x[None] if x.ndim == 1 else x
    ids = torch.zeros((x.shape[0], 1), dtype=torch.long)
    x = TemperatureLogitsWarper(temperature)(ids, x)
    if top_k is not None:
        x = TopKLogitsWarper(top_k)(ids, x)
    if top_p is not None:
        x = TopPLogitsWarper(top_p)(ids, x)
    if min_p is not None:
        x = MinPLogitsWarper(min_p)(ids, x)
    return x.numpy()


# -- parameters ------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "0.5"), ("top_k", 0), ("top_k", 2.5),
    ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.1), ("min_p", 1.1), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
    ("seed", -1), ("seed", 2**64), ("top_logprobs", 21), ("top_logprobs", -1), ("logprobs", 1),
])
def test_bad_values_are_refused_naming_field_expected_and_given(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value}, **({"logprobs": True} if field == "top_logprobs" else {}))
    message = str(e.value)
    assert f"SamplingParams.{field}" in message and "expected" in message and repr(value) in message


def test_logit_bias_and_top_logprobs_checks():
    with pytest.raises(ValueError, match=r"logit_bias\[5\].*<= 100.*got 101"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(ValueError, match="logit_bias.*token ids >= 0.*'7'"):
        SamplingParams(logit_bias={"7": 1.0})
    with pytest.raises(ValueError, match="top_logprobs.*logprobs is False"):
        SamplingParams(top_logprobs=3)
    assert SamplingParams(logit_bias={}).logit_bias is None
    # a bias for a token outside the vocabulary is found when the vocabulary is known
    with pytest.raises(ValueError, match=f"logit_bias.*vocabulary size {VOCAB}.*{VOCAB + 1}"):
        Sampler(SamplingParams(logit_bias={VOCAB + 1: 1.0})).propose(mx.zeros((VOCAB,)))


def test_from_generation_config():
    default = SamplingParams.from_generation_config(None)
    assert (default.temperature, default.top_p, default.top_k) == (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, None)
    # a config that says nothing about sampling (only token ids) leaves the defaults
    assert SamplingParams.from_generation_config({"eos_token_id": 2}) == default
    qwen = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}
    p = SamplingParams.from_generation_config(qwen)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (0.6, 20, 0.95, None, 1.05)
    greedy = SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.6})
    assert greedy.greedy
    # do_sample without a temperature: transformers' 1.0; top_k 0 and top_p 1 are "no limit"
    p = SamplingParams.from_generation_config({"do_sample": True, "top_k": 0, "top_p": 1.0})
    assert (p.temperature, p.top_k, p.top_p) == (1.0, None, None)
    # overrides: None means "the default" (an OpenAI null), anything else wins
    p = SamplingParams.from_generation_config(qwen, temperature=None, top_p=0.5, seed=3, logprobs=True)
    assert (p.temperature, p.top_p, p.seed, p.logprobs, p.top_k) == (0.6, 0.5, 3, True, 20)
    assert SamplingParams.from_generation_config(qwen, temperature=0).greedy
    with pytest.raises(TypeError, match="unknown fields.*'temp'"):
        SamplingParams.from_generation_config(None, temp=1.0)


# -- processing ------------------------------------------------------------------------------------
PENALTIES = [
    dict(repetition_penalty=1.3),
    dict(presence_penalty=0.8, frequency_penalty=0.4),
    dict(presence_penalty=-0.5, frequency_penalty=1.5, repetition_penalty=0.7, logit_bias={3: 7.5, 10: -100.0}),
    dict(logit_bias={0: 2.0, 63: -3.25}),
]


@pytest.mark.parametrize("options", PENALTIES, ids=lambda o: ",".join(o))
@pytest.mark.parametrize("lazy", [False, True], ids=["int", "lazy"])
def test_processed_logits_match_transformers_and_openai_formula(options, lazy):
    params = SamplingParams(**options)
    prompt = [1, 2, 3, 3, 40]
    generated = [5, 5, 5, 3, 17, 40, 62]  # repeats, and tokens also in the prompt
    sampler = Sampler(params, prompt)
    for step, token in enumerate(generated):
        logits = random_logits(step)
        got = np.array(sampler.process(mx.array(logits)))
        want = reference_processed(logits, prompt, generated[:step], params)
        # float32 against float64 on values of a few units: 1e-5 covers the rounding
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        sampler.propose(mx.array(logits))
        sampler.accept(mx.array(token) if lazy else token)


def test_half_precision_logits_are_processed_in_float32():
    logits = random_logits(1)
    params = SamplingParams(presence_penalty=0.5, logprobs=True)
    for dtype in (mx.float16, mx.bfloat16):
        half = mx.array(logits).astype(dtype)
        got = Sampler(params).process(half)
        assert got.dtype == mx.float32
        np.testing.assert_array_equal(np.array(got), np.array(half.astype(mx.float32)))


def test_truncation_matches_transformers_warpers():
    cases = [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.1), dict(top_k=20, top_p=0.9, min_p=0.05),
             dict(top_k=1), dict(top_p=0.3, min_p=0.5), dict(top_k=VOCAB), dict()]
    for i, case in enumerate(cases):
        for temperature in (0.5, 1.0, 1.7):
            logits = random_logits(100 + i, (4, VOCAB))
            got = np.array(truncate(mx.array(logits) / temperature, **case))
            want = reference_warped(logits, temperature, **case)
            assert np.array_equal(np.isinf(got), np.isinf(want)), (case, temperature)
            kept = np.isfinite(want)
            assert kept.sum(axis=-1).min() >= 1
            np.testing.assert_allclose(got[kept], want[kept], rtol=1e-6)  # the same division, float32


def test_logprobs_are_log_softmax_of_the_processed_logits():
    params = SamplingParams(temperature=1.3, top_k=4, presence_penalty=1.0, repetition_penalty=1.2,
                            logit_bias={7: 4.0}, seed=0, logprobs=True, top_logprobs=5)
    prompt, sampler, generated = [7, 8], None, []
    sampler = Sampler(params, prompt)
    for step in range(6):
        logits = random_logits(200 + step)
        [choice] = sample_batch([sampler], mx.array(logits)[None])
        ref = torch.log_softmax(torch.tensor(reference_processed(logits, prompt, generated, params)), -1)
        # before temperature and truncation: the reference has neither
        assert choice.logprob == pytest.approx(ref[choice.token].item(), abs=1e-5)
        values, ids = torch.topk(ref, 5)
        assert [t for t, _ in choice.top_logprobs] == ids.tolist()
        np.testing.assert_allclose([v for _, v in choice.top_logprobs], values.numpy(), atol=1e-5)
        generated.append(choice.token)
    plain = sample_batch([Sampler(SamplingParams(logprobs=True))], mx.array(random_logits(3))[None])[0]
    assert plain.top_logprobs == [] and plain.logprob is not None
    assert sample_batch([Sampler(SamplingParams())], mx.array(random_logits(3))[None])[0].logprob is None


def test_greedy_is_exactly_the_argmax_of_the_processed_logits():
    prompt = [4, 9]
    for options in PENALTIES + [dict(logit_bias={11: 100.0})]:
        params = SamplingParams(**options)
        sampler, generated = Sampler(params, prompt), []
        for step in range(5):
            logits = random_logits(300 + step)
            [choice] = sample_batch([sampler], mx.array(logits)[None])
            assert choice.token == int(np.argmax(reference_processed(logits, prompt, generated, params)))
            generated.append(choice.token)
    assert generated[-1] == 11  # the bias of 100 forces its token


def test_processors_run_first_and_see_every_token():
    class EvenOnly:
        def __init__(self):
            self.seen = []

        def __call__(self, logits):
            return mx.where(mx.arange(logits.shape[0]) % 2 == 0, logits, -mx.inf)

        def accept(self, token):
            self.seen.append(token)

    processor = EvenOnly()
    sampler = Sampler(SamplingParams(temperature=2.0, seed=1, logprobs=True, top_logprobs=3), (), [processor])
    tokens = []
    for step in range(20):
        [choice] = sample_batch([sampler], mx.array(random_logits(step))[None])
        tokens.append(choice.token)
        assert all(t % 2 == 0 and math.isfinite(v) for t, v in choice.top_logprobs)
    assert processor.seen == tokens and all(t % 2 == 0 for t in tokens) and len(set(tokens)) > 3


# -- batches and randomness ------------------------------------------------------------------------
def test_seeded_sequences_do_not_depend_on_their_batch():
    steps = [random_logits(400 + i) for i in range(12)]
    wanted = SamplingParams(temperature=1.0, top_p=0.9, seed=42, logprobs=True, top_logprobs=2)

    def run(companions):
        samplers = [Sampler(wanted, [1, 2])] + [Sampler(p, [1, 2]) for p in companions]
        out = []
        for i, logits in enumerate(steps):
            rows = np.stack([logits] + [random_logits(1000 * i + j) for j in range(len(companions))])
            out.append(sample_batch(samplers, mx.array(rows))[0])
        return out

    alone = run([])
    crowd = run([SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7, seed=1),
                 SamplingParams(temperature=1.0, top_p=0.9, seed=43, presence_penalty=1.0),
                 SamplingParams(temperature=1.0, top_p=0.9, logprobs=True, top_logprobs=2)])
    assert [c.token for c in alone] == [c.token for c in crowd]
    assert [c.logprob for c in alone] == [c.logprob for c in crowd]
    assert run([]) == alone  # reproducible
    other = [sample_batch([s], mx.array(x)[None])[0].token for s in [Sampler(SamplingParams(
        temperature=1.0, top_p=0.9, seed=43))] for x in steps]
    assert other != [c.token for c in alone]


def test_a_seeded_sequence_draws_afresh_each_step():
    """The key is split per step: the same logits at every step do not give the same token every
    step (8 equally likely tokens, 64 steps: all 8 appear unless the draws repeat; the chance a
    correct sampler misses one is below 8 * (7/8)^64 = 1.5e-3, and the seed is fixed)."""
    sampler = Sampler(SamplingParams(temperature=1.0, seed=5))
    tokens = [sample_batch([sampler], mx.zeros((1, 8)))[0].token for _ in range(64)]
    assert set(tokens) == set(range(8))


def test_shared_rows_equal_rows_alone():
    """Greedy rows (computed together as one [G, V] operation) and unseeded rows with logprobs give
    what each row gives alone."""
    logits = random_logits(7, (6, VOCAB))
    greedy = sample_batch([Sampler(SamplingParams(logprobs=True, top_logprobs=3)) for _ in range(6)], mx.array(logits))
    ref = torch.log_softmax(torch.tensor(logits), -1)
    assert [c.token for c in greedy] == logits.argmax(-1).tolist()
    np.testing.assert_allclose([c.logprob for c in greedy], ref.max(-1).values.numpy(), atol=1e-5)
    assert [[t for t, _ in c.top_logprobs] for c in greedy] == torch.topk(ref, 3).indices.tolist()
    sampled = sample_batch([Sampler(SamplingParams(temperature=1.0, logprobs=True)) for _ in range(6)],
                           mx.array(logits))
    np.testing.assert_allclose([c.logprob for c in sampled],
                               [ref[i, c.token].item() for i, c in enumerate(sampled)], atol=1e-5)
    # a mixed batch puts each row's result in its place
    mixed = [SamplingParams(), SamplingParams(logit_bias={0: 100.0}), SamplingParams(), SamplingParams(top_k=1,
             temperature=1.0, seed=5), SamplingParams(logit_bias={1: 100.0}), SamplingParams()]
    tokens = [c.token for c in sample_batch([Sampler(p) for p in mixed], mx.array(logits))]
    top = logits.argmax(-1).tolist()
    assert tokens == [top[0], 0, top[2], top[3], 1, top[5]]
    # the lazy [B] tokens a decoder feeds back are in row order too
    assert propose_batch([Sampler(p) for p in mixed], mx.array(logits)).tokens.tolist() == tokens


@pytest.mark.parametrize("seeded", [True, False], ids=["own-keys", "shared-unseeded"])
def test_drawn_tokens_follow_the_warped_distribution(seeded):
    """Chi-square goodness of fit of N draws against softmax of transformers' warped logits. The
    seeds are fixed, so the test is deterministic; a correct sampler passes a p > 0.001 threshold
    for all but 1 in 1000 seeds, while a sampler off by one temperature step or one kept token
    fails it by many orders of magnitude (at N = 4000 the statistic then exceeds 100)."""
    logits = np.array([2.0, 1.5, 1.2, 0.5, 0.0, -0.3, -1.0, -4.0], np.float32)
    params = dict(temperature=0.8, top_k=7, top_p=0.97)
    want = torch.softmax(torch.tensor(reference_warped(logits, **params)[0]), -1).numpy()
    assert 0 < (want == 0).sum() < 3  # top-k and top-p both cut something
    n = 4000
    if seeded:
        samplers = [Sampler(SamplingParams(**params, seed=s)) for s in range(n)]
    else:
        mx.random.seed(1234)
        samplers = [Sampler(SamplingParams(**params)) for _ in range(n)]
    tokens = [c.token for c in sample_batch(samplers, mx.broadcast_to(mx.array(logits), (n, len(logits))))]
    counts = np.bincount(tokens, minlength=len(logits))
    assert counts[want == 0].sum() == 0  # what the warpers drop is never drawn
    kept = want > 0
    statistic, p = stats.chisquare(counts[kept], want[kept] / want[kept].sum() * n)
    assert p > 1e-3, (counts, want * n, statistic)


def test_sample_logits_stays_stateless():
    logits = mx.array([[0.0, 1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0, 0.0]])
    assert mn.sample_logits(logits).tolist() == [4, 0]
    seen = {tuple(mn.sample_logits(logits, 1.0, top_k=2, key=mx.random.key(i)).tolist()) for i in range(100)}
    assert {a for a, _ in seen} == {3, 4} and {b for _, b in seen} == {0, 1}


# -- generation ------------------------------------------------------------------------------------
LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, initializer_range=0.2, bos_token_id=None,
                                                                eos_token_id=None, pad_token_id=None)).eval()
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, mn.models.load_pretrained(folder)


def test_generation_logprobs_match_transformers(llama):
    """Each step's reported log-probabilities are torch's log_softmax of transformers' logits for the
    sequence so far (penalties applied by transformers' processor on the same sequence)."""
    hf, model = llama
    prompt = [5, 17, 33, 2, 90]
    params = SamplingParams(temperature=0.9, seed=11, repetition_penalty=1.4, logprobs=True, top_logprobs=4)
    choices = list(stream_choices(model, prompt, 12, params, eos_token_id=()))
    assert len(choices) == 12 and all(isinstance(c, TokenChoice) for c in choices)
    tokens = [c.token for c in choices]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    for i, c in enumerate(choices):
        ids = torch.tensor([prompt + tokens[:i]])
        ref = torch.log_softmax(RepetitionPenaltyLogitsProcessor(1.4)(ids, logits[i][None].clone())[0], -1)
        # two float32 implementations of the same model: 1e-4 on log-probabilities of a few units
        assert c.logprob == pytest.approx(ref[c.token].item(), abs=1e-4)
        assert [t for t, _ in c.top_logprobs] == torch.topk(ref, 4).indices.tolist()
    assert len(set(tokens)) > 4  # sampled, not stuck on one token
    # the same seed, the same tokens; the old keywords and SamplingParams are one thing
    assert mn.generate(model, prompt, 12, sampling=params) == tokens
    assert mn.generate(model, prompt, 8, temperature=1.2, top_k=30, seed=4) == mn.generate(
        model, prompt, 8, sampling=SamplingParams(temperature=1.2, top_k=30, seed=4))
    with pytest.raises(ValueError, match="either sampling.*temperature"):
        mn.generate(model, prompt, 3, temperature=1.0, sampling=params)


def test_penalties_steer_generation(llama):
    _, model = llama
    prompt = [1, 2, 3]
    greedy = mn.generate(model, prompt, 24)
    assert len(set(greedy)) < 24  # the random model repeats itself
    fresh = mn.generate(model, prompt, 24, sampling=SamplingParams(presence_penalty=2.0, frequency_penalty=2.0))
    assert len(set(fresh)) > len(set(greedy))
    forced = mn.generate(model, prompt, 5, sampling=SamplingParams(logit_bias={42: 100.0}))
    assert forced == [42] * 5


def test_batched_rows_draw_with_their_own_seeds(llama):
    _, model = llama
    prompt = [[5, 6, 7], [8, 9, 10]]
    params = SamplingParams(temperature=1.0, seed=9)
    rows = mn.generate(model, prompt, 10, sampling=params).tolist()
    assert rows[0] == mn.generate(model, prompt[0], 10, sampling=params)
    assert rows[1] == mn.generate(model, prompt[1], 10, sampling=SamplingParams(temperature=1.0, seed=10))


def test_text_stream_records_choices(llama):
    from metalnn.llm.text_generation import TextStream

    from app_models import tiny_tokenizer

    hf, model = llama
    tok = tiny_tokenizer()
    assert tok.vocab_size <= LLAMA["vocab_size"]
    stream = TextStream(model, tok, [5, 6, 7], 10, sampling=SamplingParams(logprobs=True, top_logprobs=2),
                        eos_token_ids=())
    "".join(stream)
    assert [c.token for c in stream.choices] == stream.tokens == mn.generate(model, [5, 6, 7], 10)
    assert stream.text_choices == stream.choices and all(c.top_logprobs[0][0] == c.token for c in stream.choices)
    # an end-of-sequence token is in `choices` but not in `text_choices`
    eos = stream.tokens[3]
    ended = TextStream(model, tok, [5, 6, 7], 10, sampling=SamplingParams(logprobs=True), eos_token_ids=[eos])
    "".join(ended)
    assert ended.finish_reason == "stop" and ended.tokens[-1] == eos
    assert len(ended.text_choices) == len(ended.choices) - 1 == stream.tokens.index(eos)

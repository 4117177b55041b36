"""Sampling through `metalnn serve` with the official ``openai`` client: ``n`` choices, ``logprobs``
(chat and completions, whole and streamed), nulls as defaults, penalties, ``logit_bias``, and the
defaults of a model's ``generation_config.json``.

What the server answers is compared with `metalnn.llm.text_generation.TextStream` run in this process
on the same checkpoint with the `SamplingParams` the request describes; log-probabilities are also
checked against torch's log_softmax of the model's logits (tests/llm/test_sampling.py checks the
sampling itself against transformers). Token texts are checked against transformers' byte-level
alphabet.
"""

import json
import shutil

import mlx.core as mx
import openai
import pytest
import torch

import metalnn as mn
from metalnn.llm.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_P, SamplingParams
from metalnn.llm.server.logprobs import IMPOSSIBLE, CompletionLogprobs, TokenText
from metalnn.llm.text_generation import TextStream

from server_process import running_server

MESSAGES = [{"role": "user", "content": "Tell me something"}]


def post(server, path, body: dict):
    return server.post(path, json.dumps(body).encode())


def expected(local, ids, max_tokens, **overrides):
    """The local stream of a request with these sampling fields (the server's defaults otherwise)."""
    model, tok = local
    stream = TextStream(model, tok, ids, max_tokens, sampling=SamplingParams.from_generation_config(None, **overrides))
    "".join(stream)
    return stream


def chat_ids(local):
    return local[1].apply_chat_template(MESSAGES)


def test_n_choices_are_independent_and_reproducible(client, local):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, n=3, seed=11,
                                       temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    # choice i draws with seed + i: each is the library's answer for that seed
    want = [expected(local, chat_ids(local), 20, temperature=1.0, seed=11 + i) for i in range(3)]
    assert [c.message.content for c in r.choices] == [w.text for w in want]
    assert [c.finish_reason for c in r.choices] == [w.finish_reason for w in want]
    assert len({c.message.content for c in r.choices}) == 3
    assert r.usage.prompt_tokens == len(chat_ids(local))  # the prompt counts once
    assert r.usage.completion_tokens == sum(w.completion_tokens for w in want)
    # streamed: the chunks of each index make the same answers
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, n=3, seed=11,
                                                 temperature=1.0, stream=True, stream_options={"include_usage": True}))
    texts, finishes = ["", "", ""], [None] * 3
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c.message.content for c in r.choices]
    assert finishes == [c.finish_reason for c in r.choices]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # completions too
    c = client.completions.create(model="tiny", prompt="Once", max_tokens=10, n=2, seed=3, temperature=1.0)
    assert [x.text for x in c.choices] == [expected(local, local[1].encode("Once"), 10, temperature=1.0,
                                                    seed=3 + i).text for i in range(2)]


def test_chat_logprobs_whole_and_streamed(client, local):
    model, tok = local
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0,
                                       logprobs=True, top_logprobs=3)
    ref = expected(local, chat_ids(local), 24, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == ref.text
    # every token of the text, an end-of-sequence token left out; the tiny tokenizer's tokens are characters
    assert len(content) == len(ref.text_choices) and "".join(t.token for t in content) == ref.text
    ids = chat_ids(local)
    for i, (entry, choice) in enumerate(zip(content, ref.text_choices)):
        assert entry.bytes == list(entry.token.encode())
        # independent check: torch's log_softmax of the model's logits for the sequence so far
        logits = model(mx.array([ids + ref.tokens[:i]]))[0, -1]
        logp = torch.log_softmax(torch.tensor(logits.tolist()), -1)
        # two float32 computations of one model (cached decoding against a whole-sequence pass): 1e-4
        assert entry.logprob == pytest.approx(logp[choice.token].item(), abs=1e-4)
        top = torch.topk(logp, 3)
        assert [tok.decode([t], skip_special_tokens=False) for t in top.indices.tolist()] == [
            t.token for t in entry.top_logprobs]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely token
    streamed = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0,
                                                   logprobs=True, top_logprobs=3, stream=True))
    pieces = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # the same tokens; the log-probabilities to 1e-5 (the two requests' prompt caches may come from
    # passes of different shapes, e.g. the prefix cache's entry of an earlier batched prompt: float32
    # sums in other orders, measured ~1e-6 apart)
    assert [e.token for e in pieces] == [e.token for e in content]
    assert [e.logprob for e in pieces] == pytest.approx([e.logprob for e in content], abs=1e-5)
    # each chunk carries the tokens of its own text
    for c in streamed:
        if c.choices and c.choices[0].delta.content:
            assert "".join(e.token for e in c.choices[0].logprobs.content) == c.choices[0].delta.content
    # not asked: none
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs(client, local):
    prompt = "Once upon a time"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    ref = expected(local, local[1].encode(prompt), 12, temperature=0, logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs
    # every generated token is reported; a special token is not part of the text (nor of the offsets)
    special = [t.startswith("<|") for t in lp.tokens]
    assert any(special)  # this answer has one: the check below sees it skipped
    assert "".join(t for t, s in zip(lp.tokens, special) if not s) == r.choices[0].text == ref.text
    assert lp.tokens == [tok for tok in (local[1].decode([c.token], skip_special_tokens=False)
                                         for c in ref.text_choices)]
    assert lp.token_logprobs == pytest.approx([c.logprob for c in ref.text_choices], abs=1e-6)
    assert all(len(d) <= 2 and max(d.values()) == d[t] for d, t in zip(lp.top_logprobs, lp.tokens))
    # offsets count from the start of the prompt (OpenAI's convention, with or without echo): one
    # character per token of this tokenizer, none for the special token
    shown = [0] + [int(not s) for s in special[:-1]]
    assert lp.text_offset == [len(prompt) + sum(shown[:i + 1]) for i in range(len(lp.tokens))]
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                              stream=True))
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset
    zero = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    assert zero.choices[0].logprobs.top_logprobs == [{}] * 4 and len(zero.choices[0].logprobs.token_logprobs) == 4


def test_nulls_mean_the_defaults(server, client, local):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=None, top_p=None,
                                       presence_penalty=None, seed=5)
    want = expected(local, chat_ids(local), 16, seed=5)
    assert r.choices[0].message.content == want.text
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                               "repetition_penalty", "logit_bias", "n", "logprobs", "top_logprobs", "max_tokens",
                               "stop", "stream", "stream_options", "user", "max_completion_tokens")}
    status, reply = post(server, "/v1/chat/completions", {"messages": MESSAGES, "seed": 5, **nulls, "max_tokens": 16})
    assert status == 200 and reply["choices"][0]["message"]["content"] == want.text
    card = client.models.retrieve("tiny").model_dump()
    assert card["sampling_defaults"]["temperature"] == DEFAULT_TEMPERATURE
    assert card["sampling_defaults"]["top_p"] == DEFAULT_TOP_P


def test_penalties_and_bias_reach_the_sampler(client, local):
    tok = local[1]
    options = {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    extra = {"repetition_penalty": 1.3, "min_p": 0.05}
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0,
                                       extra_body=extra, **options)
    want = expected(local, chat_ids(local), 30, temperature=0, **options, **extra)
    assert r.choices[0].message.content == want.text
    assert want.text != expected(local, chat_ids(local), 30, temperature=0).text
    x = tok.token_to_id("x")
    forced = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=7, temperature=1.5, seed=1,
                                            logit_bias={str(x): 100})
    assert forced.choices[0].message.content == "x" * 7
    greedy = expected(local, chat_ids(local), 1, temperature=0).tokens[0]
    banned = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0,
                                            logit_bias={str(greedy): -100}, logprobs=True, top_logprobs=20)
    assert banned.choices[0].message.content != tok.decode([greedy])
    # the banned token is still reported, far down (the bias is part of the processed logits)
    assert tok.decode([greedy]) not in [t.token for t in banned.choices[0].logprobs.content[0].top_logprobs]


BAD = [
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 150}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"n": 0}, "n"),
    ({"n": 9}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"temperature": "hot"}, "temperature"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_sampling_values_get_an_openai_error(server, fields, param):
    status, reply = post(server, "/v1/chat/completions", {"messages": MESSAGES, **fields})
    assert status == 400, reply
    assert reply["error"]["param"] == param or param in reply["error"]["message"], reply


def test_completions_logprobs_range(server):
    status, reply = post(server, "/v1/completions", {"prompt": "hi", "logprobs": 6})
    assert status == 400 and reply["error"]["param"] == "logprobs"


def test_generation_config_sets_the_server_defaults(tiny, local, tmp_path):
    folder = shutil.copytree(tiny, tmp_path / "configured")
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.5, "top_k": 3}))
    with running_server(folder, tmp_path / "logs") as server:
        client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)
        card = client.models.retrieve("configured").model_dump()
        assert card["sampling_defaults"] == {"temperature": 0.5, "top_k": 3, "top_p": None, "min_p": None,
                                             "repetition_penalty": 1.0}
        r = client.chat.completions.create(model="configured", messages=MESSAGES, max_tokens=20, seed=2)
        model, tok = local
        config = json.loads((folder / "generation_config.json").read_text())
        want = TextStream(model, tok, chat_ids(local), 20, sampling=SamplingParams.from_generation_config(config,
                                                                                                            seed=2))
        assert r.choices[0].message.content == "".join(want)
        # a request's own value wins over the config's
        greedy = client.chat.completions.create(model="configured", messages=MESSAGES, max_tokens=20, temperature=0)
        assert greedy.choices[0].message.content == expected(local, chat_ids(local), 20, temperature=0).text
        assert "Traceback" not in server.logs()


# -- token texts ---------------------------------------------------------------------------------
def test_token_bytes_of_a_byte_level_tokenizer_match_transformers_alphabet():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from metalnn.llm.bundled import SMOLLM2_INSTALL, smollm2_path

    path = smollm2_path()
    assert path is not None, f"the bundled model is missing: {SMOLLM2_INSTALL}"
    tok = mn.models.load_tokenizer(path)
    text = TokenText(tok)
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    sample = "Grüße, wörld ✓ 日本語 done.\n<|im_end|>"
    ids = tok.encode(sample)
    for i in ids:
        raw, shown = text.get(i)
        piece = tok.tokenizer.id_to_token(i)
        assert raw == (piece.encode() if piece == "<|im_end|>" else bytes(byte_of[c] for c in piece))
        assert shown == raw.decode("utf-8", errors="replace")
    assert b"".join(text.get(i)[0] for i in ids) == sample.encode()
    assert any(text.get(i)[1].endswith("\ufffd") for i in ids)  # a character split over tokens
    # offsets count each character once, at the token that completes it
    from metalnn.llm.sampling import TokenChoice

    logprobs = CompletionLogprobs(text, 3).chunk([TokenChoice(i, float("-inf"), [(i, -1.0)]) for i in ids])
    assert logprobs["token_logprobs"][0] == IMPOSSIBLE  # JSON has no infinity
    ends = logprobs["text_offset"][1:] + [3 + len(sample)]
    assert all(a <= b for a, b in zip(logprobs["text_offset"], ends)) and logprobs["text_offset"][0] == 3

"""``metalnn serve`` over a model split across ``mlx.launch -n 2 --backend ring`` ranks on this machine
(`metalnn.llm.server.lockstep`): rank 0 serves, rank 1 follows its batch.

References: greedy answers equal `metalnn.llm.text_generation.TextStream` run alone in this process on
the same checkpoint; every answer (seeded sampling, stop strings, a grammar, log-probabilities, several
choices) equals the one a one-process server gives the same requests sent the same way, token for token
(the split model's logits equal one process's within 1e-5, tests/llm/distributed; the tiny model's
greedy and seeded draws are far from ties at that distance).
"""

import concurrent.futures
import os
import re
import signal
import time

import openai
import pytest

from metalnn.llm.text_generation import TextStream

from app_models import save_tiny_model
from server_process import running_server

GRAMMAR = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny chat model with 4 blocks (2 a rank in the pipeline; 4 heads, 2 a rank in tensor split)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny4") / "tiny", num_hidden_layers=4)


REQUESTS = [
    ("chat", {"messages": [{"role": "user", "content": "Say red red red"}], "max_tokens": 30, "temperature": 0}),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "temperature": 0,
              "stream": True}),
    ("chat", {"messages": [{"role": "user", "content": "Tea"}], "max_tokens": 20, "temperature": 0.9, "seed": 3,
              "n": 2, "logprobs": True, "top_logprobs": 2}),
    ("text", {"prompt": "Once upon", "max_tokens": 40, "temperature": 1.0, "top_p": 0.9, "seed": 7,
              "stop": ["I", "g", "e", "a"]}),
    ("text", {"prompt": "Numbers:", "max_tokens": 60, "temperature": 1.0, "seed": 1,
              "extra_body": {"grammar": GRAMMAR}}),
    ("text", {"prompt": "abc" * 30, "max_tokens": 16, "temperature": 0, "logprobs": 1}),
]


def ask(client, kind, body):
    """``[(text, finish_reason, token log-probabilities or None), ...]`` one per choice."""
    if kind == "chat" and body.get("stream"):
        text, reason = "", None
        for chunk in client.chat.completions.create(model="tiny", **body):
            for c in chunk.choices:
                text += c.delta.content or ""
                reason = c.finish_reason or reason
        return [(text, reason, None)]
    if kind == "chat":
        r = client.chat.completions.create(model="tiny", **body)
        return [(c.message.content, c.finish_reason,
                 [round(t.logprob, 4) for t in c.logprobs.content] if c.logprobs else None) for c in r.choices]
    r = client.completions.create(model="tiny", **body)
    return [(c.text, c.finish_reason, [round(p, 4) for p in c.logprobs.token_logprobs] if c.logprobs else None)
            for c in r.choices]


def ask_all(server):
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as pool:  # decoded together, joining as they come
        return list(pool.map(lambda r: ask(client, *r), REQUESTS))


@pytest.fixture(scope="module")
def one_process(tiny, tmp_path_factory):
    with running_server(tiny, tmp_path_factory.mktemp("one")) as server:
        return ask_all(server)


@pytest.fixture(scope="module", params=["pipeline", "tensor"])
def split_server(request, tiny, tmp_path_factory):
    """A 2-rank server of ``tiny`` split as the parameter says; on leaving, SIGTERM to rank 0 must end
    both ranks cleanly (the launcher exits 0, nothing printed a traceback)."""
    logs = tmp_path_factory.mktemp(f"split-{request.param}")
    with running_server(tiny, logs, "--split", request.param, ranks=2) as server:
        yield server
        assert sorted(server.rank_pids()) == [0, 1]
        assert server.stop() == 0, server.logs()
        assert "Traceback" not in server.logs() and "died" not in server.logs(), server.logs()


def test_split_server_answers_as_one_process(split_server, one_process, tiny):
    import metalnn as mn

    got = ask_all(split_server)
    assert got == one_process
    model, tok = mn.models.load_pretrained(tiny), mn.models.load_tokenizer(tiny)
    for (kind, body), answer in zip(REQUESTS, got):
        if body["temperature"] == 0 and kind == "chat":  # greedy: the lone reference
            prompt = tok.apply_chat_template(body["messages"])
            assert answer[0][0] == "".join(TextStream(model, tok, prompt, body["max_tokens"], temperature=0.0))
    assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", got[4][0][0]) and got[4][0][1] == "stop"
    assert got[3][0][1] == "stop" and not set(got[3][0][0]) & {"I", "g", "e", "a"}, got[3]


def test_a_second_turn_starts_from_the_cached_first_on_every_rank(split_server, tiny):
    """The prefix cache over a split model: the second turn of a chat reads the first turn's cached keys
    and values on every rank (its usage reports them; a rank without them could not run the step) and
    answers as the lone greedy reference."""
    import metalnn as mn

    model, tok = mn.models.load_pretrained(tiny), mn.models.load_tokenizer(tiny)

    def alone(messages, n):
        return "".join(TextStream(model, tok, tok.apply_chat_template(messages), n, temperature=0.0))

    client = openai.OpenAI(base_url=split_server.api, api_key="unused", max_retries=0, timeout=120)
    first = [{"role": "system", "content": "You answer in one word. " * 12}, {"role": "user", "content": "Hi"}]
    r1 = client.chat.completions.create(model="tiny", messages=first, max_tokens=12, temperature=0)
    assert r1.choices[0].message.content == alone(first, 12)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "More"}]
    r2 = client.chat.completions.create(model="tiny", messages=second, max_tokens=12, temperature=0)
    assert r2.choices[0].message.content == alone(second, 12)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens


def test_split_server_health_and_refused_embeddings(split_server):
    assert split_server.health()["status"] == "ok"
    status, body = split_server.post("/v1/embeddings", b'{"model": "tiny", "input": "hello"}')
    assert status == 400 and "split over 2 processes" in body["error"]["message"], body


class _Rank0Of2:
    """Stands for rank 0 of a 2-rank group where nothing is sent (the refusals come first)."""

    def rank(self):
        return 0

    def size(self):
        return 2


class _Rank1Of2(_Rank0Of2):
    def rank(self):
        return 1


def test_what_a_split_model_is_not_served_with(tiny):
    import metalnn as mn
    from metalnn.llm.prefix_cache import PrefixCache
    from metalnn.llm.server import ServerSettings, serve
    from metalnn.llm.server.worker import GenerationWorker

    model, tok = mn.models.load_pretrained(tiny), mn.models.load_tokenizer(tiny)
    with pytest.raises(ValueError, match="without a draft model, named adapters or a prefix cache on disk"):
        GenerationWorker(model, tok, prefix_cache=PrefixCache(1 << 20), prompt_cache_dir="somewhere",
                         group=_Rank0Of2())
    for settings in (ServerSettings(draft_model=str(tiny)), ServerSettings(adapter="somewhere"),
                     ServerSettings(prompt_cache_dir="somewhere")):
        with pytest.raises(ValueError, match="without a draft model, LoRA adapters or a prefix cache on disk"):
            serve(tiny, settings, group=_Rank0Of2())
    with pytest.raises(ValueError, match="expected 'pipeline' or 'tensor', got 'rows'"):
        serve(tiny, ServerSettings(split="rows"), group=_Rank0Of2())


class _Script:
    """Rank 0's messages, as a follower's `Lockstep` would receive them."""

    def __init__(self, messages):
        self.messages = list(messages)

    def publish(self, message=None):
        return self.messages.pop(0)


def test_a_follower_stops_when_its_batch_is_not_rank_0s(tiny):
    """A follower checks its batch against rank 0's before each step and raises, naming both, rather
    than wait in a collective that rank 0 will never enter; idle ticks make it sleep, ``stop`` ends it."""
    import metalnn as mn
    from metalnn.llm.server.lockstep import IDLE_SLEEP, follow

    model = mn.models.load_pretrained(tiny)
    hello = {"settings": {"max_batch": 4, "prefill_chunk": 8, "prompt_lookup": False, "max_draft": 4,
                          "prefix_cache_min_tokens": None}}
    slept = []
    assert follow(model, _Rank1Of2(), sleep=slept.append, lockstep=_Script(
        [hello, {"changes": [], "idle": 0.01}, {"changes": [], "stop": True}])) == 0
    assert slept == [IDLE_SLEEP * 0.01]
    add = ["add", [5, 6, 7], 4, [], False]
    wrong = {"changes": [add], "step": True, "state": [0, 1, [3], -1]}  # rank 0 already runs it; here it waits
    with pytest.raises(RuntimeError, match=r"rank 1's batch is not rank 0's before step 1: \[1, 0, \[\], -1\] "
                                           r"against \[0, 1, \[3\], -1\]"):
        follow(model, _Rank1Of2(), lockstep=_Script([hello, wrong]))



def test_a_hybrid_model_split_in_a_pipeline_serves_the_lone_answers_until_a_rank_dies(tmp_path):
    """A Qwen3.5 hybrid (Gated DeltaNet layers between attention layers) split over 2 pipeline ranks:
    the blocks a rank does not hold keep recurrent-cache bookkeeping, so concurrent greedy chats
    (rows joining and leaving the batch) and a second turn from the prefix cache (recurrent entries
    match whole) give `TextStream`'s lone answers. Then a killed rank ends the server."""
    import transformers

    import metalnn as mn
    from app_models import tiny_tokenizer
    from hf_models import hf_model

    tok = tiny_tokenizer()
    hf = hf_model(transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, vocab_size=tok.vocab_size,
                  hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, initializer_range=0.2,
                  layer_types=["linear_attention", "full_attention"] * 2, max_position_embeddings=4096,
                  tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    folder = tmp_path / "tiny"
    hf.save_pretrained(folder)
    tok.save(folder)
    model, tok = mn.models.load_pretrained(folder), mn.models.load_tokenizer(folder)

    def alone(messages, n):
        return "".join(TextStream(model, tok, tok.apply_chat_template(messages), n, temperature=0.0))

    chats = [[{"role": "user", "content": w * 3}] for w in ("red ", "blue ", "green ")]
    with running_server(folder, tmp_path / "logs", "--split", "pipeline", ranks=2) as server:
        client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)

        def chat(messages, n=16):
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=n, temperature=0)
            return r.choices[0].message.content, r.usage

        with concurrent.futures.ThreadPoolExecutor(len(chats)) as pool:
            got = [text for text, _ in pool.map(chat, chats)]
        assert got == [alone(c, 16) for c in chats]
        first = [{"role": "system", "content": "Be brief. " * 10}, {"role": "user", "content": "Hi"}]
        text1, usage1 = chat(first, 8)
        second = first + [{"role": "assistant", "content": text1}, {"role": "user", "content": "More"}]
        text2, usage2 = chat(second, 8)
        assert (text1, text2) == (alone(first, 8), alone(second, 8))
        assert usage2.prompt_tokens_details.cached_tokens >= usage1.prompt_tokens

        # rank 1 dies while the server is idle: rank 0 must end with an error naming it (bounded:
        # `watch_peers` looks every second), not keep taking requests that can never be answered
        os.kill(server.rank_pids()[1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while server.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.process.poll() is not None, "the launcher still runs 60 s after rank 1 died"
        assert re.search(r"rank 1 \(pid \d+\) died|rank 1 was killed|rank 1 exited", server.logs()), server.logs()

"""`metalnn serve` decoding requests together: continuous batching, the prefix cache (in memory and
on disk) and speculative decoding (prompt lookup, a draft model), through the official ``openai``
client.

The reference is `metalnn.llm.text_generation.TextStream` run alone in this process on the same
checkpoint: greedy decoding is deterministic, so every answer must be exactly the one the request
gets alone, whatever else the server decodes with it and however it got there.
"""

import concurrent.futures
import signal

import openai
import pytest

from metalnn.llm.text_generation import TextStream

from app_models import save_tiny_model
from server_process import running_server


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """Another tiny model with the same tokenizer (different weights: its drafts are often wrong)."""
    return save_tiny_model(tmp_path_factory.mktemp("draft") / "draft", seed=5, hidden_size=32, num_hidden_layers=1)


def alone(local, messages, max_tokens):
    model, tok = local
    stream = TextStream(model, tok, tok.apply_chat_template(messages), max_tokens, temperature=0.0)
    return "".join(stream)


def client_of(server):
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)


def ask_all(client, conversations, max_tokens):
    def ask(i):
        if i % 2:
            stream = client.chat.completions.create(model="tiny", messages=conversations[i], max_tokens=max_tokens,
                                                    temperature=0, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        r = client.chat.completions.create(model="tiny", messages=conversations[i], max_tokens=max_tokens,
                                           temperature=0)
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:
        return list(pool.map(ask, range(len(conversations))))


# a prompt whose answer repeats it (the tiny model loops): prompt lookup finds drafts to check
QUESTIONS = [[{"role": "user", "content": f"Say {w} {w} {w} {w} and {w} again"}] for w in
             ("red", "blue", "green", "seven", "tea", "rain", "north", "plum")]


@pytest.mark.parametrize("mode", ["plain", "prompt_lookup", "draft_model"])
def test_batched_and_speculative_answers_equal_the_lone_ones(tiny, draft, local, tmp_path, mode):
    extra = {"plain": [], "prompt_lookup": ["--prompt-lookup"], "draft_model": ["--draft-model", str(draft)]}[mode]
    want = [alone(local, q, 40) for q in QUESTIONS]
    with running_server(tiny, tmp_path / "logs", "--max-batch", "8", *extra) as server:
        got = ask_all(client_of(server), QUESTIONS, 40)
        assert got == want
        assert "Traceback" not in server.logs()


def test_a_second_turn_reuses_the_first_turns_cache(tiny, local, tmp_path):
    first = [{"role": "system", "content": "You answer in one word. " * 12}, {"role": "user", "content": "Hi"}]
    with running_server(tiny, tmp_path / "logs") as server:
        client = client_of(server)
        r1 = client.chat.completions.create(model="tiny", messages=first, max_tokens=12, temperature=0)
        assert r1.choices[0].message.content == alone(local, first, 12)
        assert not (r1.usage.prompt_tokens_details and r1.usage.prompt_tokens_details.cached_tokens)
        second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                          {"role": "user", "content": "More"}]
        r2 = client.chat.completions.create(model="tiny", messages=second, max_tokens=12, temperature=0)
        assert r2.choices[0].message.content == alone(local, second, 12)
        # the first turn's whole prompt was cached (at least; its answer's tokens may be too)
        assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens


def test_prompt_cache_dir_survives_a_restart(tiny, local, tmp_path):
    folder = tmp_path / "prompt-cache"
    question = [{"role": "system", "content": "Long instructions. " * 20}, {"role": "user", "content": "Go"}]
    with running_server(tiny, tmp_path / "logs1", "--prompt-cache-dir", str(folder)) as server:
        client_of(server).chat.completions.create(model="tiny", messages=question, max_tokens=5, temperature=0)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
    assert list(folder.glob("prefix-*.safetensors"))
    with running_server(tiny, tmp_path / "logs2", "--prompt-cache-dir", str(folder)) as server:
        r = client_of(server).chat.completions.create(model="tiny", messages=question, max_tokens=5, temperature=0)
        assert r.choices[0].message.content == alone(local, question, 5)
        assert r.usage.prompt_tokens_details.cached_tokens >= 16

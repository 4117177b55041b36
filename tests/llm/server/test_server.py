"""`metalnn serve` through the official ``openai`` client (and raw HTTP for what the client cannot send).

The server runs in a child process on a tiny random model (tests/support/app_models.py), bound to
127.0.0.1 on a free port. What it answers is compared with `metalnn.llm.text_generation.TextStream` run
in this process on the same checkpoint: greedy decoding is deterministic, so the server must send
exactly that text, whether streamed or not, whatever else it is serving at the same time.
"""

import concurrent.futures
import http.client
import json
import signal
import socket
import threading
import time
import urllib.parse

import openai
import pytest

from metalnn.llm.text_generation import TextStream

from server_process import running_server

MAX_BODY = 4096


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    with running_server(tiny, tmp_path_factory.mktemp("logs"), "--max-queue", "16", "--max-body-bytes",
                        str(MAX_BODY)) as s:
        yield s
        assert "Traceback" not in s.logs(), s.logs()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)


def expected_chat(local, messages, max_tokens, **options):
    model, tok = local
    stream = TextStream(model, tok, tok.apply_chat_template(messages), max_tokens, **options)
    return "".join(stream), stream


def expected_completion(local, prompt, max_tokens, **options):
    model, tok = local
    stream = TextStream(model, tok, tok.encode(prompt), max_tokens, **options)
    return "".join(stream), stream


def post(server, path, body: bytes, headers=None):
    return server.post(path, body, headers)


def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    health = server.health()
    assert health["status"] == "ok" and health["model"] == "tiny"


def test_chat_completion_matches_the_library(client, local):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    want, ref = expected_chat(local, messages, 16, temperature=0.0)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.model == "tiny"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == ref.prompt_tokens == len(local[1].apply_chat_template(messages))
    assert r.usage.completion_tokens == ref.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_chat_equals_the_whole_answer(client, local):
    messages = [{"role": "user", "content": "Tell me a story"}]
    want, ref = expected_chat(local, messages, 24, temperature=0.0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.completion_tokens
    # the answer arrives in pieces, not at once
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 5


def test_completions_plain_and_streamed(client, local):
    want, ref = expected_completion(local, "Once upon a time", 20, temperature=0.0)
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == want and r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.prompt_tokens, ref.completion_tokens)
    streamed = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want


def test_stop_strings_end_the_text(client, local):
    messages = [{"role": "user", "content": "Count with me"}]
    full, _ = expected_chat(local, messages, 40, temperature=0.0)
    stop = full[10:13]
    cut = full[:full.find(stop)]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                       stop=[stop, "@@@"])
    assert r.choices[0].message.content == cut and r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                              stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut


def test_sampling_options_reach_the_generator(client, local):
    messages = [{"role": "user", "content": "Surprise me"}]
    options = {"temperature": 1.3, "top_p": 0.9, "seed": 7}
    want, _ = expected_chat(local, messages, 30, top_k=20, **options)
    ask = lambda **kw: client.chat.completions.create(model="tiny", messages=messages, max_tokens=30,  # noqa: E731
                                                      **kw).choices[0].message.content
    assert ask(extra_body={"top_k": 20}, **options) == want
    assert ask(extra_body={"top_k": 20}, **options) == want  # the seed makes it reproducible
    greedy, _ = expected_chat(local, messages, 30, temperature=0.0)
    assert want != greedy


def test_concurrent_clients_all_get_their_own_answers(server, client, local):
    """Eight clients at once, half streaming: each answer is exactly the one it gets alone."""
    prompts = [f"Question number {i}: why?" for i in range(8)]
    want = [expected_chat(local, [{"role": "user", "content": p}], 20 + i, temperature=0.0)[0]
            for i, p in enumerate(prompts)]

    def ask(i):
        messages = [{"role": "user", "content": prompts[i]}]
        if i % 2:
            stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20 + i, temperature=0,
                                                    stream=True)
            return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20 + i, temperature=0)
        return r.choices[0].message.content

    before = server.health()["completed"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert got == want
    assert server.wait_idle()["completed"] == before + 8


BAD_REQUESTS = [
    # (path, raw body, what the message must mention)
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}', "not valid JSON"),
    ("/v1/chat/completions", b"", "empty"),
    ("/v1/chat/completions", b"[1, 2]", "JSON object"),
    ("/v1/chat/completions", b'{"model": "tiny"}', "messages"),
    ("/v1/chat/completions", b'{"messages": []}', "messages"),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "0.5"}', "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}', "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}', "top_p"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_k": -1}', "top_k"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.5}', "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}',
     "context length"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "seed": -3}', "seed"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "stream"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["a","b","c","d","e"]}',
     "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stop": [""]}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "n": 9}', "n"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "model": 7}', "model"),
    ("/v1/completions", b'{"max_tokens": 5}', "prompt"),
    ("/v1/completions", b'{"prompt": ["a", "b"]}', "one prompt"),
    ("/v1/completions", b'{"prompt": ""}', "empty"),
    ("/v1/completions", b'{"prompt": "hi", "echo": true}', "echo"),
    ("/v1/completions", b'{"prompt": "' + b"a" * (MAX_BODY + 10) + b'"}', "limit"),
]


@pytest.mark.parametrize("path,body,mention", BAD_REQUESTS, ids=[f"{i}" for i in range(len(BAD_REQUESTS))])
def test_bad_request_gets_an_openai_error(server, path, body, mention):
    status, reply = post(server, path, body)
    assert 400 <= status < 500, (status, reply)
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert mention in error["message"] or mention == error["param"], error
    assert status == (413 if mention == "limit" else 400)


def test_after_bad_requests_the_server_still_answers(server, client, local):
    for path, body, _ in BAD_REQUESTS:
        post(server, path, body)
    # through the client: its own exception types carry the server's message
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=5)
    with pytest.raises(openai.NotFoundError):
        client.post("/nowhere", cast_to=object, body={})
    # a body over the limit sent in chunks (no Content-Length) is refused too
    url = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", body=iter([b'{"prompt": "', b"a" * MAX_BODY, b'"}']),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        assert conn.getresponse().status == 413
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may answer and close before the upload ends: the request was refused either way
    finally:
        conn.close()
    want, _ = expected_chat(local, [{"role": "user", "content": "still there?"}], 8, temperature=0.0)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "still there?"}],
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want
    assert server.health()["failed"] == 0


def test_client_disconnect_stops_a_streamed_generation(server, client):
    server.wait_idle()
    before = server.health()
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go on and on"}],
                                            max_tokens=3000, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    after = server.wait_idle(timeout=20)
    assert after["cancelled"] == before["cancelled"] + 1
    # far fewer than the 3000 tokens asked for (generating them takes the tiny model several seconds)
    assert after["generated_tokens"] - before["generated_tokens"] < 2000


def test_client_disconnect_stops_a_whole_answer(server):
    """A client waiting for a non-streamed answer hangs up: the generation stops too."""
    server.wait_idle()
    before = server.health()
    url = urllib.parse.urlsplit(server.url)
    body = json.dumps({"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 3000, "temperature": 0})
    with socket.create_connection((url.hostname, url.port)) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 20
        while server.health()["running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    after = server.wait_idle(timeout=20)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < 2000


def test_full_queue_answers_503_and_sigterm_stops_cleanly(tiny, tmp_path):
    """A server that decodes one request at a time with room for one waiting request: a third
    concurrent request gets 503. Then SIGTERM
    while both generate/wait: the process ends promptly with status 0, the streams end, no traceback."""
    with running_server(tiny, tmp_path / "logs", "--max-queue", "1", "--max-batch", "1") as server:
        client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Talk for a long time"}]
        running = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3000, temperature=0,
                                                 stream=True)
        next(iter(running))
        deadline = time.monotonic() + 20
        while server.health()["running"] == 0:  # the worker has taken it: the queue is empty again
            assert time.monotonic() < deadline
            time.sleep(0.02)
        waiting = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3000, temperature=0,
                                                 stream=True)
        deadline = time.monotonic() + 20
        while server.health()["waiting"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "queue_full" and "busy" in refused.value.body["message"]
        assert refused.value.response.headers["retry-after"] == "1"
        assert server.health()["rejected"] == 1

        ended = {}

        def drain(name, stream):
            try:
                for _ in stream:
                    pass
                ended[name] = "ended"
            except openai.APIError as e:
                ended[name] = f"error: {e.message}"

        threads = [threading.Thread(target=drain, args=a) for a in (("running", running), ("waiting", waiting))]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0
        stopped_in = time.monotonic() - t0
        for t in threads:
            t.join(10)
        assert ended.keys() == {"running", "waiting"}, ended
        assert all("shutting down" in v for v in ended.values()), ended
        logs = server.logs()
        assert "Traceback" not in logs, logs
        assert "Application shutdown complete" in logs
        assert stopped_in < 15, stopped_in

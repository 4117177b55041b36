"""Running `metalnn serve` in production: API keys, Prometheus metrics, model names, embeddings, health.

The server runs in a child process on the tiny random model (tests/support/app_models.py) with an API
key read from a file, and is driven with the official ``openai`` client. References are independent:
``prometheus_client``'s own parser reads /metrics, `TextStream` in this process gives the token counts,
transformers' ``AutoModel`` (LlamaModel) on the same checkpoint gives the embeddings.
"""

import base64
import http.client
import json
import subprocess
import sys
import urllib.parse
import urllib.request

import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metalnn.llm.server.auth import ENV_VAR, load_api_key
from metalnn.llm.text_generation import TextStream

from browser import chromium, needs_browser
from server_process import running_server

KEY = "sk-test-0123456789abcdef"


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("key")
    (folder / "key.txt").write_text(KEY + "\n")
    with running_server(tiny, folder / "logs", "--api-key-file", folder / "key.txt") as s:
        yield s
        assert "Traceback" not in s.logs(), s.logs()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.api, api_key=KEY, max_retries=0, timeout=60)


def request(server, method, path, body=None, headers=None):
    """(status, headers, body bytes) of a raw request."""
    url = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def scrape(server) -> dict:
    """``{(sample name, frozenset of labels): value}`` of /metrics, read by prometheus_client's parser."""
    status, headers, body = request(server, "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and headers["content-type"].startswith("text/plain"), (status, headers)
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


# -- API keys ------------------------------------------------------------------------------------
def test_without_the_key_the_api_and_metrics_answer_401(server, client):
    for key in ("wrong-key", KEY + "x", KEY[:-1]):
        other = openai.OpenAI(base_url=server.api, api_key=key, max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as refused:
            other.models.list()
        assert refused.value.status_code == 401
        assert refused.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            other.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            other.embeddings.create(model="tiny", input="hi")
    # the raw answers: OpenAI's body and header, for the API, /metrics and unknown paths alike
    for method, path, headers in [("GET", "/v1/models", {}), ("GET", "/metrics", {}),
                                  ("POST", "/v1/completions", {"Authorization": "Bearer nope"}),
                                  ("GET", "/v1/models", {"Authorization": f"Basic {KEY}"}),
                                  ("GET", "/nowhere", {})]:
        status, got_headers, body = request(server, method, path, {"prompt": "hi"} if method == "POST" else None,
                                            headers)
        assert status == 401, (path, status)
        assert got_headers["www-authenticate"] == "Bearer"
        error = json.loads(body)["error"]
        assert error == {"message": error["message"], "type": "invalid_request_error", "param": None,
                         "code": "invalid_api_key"}
    # the key opens everything
    assert [m.id for m in client.models.list().data] == ["tiny"]
    status, _, _ = request(server, "GET", "/metrics", headers={"Authorization": f"bearer {KEY}"})  # any case
    assert status == 200


def test_health_and_the_page_stay_open_and_the_page_asks_for_the_key(server):
    health = server.health()  # no key sent
    assert health["status"] == "ok" and health["worker"] == "running" and health["model"] == "tiny"
    with urllib.request.urlopen(server.url + "/", timeout=10) as r:
        page = r.read().decode()
    assert '<meta name="metalnn-api-key-required" content="true">' in page


def test_a_keyless_server_needs_no_key_and_its_page_says_so(tiny, tmp_path):
    with running_server(tiny, tmp_path / "logs") as s:
        assert openai.OpenAI(base_url=s.api, api_key="anything", max_retries=0).models.list().data[0].id == "tiny"
        assert request(s, "GET", "/metrics")[0] == 200
        with urllib.request.urlopen(s.url + "/", timeout=10) as r:
            assert '<meta name="metalnn-api-key-required" content="false">' in r.read().decode()


def test_load_api_key_order_and_refusals(tmp_path):
    path = tmp_path / "key"
    path.write_text("  from-file \nsecond line\n")
    env = {ENV_VAR: "from-env"}
    assert load_api_key("given", None, env) == "given"
    assert load_api_key(None, path, env) == "from-file"
    assert load_api_key(None, None, env) == "from-env"
    assert load_api_key(None, None, {}) is None
    with pytest.raises(ValueError, match="not both"):
        load_api_key("a", path, {})
    for bad, where in [("", "--api-key"), ("has space", "--api-key"), ("caf\u00e9", "--api-key")]:
        with pytest.raises(ValueError, match=where):
            load_api_key(bad, None, {})
    (tmp_path / "empty").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        load_api_key(None, tmp_path / "empty", {})
    with pytest.raises(ValueError, match=ENV_VAR):
        load_api_key(None, None, {ENV_VAR: ""})
    with pytest.raises(OSError):
        load_api_key(None, tmp_path / "missing", {})


def test_serve_refuses_a_bad_key_in_one_line(tiny, tmp_path):
    (tmp_path / "empty").write_text("")
    result = subprocess.run([sys.executable, "-m", "metalnn", "serve", str(tiny), "--port", "0", "--api-key-file",
                             str(tmp_path / "empty")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("metalnn serve: error: ")
    assert "the API key is empty" in result.stderr
    both = subprocess.run([sys.executable, "-m", "metalnn", "serve", str(tiny), "--api-key", "a", "--api-key-file",
                           str(tmp_path / "empty")], capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


@needs_browser
def test_the_chat_page_takes_the_key_and_keeps_it(server, local, tmp_path):
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    def wait_for(driver, condition, what):
        return WebDriverWait(driver, 60, poll_frequency=0.05).until(lambda d: condition(d),
                                                                     message=f"waiting for {what}")

    model, tok = local
    with chromium(tmp_path / "profile") as driver:
        driver.get(server.url + "/")
        box = driver.find_element("id", "key-box")
        wait_for(driver, lambda d: d.find_element("id", "model-name").text == "API key needed", "the refusal")
        assert box.is_displayed() and "wrong" in box.get_attribute("class")
        field = driver.find_element("id", "api-key")
        field.send_keys(KEY, Keys.TAB)  # leaving the field stores the key and asks again
        wait_for(driver, lambda d: d.find_element("id", "model-name").text == "tiny", "the model name")
        assert "wrong" not in box.get_attribute("class")
        # a new visit: the browser kept the key
        driver.get(server.url + "/")
        wait_for(driver, lambda d: d.find_element("id", "model-name").text == "tiny", "the model name again")
        assert driver.find_element("id", "api-key").get_attribute("value") == KEY
        assert driver.execute_script("return localStorage.getItem('metalnn-api-key')") == KEY
        # the page's chat requests carry it: the answer is the library's greedy answer
        driver.find_element("id", "temperature").send_keys(Keys.HOME)
        tokens = driver.find_element("id", "max-tokens")
        tokens.clear()
        tokens.send_keys("12")
        driver.find_element("id", "message").send_keys("Hello key", Keys.ENTER)
        wait_for(driver, lambda d: "tokens/s" in (d.find_elements("css selector", ".message.assistant .meta") or
                                                  [d.find_element("id", "status")])[0].text, "the answer")
        want = "".join(TextStream(model, tok, tok.apply_chat_template([{"role": "user", "content": "Hello key"}]), 12,
                                  temperature=0.0))
        got = driver.find_element("css selector", ".message.assistant .content").get_attribute("textContent")
        assert got == want


# -- model names ---------------------------------------------------------------------------------
def test_an_unknown_model_is_404_model_not_found(server, client):
    messages = [{"role": "user", "content": "hi"}]
    calls = [lambda: client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=2),
             lambda: client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2),
             lambda: client.embeddings.create(model="gpt-4o", input="hi"),
             lambda: client.models.retrieve("gpt-4o")]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
        assert "gpt-4o" in missing.value.body["message"] and "tiny" in missing.value.body["message"]
    # leaving the model out is fine; the served name is fine
    auth = {"Authorization": f"Bearer {KEY}"}
    status, _, body = request(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, auth)
    assert status == 200 and json.loads(body)["model"] == "tiny"
    status, _, _ = request(server, "POST", "/v1/embeddings", {"input": "hi"}, auth)
    assert status == 200
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).model == "tiny"
    assert [m.id for m in client.models.list().data] == ["tiny"]


# -- metrics -------------------------------------------------------------------------------------
def test_metrics_count_requests_tokens_and_latencies(server, client, local):
    model, tok = local
    server.wait_idle()
    before = scrape(server)
    messages = [{"role": "user", "content": "Count the tokens"}]
    ref = TextStream(model, tok, tok.apply_chat_template(messages), 9, temperature=0.0)
    "".join(ref)
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0)
    streamed = list(client.completions.create(model="tiny", prompt="Once upon", max_tokens=7, temperature=0,
                                              stream=True))
    ref2 = TextStream(model, tok, tok.encode("Once upon"), 7, temperature=0.0)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "".join(ref2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=messages, max_tokens=2)
    embedded = client.embeddings.create(model="tiny", input=["abc", "defgh"])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.api, api_key="bad", max_retries=0).models.list()
    server.wait_idle()
    after = scrape(server)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("metalnn_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert moved("metalnn_requests_total", endpoint="/v1/chat/completions", status="404") == 1
    assert moved("metalnn_requests_total", endpoint="/v1/completions", status="200") == 1
    assert moved("metalnn_requests_total", endpoint="/v1/embeddings", status="200") == 1
    assert moved("metalnn_requests_total", endpoint="/v1/models", status="401") == 1
    assert moved("metalnn_request_duration_seconds_count", endpoint="/v1/chat/completions") == 2
    assert moved("metalnn_request_duration_seconds_count", endpoint="/v1/completions") == 1
    # the token counts are the library's: prompts (generation and embedding inputs) and new tokens
    assert whole.usage.completion_tokens == ref.completion_tokens
    prompt = ref.prompt_tokens + ref2.prompt_tokens + len(tok.encode("abc")) + len(tok.encode("defgh"))
    assert embedded.usage.prompt_tokens == len(tok.encode("abc")) + len(tok.encode("defgh"))
    assert moved("metalnn_prompt_tokens_total") == prompt
    assert moved("metalnn_generation_tokens_total") == ref.completion_tokens + ref2.completion_tokens
    # one time-to-first-token per generation (not for embeddings or refusals)
    assert moved("metalnn_time_to_first_token_seconds_count") == 2
    assert moved("metalnn_time_to_first_token_seconds_sum") > 0
    # every observation falls in the +Inf bucket
    assert value(after, "metalnn_time_to_first_token_seconds_bucket", le="+Inf") == \
        value(after, "metalnn_time_to_first_token_seconds_count")
    assert value(after, "metalnn_queue_depth") == 0 and value(after, "metalnn_running_sequences") == 0


def test_metrics_count_prefix_cache_hits(server, client):
    """The same conversation twice: the second prompt starts from the first one's cached keys and values;
    the counter moves by what the answers report as cached."""
    messages = [{"role": "system", "content": "A system prompt long enough to be worth caching."},
                {"role": "user", "content": "Say something"}]
    server.wait_idle()
    before = scrape(server)
    answers = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, temperature=0)
               for _ in range(2)]
    cached = [(a.usage.prompt_tokens_details.cached_tokens if a.usage.prompt_tokens_details else 0) for a in answers]
    assert cached[1] > 0
    server.wait_idle()
    after = scrape(server)
    hits = "metalnn_prefix_cache_hit_tokens_total"
    assert value(after, hits) - value(before, hits) == sum(cached)


# -- embeddings ----------------------------------------------------------------------------------
def reference_embeddings(folder, token_lists):
    """transformers' LlamaModel on the same checkpoint: last_hidden_state mean-pooled, L2-normalised."""
    import torch
    import transformers

    hf = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for ids in token_lists:
            h = hf(torch.tensor([ids])).last_hidden_state[0].mean(dim=0)
            out.append((h / h.norm()).numpy())
    return np.stack(out)


def test_embeddings_match_transformers(client, tiny, local):
    _, tok = local
    texts = ["Hello", "A much longer sentence, with punctuation!", "Hi there"]
    ids = [tok.encode(t) for t in texts]
    want = reference_embeddings(tiny, ids)
    got = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in got.data] == [0, 1, 2]
    vectors = np.array([d.embedding for d in got.data], dtype=np.float32)
    assert vectors.shape == (3, 64)
    # float32 through 2 tiny layers on both sides; the differences are rounding (~1e-7 seen), far below 1e-5
    np.testing.assert_allclose(vectors, want, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    # floats in JSON are the same numbers; token ids give what their text gives
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    np.testing.assert_array_equal(np.array([d.embedding for d in floats.data], dtype=np.float32), vectors)
    from_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float", dimensions=64)
    np.testing.assert_allclose(np.array([d.embedding for d in from_ids.data]), vectors, atol=1e-6)
    one = client.embeddings.create(model="tiny", input=ids[1], encoding_format="float")
    assert len(one.data) == 1
    np.testing.assert_allclose(one.data[0].embedding, vectors[1], atol=1e-6)


def test_embeddings_base64_is_little_endian_float32(server, client):
    status, _, body = request(server, "POST", "/v1/embeddings", {"input": "Hello", "encoding_format": "base64"},
                              {"Authorization": f"Bearer {KEY}"})
    assert status == 200
    raw = base64.b64decode(json.loads(body)["data"][0]["embedding"])
    floats = client.embeddings.create(model="tiny", input="Hello", encoding_format="float").data[0].embedding
    np.testing.assert_array_equal(np.frombuffer(raw, dtype="<f4"), np.array(floats, dtype=np.float32))


@pytest.mark.parametrize("body,status,mention", [
    ({"input": "hi", "dimensions": 32}, 400, "dimensions"),
    ({"input": ""}, 400, "empty"),
    ({"input": []}, 400, "empty"),
    ({"input": ["a", ""]}, 400, "input 1"),
    ({"input": [[1, 2], []]}, 400, "input 1"),
    ({"input": ["a", 3]}, 400, "input"),
    ({"input": [5, 100000]}, 400, "100000"),
    ({"input": [1] * 4097}, 400, "context length"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": ["x"] * 2049}, 400, "2048"),
])
def test_bad_embedding_requests_get_an_openai_error(server, body, status, mention):
    got, _, reply = request(server, "POST", "/v1/embeddings", body, {"Authorization": f"Bearer {KEY}"})
    error = json.loads(reply)["error"]
    assert got == status, (got, error)
    assert mention in error["message"] or mention == error["param"], error
    assert server.health()["failed"] == 0


def test_embeddings_and_generations_at_once_all_get_their_own_answers(client, tiny, local):
    """Embeddings run on the worker thread in their turn: mixed with streamed chats, every answer is
    the one it gets alone."""
    import concurrent.futures

    model, tok = local
    prompts = [f"Mixed request {i}" for i in range(4)]
    chats = ["".join(TextStream(model, tok, tok.apply_chat_template([{"role": "user", "content": p}]), 12,
                                temperature=0.0)) for p in prompts]
    want = reference_embeddings(tiny, [tok.encode(p) for p in prompts])

    def chat(i):
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompts[i]}],
                                                max_tokens=12, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def embedding(i):
        return client.embeddings.create(model="tiny", input=prompts[i]).data[0].embedding

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(chat, i) for i in range(4)]
        vectors = [pool.submit(embedding, i) for i in range(4)]
        assert [a.result() for a in answers] == chats
        np.testing.assert_allclose(np.array([v.result() for v in vectors]), want, atol=1e-5)  # as above


def test_health_is_503_while_the_worker_does_not_run(local):
    from fastapi.testclient import TestClient

    from metalnn.llm.server import ServerSettings, create_app

    model, tok = local
    app = create_app(model, tok, ServerSettings(api_key=KEY), "tiny")
    idle = TestClient(app).get("/health")  # no lifespan: the worker never started
    assert idle.status_code == 503
    assert idle.json()["status"] == "unavailable" and idle.json()["worker"] == "stopped"
    with TestClient(app) as running:
        health = running.get("/health")
        assert health.status_code == 200 and health.json()["worker"] == "running"
    assert not app.state.worker.alive  # stopped with the application

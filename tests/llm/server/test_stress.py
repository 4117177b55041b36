"""`metalnn serve` under load: many clients at once (good requests, bad ones, clients that leave),
SIGTERM while streams run, the prefix cache's and the queue's bounds, and constrained output
(``response_format``, ``grammar``) decoded in the same batch as free text.

The server runs in a child process on the tiny random model of tests/support/app_models.py. The
references are independent of the server: `metalnn.llm.text_generation.TextStream` run alone in
this process on the same checkpoint (greedy decoding is deterministic, so every greedy answer must
be exactly the one the request gets alone, whatever else the batch holds), ``jsonschema`` for every
structured answer, ``re`` for a grammar's language, and ``prometheus_client``'s own parser for
``/metrics``. Every prompt is distinct, so an answer delivered to the wrong client would show.
Nothing is timed: every wait has a generous deadline and says what it waited for.
"""

import concurrent.futures
import http.client
import json
import re
import signal
import socket
import threading
import time
import urllib.parse
import urllib.request

import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from metalnn.llm.sampling import SamplingParams
from metalnn.llm.text_generation import TextStream

from server_process import running_server

#: the body limit of the load test's server (a prompt over the 4096-token context still fits under it)
MAX_BODY = 16384
#: seconds any one wait may take on a busy 2-core machine before the test says what did not happen
DEADLINE = 120


def client_of(server):
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=DEADLINE)


def lone(local, ids, max_tokens, stop=None, **overrides):
    """The request's answer alone: a `TextStream` with the ``stop`` strings and the sampling the
    request describes (greedy unless told), run to its end."""
    model, tok = local
    sampling = SamplingParams.from_generation_config(None, **{"temperature": 0.0, **overrides})
    stream = TextStream(model, tok, ids, max_tokens, sampling=sampling, stop=stop)
    "".join(stream)
    return stream


def chat_ids(local, text):
    return local[1].apply_chat_template([{"role": "user", "content": text}])


def no_eos(local) -> dict:
    """A ``logit_bias`` that forbids the end-of-sequence token: the answer runs to ``max_tokens``."""
    return {str(t): -100 for t in local[1].eos_token_ids}


def host_port(server):
    url = urllib.parse.urlsplit(server.url)
    return url.hostname, url.port


def raw_post(server, path, body: bytes, headers=None):
    return server.post(path, body, headers, timeout=DEADLINE)


def wait_for(condition, what: str, timeout: float = DEADLINE, every: float = 0.05):
    """Poll ``condition()`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(every)


def streamed_chat(chunks) -> tuple[str, str | None, list]:
    """(text, finish_reason, logprobs entries) of choice 0 of a streamed chat answer."""
    text, finish, entries = "", None, []
    for c in chunks:
        for choice in c.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            if choice.logprobs and choice.logprobs.content:
                entries += choice.logprobs.content
    return text, finish, entries


def metric_values(server) -> dict:
    """``{sample name: value}`` of ``/metrics`` (unlabelled samples), read by prometheus_client's parser."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=DEADLINE) as r:
        text = r.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


# -- 1. sixteen clients at once -----------------------------------------------------------------
class Load:
    """The sixteen clients of the load test: each a function that sends its requests, checks what it
    got against its lone reference, and returns ``(completed, cancelled)``: the worker jobs its
    requests must add to ``/health`` (a job per choice)."""

    def __init__(self, server, local, barrier):
        self.server, self.local, self.barrier = server, local, barrier
        self.client = client_of(server)
        self.eos_ban = no_eos(local)

    def prompt(self, i) -> str:
        return f"Client {i} asks about the colour number {i * 7 + 3}"

    # good requests: each answer equals the request's lone one
    def chat_whole(self, i):
        want = lone(self.local, chat_ids(self.local, self.prompt(i)), 20 + i)
        self.barrier.wait()
        r = self.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": self.prompt(i)}],
                                                max_tokens=20 + i, temperature=0)
        assert r.choices[0].message.content == want.text, i
        assert r.choices[0].finish_reason == want.finish_reason, i
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_tokens, want.completion_tokens), i
        return 1, 0

    def chat_streamed(self, i):
        want = lone(self.local, chat_ids(self.local, self.prompt(i)), 20 + i)
        self.barrier.wait()
        chunks = list(self.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": self.prompt(i)}], max_tokens=20 + i, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        text, finish, _ = streamed_chat(chunks)
        assert (text, finish) == (want.text, want.finish_reason), i
        assert chunks[-1].usage.completion_tokens == want.completion_tokens, i
        return 1, 0

    def completion_whole(self, i):
        want = lone(self.local, self.local[1].encode(self.prompt(i)), 20 + i)
        self.barrier.wait()
        r = self.client.completions.create(model="tiny", prompt=self.prompt(i), max_tokens=20 + i, temperature=0)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, want.finish_reason), i
        return 1, 0

    def completion_streamed(self, i):
        want = lone(self.local, self.local[1].encode(self.prompt(i)), 20 + i)
        self.barrier.wait()
        chunks = self.client.completions.create(model="tiny", prompt=self.prompt(i), max_tokens=20 + i, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text, i
        return 1, 0

    def _stop_string(self, ids, i):
        """A stop string taken from the middle of the request's lone answer of 40 tokens, and that
        answer's text before it (the independent reference of the cut)."""
        full = lone(self.local, ids, 40).text
        stop = full[10:13]
        assert len(stop) == 3, f"client {i}: the lone answer {full!r} is too short for a stop string"
        return stop, full[:full.find(stop)]

    def chat_stop(self, i):
        ids = chat_ids(self.local, self.prompt(i))
        stop, cut = self._stop_string(ids, i)
        want = lone(self.local, ids, 40, stop=[stop, "@@@"])
        assert want.text == cut and want.finish_reason == "stop", i
        self.barrier.wait()
        r = self.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": self.prompt(i)}],
                                                max_tokens=40, temperature=0, stop=[stop, "@@@"])
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (cut, "stop"), i
        return 1, 0

    def completion_stop_streamed(self, i):
        ids = self.local[1].encode(self.prompt(i))
        stop, cut = self._stop_string(ids, i)
        self.barrier.wait()
        chunks = list(self.client.completions.create(model="tiny", prompt=self.prompt(i), max_tokens=40,
                                                     temperature=0, stop=stop, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == cut, i
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        return 1, 0

    def chat_n2(self, i):
        want = lone(self.local, chat_ids(self.local, self.prompt(i)), 20 + i)
        self.barrier.wait()
        r = self.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": self.prompt(i)}],
                                                max_tokens=20 + i, temperature=0, n=2)
        # greedy: both choices are the one lone answer
        assert [c.index for c in r.choices] == [0, 1], i
        assert [c.message.content for c in r.choices] == [want.text, want.text], i
        assert r.usage.completion_tokens == 2 * want.completion_tokens, i
        return 2, 0

    def completion_n2_streamed(self, i):
        want = lone(self.local, self.local[1].encode(self.prompt(i)), 20 + i)
        self.barrier.wait()
        texts = ["", ""]
        for chunk in self.client.completions.create(model="tiny", prompt=self.prompt(i), max_tokens=20 + i,
                                                    temperature=0, n=2, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.text
        assert texts == [want.text, want.text], i
        return 2, 0

    def chat_logprobs(self, i):
        want = lone(self.local, chat_ids(self.local, self.prompt(i)), 20 + i, logprobs=True, top_logprobs=2)
        self.barrier.wait()
        r = self.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": self.prompt(i)}],
                                                max_tokens=20 + i, temperature=0, logprobs=True, top_logprobs=2)
        assert r.choices[0].message.content == want.text, i
        content = r.choices[0].logprobs.content
        assert [e.token for e in content] == [self.local[1].decode([c.token]) for c in want.text_choices], i
        # a batched [B, 1] pass and a lone one sum in different orders (float32, rows of other
        # lengths beside it): log-probabilities agree to 1e-3, far below the gaps between tokens
        assert [e.logprob for e in content] == pytest.approx([c.logprob for c in want.text_choices], abs=1e-3), i
        return 1, 0

    def completion_logprobs_streamed(self, i):
        want = lone(self.local, self.local[1].encode(self.prompt(i)), 20 + i, logprobs=True, top_logprobs=2)
        self.barrier.wait()
        text, logprobs = "", []
        for c in self.client.completions.create(model="tiny", prompt=self.prompt(i), max_tokens=20 + i, temperature=0,
                                                logprobs=2, stream=True):
            if c.choices:
                text += c.choices[0].text
                logprobs += c.choices[0].logprobs.token_logprobs if c.choices[0].logprobs else []
        assert text == want.text, i
        assert logprobs == pytest.approx([c.logprob for c in want.text_choices], abs=1e-3), i  # as above
        return 1, 0

    # clients that leave
    def leaves_mid_stream(self, i):
        self.barrier.wait()
        stream = self.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": self.prompt(i)}], max_tokens=3000, temperature=0,
            logit_bias=self.eos_ban, stream=True)
        pieces = 0
        for chunk in stream:
            pieces += bool(chunk.choices and chunk.choices[0].delta.content)
            if pieces == 3:
                break
        stream.close()
        assert pieces == 3, i
        return 0, 1

    def leaves_before_the_answer(self, i):
        """Sends a streamed request, reads the status line (the request is queued by then: the worker
        took the job before the answer began) and hangs up before any text arrives."""
        body = json.dumps({"prompt": self.prompt(i), "max_tokens": 3000, "temperature": 0, "stream": True,
                           "logit_bias": self.eos_ban}).encode()
        self.barrier.wait()
        with socket.create_connection(host_port(self.server), timeout=DEADLINE) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            status = s.recv(12)
        assert status == b"HTTP/1.1 200", (i, status)
        return 0, 1

    def leaves_during_the_upload(self, i):
        """Hangs up halfway through its body: no job is made, nothing is counted."""
        self.barrier.wait()
        with socket.create_connection(host_port(self.server), timeout=DEADLINE) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 500\r\n\r\n{\"messages\": [{\"role\": \"user\", ")
        return 0, 0

    # bad requests: OpenAI errors naming the problem, and no job
    def bad_bodies(self, i):
        self.barrier.wait()
        cases = [
            (b'{"messages": [{"role": "user", "content": "hi"}', 400, "invalid_json"),
            (b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
            (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "7"}', 400, "max_tokens"),
            (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2.5}', 400, "n"),
            (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', 400, "stream"),
            (b'[1, 2]', 400, "invalid_body"),
        ]
        for body, status, mention in cases:
            got, reply = raw_post(self.server, "/v1/chat/completions", body)
            assert got == status, (body, got, reply)
            assert mention in (reply["error"]["param"], reply["error"]["code"]), (body, reply)
        return 0, 0

    def over_long_bodies(self, i):
        self.barrier.wait()
        body = json.dumps({"prompt": "x" * (MAX_BODY + 1)}).encode()
        status, reply = raw_post(self.server, "/v1/completions", body)
        assert (status, reply["error"]["code"]) == (413, "request_too_large"), reply
        # the same without a Content-Length (chunked): refused once the limit is passed
        conn = http.client.HTTPConnection(*host_port(self.server), timeout=DEADLINE)
        try:
            conn.request("POST", "/v1/completions", body=iter([body[:MAX_BODY // 2], body[MAX_BODY // 2:]]),
                         headers={"Content-Type": "application/json"}, encode_chunked=True)
            assert conn.getresponse().status == 413
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before the upload ends: refused either way
        finally:
            conn.close()
        return 0, 0

    def unknown_model_and_overflow(self, i):
        self.barrier.wait()
        with pytest.raises(openai.NotFoundError) as missing:
            self.client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)
        assert missing.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError) as over:  # the prompt alone is over the 4096-token context
            self.client.completions.create(model="tiny", prompt="y" * 5000, max_tokens=4)
        assert over.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as over:  # the prompt and max_tokens are
            self.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4095)
        assert over.value.body["code"] == "context_length_exceeded" and over.value.body["param"] == "max_tokens"
        return 0, 0

    def clients(self):
        return [self.chat_whole, self.chat_streamed, self.completion_whole, self.completion_streamed,
                self.chat_stop, self.completion_stop_streamed, self.chat_n2, self.completion_n2_streamed,
                self.chat_logprobs, self.completion_logprobs_streamed, self.leaves_mid_stream,
                self.leaves_before_the_answer, self.leaves_during_the_upload, self.bad_bodies, self.over_long_bodies,
                self.unknown_model_and_overflow]


def test_sixteen_clients_at_once_each_get_their_own_answer_and_the_counts_add_up(tiny, local, tmp_path):
    with running_server(tiny, tmp_path / "logs", "--max-batch", "8", "--max-queue", "32", "--max-body-bytes",
                        str(MAX_BODY)) as server:
        barrier = threading.Barrier(16, timeout=DEADLINE)
        load = Load(server, local, barrier)
        clients = load.clients()
        assert len(clients) == 16
        # the greedy answers differ from prompt to prompt, so one delivered to the wrong client shows
        answers = [lone(local, chat_ids(local, load.prompt(i)), 20 + i).text for i in range(10)]
        assert len(set(answers)) == len(answers), answers
        before = server.health()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(fn, i) for i, fn in enumerate(clients)]
            results = [f.result(timeout=4 * DEADLINE) for f in futures]
        completed, cancelled = map(sum, zip(*results))
        after = server.wait_idle(timeout=DEADLINE)
        assert after["completed"] - before["completed"] == completed == 12, after
        assert after["cancelled"] - before["cancelled"] == cancelled == 2, after
        assert (after["failed"], after["rejected"]) == (0, 0), after
        assert (after["running"], after["waiting"]) == (0, 0), after
        outcomes = sum(after[k] - before[k] for k in ("completed", "cancelled", "failed", "rejected"))
        assert outcomes == completed + cancelled, after  # every job the clients made, each counted once
        assert after["status"] == "ok"
        # and it still answers as it did alone
        again = client_of(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": load.prompt(0)}], max_tokens=20, temperature=0)
        assert again.choices[0].message.content == answers[0]
        logs = server.logs()
        assert "Traceback" not in logs, logs


def test_sigterm_while_eight_streams_run_ends_each_cleanly(tiny, local, tmp_path):
    prompts = [f"Stream {i}: tell the tale of the {w}" for i, w in
               enumerate(("fox", "owl", "eel", "yak", "ant", "bee", "cod", "elk"))]
    ban = no_eos(local)
    # each stream's beginning: what it sends before the cut must be a prefix of its lone answer
    beginnings = [lone(local, chat_ids(local, p), 40, logit_bias={int(k): v for k, v in ban.items()}).text
                  for p in prompts]
    with running_server(tiny, tmp_path / "logs", "--max-batch", "8", "--max-queue", "16") as server:
        client = client_of(server)
        texts, ended, started = [""] * 8, [None] * 8, [threading.Event() for _ in range(8)]

        def read(i):
            try:
                stream = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": prompts[i]}], max_tokens=3000, temperature=0,
                    logit_bias=ban, stream=True)
                finish = None
                for chunk in stream:
                    for c in chunk.choices:
                        texts[i] += c.delta.content or ""
                        finish = c.finish_reason or finish
                        started[i].set()
                ended[i] = f"complete: {finish}"
            except openai.APIError as e:
                ended[i] = f"error: {e.message}"
            except Exception as e:  # a stream cut without its closing chunk: reported by the assertion below
                ended[i] = f"broken: {e!r}"
            finally:
                started[i].set()

        threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        wait_for(lambda: all(e.is_set() for e in started), "every stream's first chunk")
        wait_for(lambda: server.health()["running"] == 8, "8 rows decoding")
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=DEADLINE) == 0
        for t in threads:
            t.join(DEADLINE)
        assert not any(t.is_alive() for t in threads), ended
        for i, how in enumerate(ended):
            assert how is not None and ("shutting down" in how or how == "complete: length"), (i, how)
            n = min(len(texts[i]), len(beginnings[i]))
            assert texts[i][:n] == beginnings[i][:n], i
        logs = server.logs()
        assert "Traceback" not in logs, logs
        assert "Application shutdown complete" in logs, logs


# -- 2. memory and queue bounds -----------------------------------------------------------------
def test_prefix_cache_stays_within_its_budget(tiny, local, tmp_path):
    """With a 1 MiB prompt cache and prompts that together need several times that, the cache's
    bytes (in /health and /metrics) never pass the budget, while it still keeps what fits."""
    budget = 1 << 20
    config = json.loads((tiny / "config.json").read_text())
    # keys and values of one position in all layers, float32 (the tiny model's dtype): an entry of
    # n tokens holds at least n of these (its storage grows in blocks, so maybe more)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4
    words = ("amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "heron", "islet", "juniper", "kelp",
             "lagoon")
    prompts = [f"{w}: " + f"the {w} line {w} " * 40 for w in words]
    lengths = [len(chat_ids(local, p)) for p in prompts]
    assert sum(lengths) * per_token > 3 * budget  # what is offered is several times the budget
    want = [lone(local, chat_ids(local, p), 8).text for p in prompts]
    with running_server(tiny, tmp_path / "logs", "--prompt-cache-mb", "1", "--max-batch", "4") as server:
        client = client_of(server)
        seen, done = [], threading.Event()

        def watch():
            while not done.is_set():
                h = server.health()
                seen.append((h["prefix_cache_bytes"], h["prefix_cache_entries"]))
                time.sleep(0.02)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()

        def ask(i):
            return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompts[i]}],
                                                  max_tokens=8, temperature=0).choices[0].message.content

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, range(len(prompts))))
        done.set()
        watcher.join(DEADLINE)
        assert got == want  # the cache dropping entries changes no answer
        h = server.wait_idle()
        seen.append((h["prefix_cache_bytes"], h["prefix_cache_entries"]))
        assert max(b for b, _ in seen) <= budget, max(seen)
        assert 1 <= h["prefix_cache_entries"] < len(prompts), h  # some kept, some evicted
        assert h["prefix_cache_bytes"] >= h["prefix_cache_entries"] * min(lengths) * per_token, h
        metrics = metric_values(server)
        assert metrics["metalnn_prefix_cache_bytes"] == h["prefix_cache_bytes"]
        assert metrics["metalnn_prefix_cache_entries"] == h["prefix_cache_entries"]
        # a prompt asked again still starts from what the cache kept of it, if anything
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompts[-1]}],
                                           max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want[-1]
        assert server.health()["prefix_cache_bytes"] <= budget
        logs = server.logs()
        assert "Traceback" not in logs, logs


def test_past_the_queue_bound_the_sixteen_clients_get_503(tiny, local, tmp_path):
    """Two rows and room for four waiting requests: of sixteen clients holding long answers open,
    at most six are taken, the rest get 503 ``queue_full``; the counts say so and nothing is lost."""
    max_batch, max_queue = 2, 4
    ban = no_eos(local)
    with running_server(tiny, tmp_path / "logs", "--max-batch", str(max_batch), "--max-queue",
                        str(max_queue)) as server:
        client = client_of(server)
        barrier = threading.Barrier(16, timeout=DEADLINE)
        answered = threading.Barrier(16, timeout=DEADLINE)
        depths, done = [], threading.Event()

        def watch():
            while not done.is_set():
                h = server.health()
                depths.append((h["waiting"], h["running"]))
                time.sleep(0.02)

        def ask(i):
            barrier.wait()
            try:
                stream = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"Queue client {i}"}], max_tokens=3000,
                    temperature=0, logit_bias=ban, stream=True)
            except openai.APIStatusError as e:
                answered.wait()
                return e.status_code, e.body.get("code"), e.response.headers.get("retry-after")
            answered.wait()  # every client has its answer (a stream, or a 503) before any leaves
            stream.close()
            return 200, None, None

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(ask, range(16)))
        accepted = sum(r[0] == 200 for r in results)
        refused = [r for r in results if r[0] != 200]
        # the first max_queue always fit; more fit once the first rows have begun decoding (a
        # request waits until its first token); never more than the rows and the queue together
        assert max_queue <= accepted <= max_batch + max_queue, results
        assert refused and all(r == (503, "queue_full", "1") for r in refused), results
        after = server.wait_idle(timeout=DEADLINE)
        done.set()
        watcher.join(DEADLINE)
        assert max(w for w, _ in depths) <= max_queue and max(r for _, r in depths) <= max_batch, max(depths)
        assert after["rejected"] == len(refused), after
        assert (after["cancelled"], after["completed"], after["failed"]) == (accepted, 0, 0), after
        # the queue has room again
        want = lone(local, chat_ids(local, "After the rush"), 12).text
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "After the rush"}],
                                           max_tokens=12, temperature=0)
        assert r.choices[0].message.content == want
        logs = server.logs()
        assert "Traceback" not in logs, logs


# -- 3. constrained output in batches -----------------------------------------------------------
ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "status", "items"], "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "status": {"type": "string", "enum": ["new", "paid", "sent"]},
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "additionalProperties": False, "required": ["sku", "qty"], "properties": {
            "sku": {"type": "string", "enum": ["a1", "b2", "c3"]},
            "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}}}}
PROFILE = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "home"], "properties": {
    "name": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 5}},
    "home": {"type": "object", "additionalProperties": False, "required": ["city", "floor"], "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Lima", "Pune"]},
        "floor": {"type": "integer", "minimum": -2, "maximum": 40}}}}}
SWITCHES = {"type": "object", "additionalProperties": False, "required": ["on", "level", "deep"], "properties": {
    "on": {"type": "boolean"},
    "level": {"enum": ["low", "mid", "high"]},
    "deep": {"type": "object", "additionalProperties": False, "required": ["inner"], "properties": {
        "inner": {"type": "object", "additionalProperties": False, "required": ["flags"], "properties": {
            "flags": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "boolean"}}}}}}}}
SCHEMAS = {"order": ORDER, "profile": PROFILE, "switches": SWITCHES}
TUPLES = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
TUPLE_LANGUAGE = r"\([0-9]{1,3}(,[0-9]{1,3})*\)"


def test_constraints_in_a_batch_hold_and_leave_the_other_rows_alone(tiny, local, tmp_path):
    """Sampled json_schema requests (three schemas, two seeds each, streamed and not) and Lark
    grammar requests decode in the same batches as greedy free-text requests: every structured
    answer is complete and valid, every free-text answer is its lone greedy answer."""
    free = [f"Free text request {i}: describe a {w}" for i, w in enumerate(("lamp", "river", "kite", "stone"))]
    want = [lone(local, chat_ids(local, p), 30 + 5 * i).text for i, p in enumerate(free)]
    assert len(set(want)) == len(want)
    with running_server(tiny, tmp_path / "logs", "--max-batch", "8", "--max-queue", "32") as server:
        client = client_of(server)
        barrier = threading.Barrier(6 + 4 + 2, timeout=DEADLINE)

        def structured(name, seed, stream):
            kwargs = dict(model="tiny", messages=[{"role": "user", "content": f"A {name} as JSON (seed {seed})"}],
                          temperature=1.0, seed=seed, max_tokens=400,
                          response_format={"type": "json_schema",
                                           "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}})
            barrier.wait()
            if stream:
                text, finish, _ = streamed_chat(client.chat.completions.create(stream=True, **kwargs))
            else:
                r = client.chat.completions.create(**kwargs)
                text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            assert finish == "stop", (name, seed, text)
            jsonschema.validate(json.loads(text), SCHEMAS[name])
            return text

        def plain(i):
            barrier.wait()
            if i % 2:
                text, finish, _ = streamed_chat(client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": free[i]}], max_tokens=30 + 5 * i,
                    temperature=0, stream=True))
            else:
                text = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": free[i]}],
                                                      max_tokens=30 + 5 * i, temperature=0).choices[0].message.content
            assert text == want[i], i
            return text

        def grammar(seed, chat):
            barrier.wait()
            if chat:
                r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Numbers"}],
                                                   temperature=1.0, seed=seed, max_tokens=100,
                                                   extra_body={"grammar": TUPLES})
                text, finish = r.choices[0].message.content, r.choices[0].finish_reason
            else:
                r = client.completions.create(model="tiny", prompt="Numbers:", temperature=1.0, seed=seed,
                                              max_tokens=100, extra_body={"grammar": TUPLES})
                text, finish = r.choices[0].text, r.choices[0].finish_reason
            assert re.fullmatch(TUPLE_LANGUAGE, text) and finish == "stop", (seed, text, finish)
            return text

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(structured, name, seed, (seed + k) % 2 == 1)
                       for k, name in enumerate(SCHEMAS) for seed in (1, 2)]
            futures += [pool.submit(plain, i) for i in range(4)]
            futures += [pool.submit(grammar, seed, seed == 3) for seed in (3, 4)]
            for f in futures:
                f.result(timeout=4 * DEADLINE)
        h = server.wait_idle(timeout=DEADLINE)
        assert (h["completed"], h["failed"], h["cancelled"]) == (12, 0, 0), h
        logs = server.logs()
        assert "Traceback" not in logs, logs

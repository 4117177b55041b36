"""`metalnn serve --adapter`: LoRA adapters (PEFT folders) per request and for every request, through the
official ``openai`` client.

References: PEFT on transformers (the adapter format's own implementation) for greedy answers, and
`metalnn.llm.text_generation.TextStream` alone in this process on the checkpoint with the adapter
applied (greedy decoding is deterministic: a request's answer must not depend on what else the
server decodes with it). ``tiny`` is the shared tiny chat model (tests/llm/server/conftest.py).
"""

import concurrent.futures
import subprocess
import sys

import openai
import pytest

import metalnn as mn
from metalnn.llm.text_generation import TextStream
from metalnn.llm.tuner.adapters import use_adapter

from app_models import save_tiny_model
from peft_adapters import peft_greedy, save_peft_adapter
from server_process import running_server


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"fr": save_peft_adapter(tiny, root / "fr", targets=("q_proj", "v_proj"), seed=1, std=0.2),
            "sql": save_peft_adapter(tiny, root / "sql", targets=("o_proj", "down_proj", "up_proj"), r=8, alpha=8,
                                     seed=2, std=0.2)}


@pytest.fixture(scope="module")
def server(tiny, adapters, tmp_path_factory):
    with running_server(tiny, tmp_path_factory.mktemp("logs"), "--max-batch", "8", "--adapter",
                        f"fr={adapters['fr']}", "--adapter", f"sql={adapters['sql']}") as s:
        yield s
        assert "Traceback" not in s.logs(), s.logs()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)


def alone(tiny, adapter, messages, max_tokens):
    """The answer of the checkpoint with ``adapter`` applied (None: none), decoded alone here."""
    model, tok = mn.models.load_pretrained(tiny), mn.models.load_tokenizer(tiny)
    if adapter is not None:
        use_adapter(model, adapter)
    return "".join(TextStream(model, tok, tok.apply_chat_template(messages), max_tokens, temperature=0.0))


QUESTIONS = [[{"role": "user", "content": f"Name a {w} thing"}] for w in ("red", "blue", "green", "cold", "tall", "odd")]


def test_models_lists_the_base_and_each_adapter(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "fr", "sql"]
    assert [getattr(m, "parent", None) for m in models] == [None, "tiny", "tiny"]
    assert client.models.retrieve("sql").id == "sql"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="tiny:fr", messages=QUESTIONS[0], max_tokens=2)
    message = missing.value.body["message"]
    assert missing.value.body["code"] == "model_not_found" and all(f"'{n}'" in message for n in ("tiny", "fr", "sql"))


def test_six_concurrent_requests_over_three_models_each_answer_as_alone(client, tiny, adapters):
    names = ["tiny", "fr", "sql", "sql", "fr", "tiny"]
    want = [alone(tiny, adapters.get(n), q, 24) for n, q in zip(names, QUESTIONS)]

    def ask(i):
        if i % 2:
            stream = client.chat.completions.create(model=names[i], messages=QUESTIONS[i], max_tokens=24,
                                                    temperature=0, stream=True)
            chunks = list(stream)
            assert {c.model for c in chunks} == {names[i]}
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        r = client.chat.completions.create(model=names[i], messages=QUESTIONS[i], max_tokens=24, temperature=0)
        assert r.model == names[i]
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(ask, range(len(names))))
    assert got == want
    # the adapters change the answers: the same question to each model gets three different ones
    same = QUESTIONS[0]
    answers = {n: alone(tiny, adapters.get(n), same, 24) for n in ("tiny", "fr", "sql")}
    assert len(set(answers.values())) == 3


def test_an_adapters_greedy_answer_equals_peft(client, tiny, adapters):
    tok = mn.models.load_tokenizer(tiny)
    prompt = "The quick brown fox"
    for name in ("fr", "sql"):
        want = peft_greedy(tiny, adapters[name], tok.encode(prompt), 16, eos=set(tok.eos_token_ids))
        r = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == tok.decode([t for t in want if t not in tok.eos_token_ids])


def test_embeddings_of_an_adapter_are_refused(client):
    with pytest.raises(openai.BadRequestError, match="base model 'tiny'"):
        client.embeddings.create(model="fr", input="hi")
    assert len(client.embeddings.create(model="tiny", input="hi").data[0].embedding) == 64


def test_a_bare_adapter_applies_to_every_request(tiny, adapters, tmp_path):
    with running_server(tiny, tmp_path / "logs", "--adapter", str(adapters["sql"])) as server:
        c = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        r = c.chat.completions.create(model="tiny", messages=QUESTIONS[1], max_tokens=20, temperature=0)
        assert r.choices[0].message.content == alone(tiny, adapters["sql"], QUESTIONS[1], 20)


def serve_error(*args) -> str:
    r = subprocess.run([sys.executable, "-m", "metalnn", "serve", *args, "--port", "0"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    return r.stderr


def test_bad_adapters_stop_the_server_with_one_line(tiny, adapters, tmp_path):
    wide = save_tiny_model(tmp_path / "wide", hidden_size=96)
    wide_adapter = save_peft_adapter(wide, tmp_path / "wide-adapter", targets=("v_proj",))
    err = serve_error(str(tiny), "--adapter", f"w={wide_adapter}")
    assert f"metalnn serve: error: adapter {wide_adapter} does not fit" in err and "Traceback" not in err
    assert "v_proj: the model's projection is 64 -> 32, the adapter's 96 -> 48" in err
    err = serve_error(str(tiny), "--adapter", f"x={tmp_path / 'missing'}")
    assert f"adapter {tmp_path / 'missing'}: no such folder" in err
    err = serve_error(str(tiny), "--adapter", f"tiny={adapters['fr']}")
    assert "adapter name 'tiny' is the base model's id" in err
    err = serve_error(str(tiny), "--adapter", str(adapters["fr"]), "--adapter", str(adapters["sql"]))
    assert "a second adapter for every request" in err

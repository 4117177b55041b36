"""Fixtures of the server tests: the tiny chat model (tests/support/app_models.py) saved once per
module, the same checkpoint loaded in the test process (the reference answers), a server of it and
an ``openai`` client. A module may override ``tiny`` (another width or chat template; ``local`` and
``server`` then use that one) or ``server`` (other options)."""

import openai
import pytest

import metalnn as mn

from app_models import save_tiny_model
from server_process import running_server


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def local(tiny):
    """The same checkpoint in this process: the reference answers."""
    return mn.models.load_pretrained(tiny), mn.models.load_tokenizer(tiny)


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    """``metalnn serve`` of ``tiny`` with default settings (a module may start its own)."""
    with running_server(tiny, tmp_path_factory.mktemp("logs")) as s:
        yield s
        assert "Traceback" not in s.logs(), s.logs()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=120)

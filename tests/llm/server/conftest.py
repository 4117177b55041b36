"""Fixtures of the server tests: the tiny chat model (tests/support/app_models.py) saved once per
module, and the same checkpoint loaded in the test process (the reference answers). A module may
override ``tiny`` (another width or chat template); ``local`` then loads that one."""

import pytest

import metalnn as mn

from app_models import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def local(tiny):
    """The same checkpoint in this process: the reference answers."""
    return mn.models.load_pretrained(tiny), mn.models.load_tokenizer(tiny)

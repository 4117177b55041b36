"""`load_pretrained` reads the checkpoint's generation settings into ``model.generation_config``: a
Hugging Face folder's ``generation_config.json``, a GGUF file's ``general.sampling.*`` keys."""

import json
from types import SimpleNamespace

import pytest

import metalnn as mn
from metalnn.errors import UnsupportedConfigError
from metalnn.llm.models.loading import _generation_config
from metalnn.llm.sampling import DEFAULT_TEMPERATURE, SamplingParams

from app_models import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


def test_folder_without_and_with_generation_config(tiny):
    model = mn.models.load_pretrained(tiny)
    assert model.generation_config is None
    assert SamplingParams.from_generation_config(model.generation_config).temperature == DEFAULT_TEMPERATURE
    settings = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": 5}
    (tiny / "generation_config.json").write_text(json.dumps(settings))
    try:
        model = mn.models.load_pretrained(tiny)
        assert model.generation_config == settings
        p = SamplingParams.from_generation_config(model.generation_config)
        assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.9, 20)
        (tiny / "generation_config.json").write_text("{not json")
        with pytest.raises(UnsupportedConfigError, match="generation_config.json: not valid JSON"):
            mn.models.load_pretrained(tiny)
    finally:
        (tiny / "generation_config.json").unlink()


def test_gguf_sampling_keys_become_generation_config_names():
    header = SimpleNamespace(metadata={"general.architecture": "llama", "general.sampling.temp": 0.5,
                                       "general.sampling.top_k": 40, "general.sampling.min_p": 0.05,
                                       "general.sampling.penalty_repeat": 1.1, "general.sampling.mirostat": 0})
    assert _generation_config("unused.gguf", header) == {"temperature": 0.5, "top_k": 40, "min_p": 0.05,
                                                         "repetition_penalty": 1.1}
    assert _generation_config("unused.gguf", SimpleNamespace(metadata={"general.architecture": "llama"})) is None


def test_bundled_gguf_has_no_sampling_settings():
    from metalnn.llm.bundled import SMOLLM2_INSTALL, smollm2_path

    path = smollm2_path()
    assert path is not None, f"the bundled model is missing: {SMOLLM2_INSTALL}"
    from metalnn.llm.gguf.reader import read_header

    assert _generation_config(path, read_header(path)) is None

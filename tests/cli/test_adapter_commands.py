"""``metalnn generate/chat --adapter DIR`` (run as child processes) on the tiny model of
tests/support/app_models.py, against PEFT on transformers: greedy answers with adapters written by
PEFT and by `metalnn.llm.tuner.lora.save_adapters` (as ``metalnn lora`` writes them).
"""

import re

import mlx.core as mx
import pytest

import metalnn as mn
from metalnn.cli.serve import adapter_options
from metalnn.cli.common import CommandError
from metalnn.llm.tuner import lora

from app_models import save_tiny_model
from commands import metalnn_cmd
from peft_adapters import peft_greedy, save_peft_adapter



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


@pytest.fixture(scope="module")
def tok(tiny):
    return mn.models.load_tokenizer(tiny)


@pytest.fixture(scope="module")
def peft_adapter(tiny, tmp_path_factory):
    return save_peft_adapter(tiny, tmp_path_factory.mktemp("peft") / "a", targets=("q_proj", "v_proj", "down_proj"),
                             seed=4, std=0.2)


@pytest.fixture(scope="module")
def metalnn_adapter(tiny, tmp_path_factory):
    """Adapters applied and saved by metalnn (random B: an untrained adapter would change nothing)."""
    model = mn.models.load_pretrained(tiny)
    mx.random.seed(1)
    lora.apply(model, rank=4, alpha=8.0, targets=("k_proj", "o_proj", "gate_proj"))
    for m in lora.adapters(model).values():
        m.lora_B.weight = 0.2 * mx.random.normal(m.lora_B.weight.shape)
    return lora.save_adapters(model, tmp_path_factory.mktemp("metalnn") / "a", base_model_name_or_path=str(tiny))


def text_of(tok, tokens):
    return tok.decode([t for t in tokens if t not in tok.eos_token_ids])


@pytest.mark.parametrize("source", ["peft", "metalnn"])
def test_generate_with_an_adapter_answers_as_peft(tiny, tok, peft_adapter, metalnn_adapter, source):
    adapter = peft_adapter if source == "peft" else metalnn_adapter
    prompt = "Once upon a time"
    want = peft_greedy(tiny, adapter, tok.encode(prompt), 20, eos=set(tok.eos_token_ids))
    r = metalnn_cmd("generate", tiny, "--adapter", adapter, "--prompt", prompt, "--max-tokens", "20",
                    "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout == text_of(tok, want) + "\n"
    assert f"adapter {adapter} fused" in r.stderr
    base = peft_greedy(tiny, None, tok.encode(prompt), 20, eos=set(tok.eos_token_ids))
    assert base != want  # the adapter changes the answer


def test_chat_with_an_adapter_answers_as_peft(tiny, tok, peft_adapter):
    messages = [{"role": "user", "content": "Hello"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    want = text_of(tok, peft_greedy(tiny, peft_adapter, ids, 25, eos=set(tok.eos_token_ids)))
    r = metalnn_cmd("chat", tiny, "--adapter", peft_adapter, "--max-tokens", "25", "--temperature", "0",
                    input="Hello\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "> " + want + "\n> "


def test_a_bad_adapter_is_one_line_naming_the_folder(tiny, tmp_path):
    missing = tmp_path / "missing"
    for command in (("generate", "--prompt", "hi"), ("chat",)):
        r = metalnn_cmd(command[0], tiny, "--adapter", missing, *command[1:], input="")
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert re.search(rf"metalnn {command[0]}: error: adapter {re.escape(str(missing))}: no such folder",
                         r.stderr), r.stderr


def test_serve_adapter_options(tmp_path):
    odd = tmp_path / "a=b"  # a folder whose name holds '=' is a bare DIR
    odd.mkdir()
    assert adapter_options(["fr=/x/fr", "sql=/x/sql"]) == (None, {"fr": "/x/fr", "sql": "/x/sql"})
    assert adapter_options(["/x/all", "fr=/x/fr"]) == ("/x/all", {"fr": "/x/fr"})
    assert adapter_options([str(odd)]) == (str(odd), {})
    with pytest.raises(CommandError, match="'fr' is given twice"):
        adapter_options(["fr=/a", "fr=/b"])
    with pytest.raises(CommandError, match="expected NAME=DIR or DIR"):
        adapter_options(["=/a"])

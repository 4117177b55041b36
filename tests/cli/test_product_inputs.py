"""``--int8-products`` and ``--exact-products`` of ``generate``, ``chat``, ``serve`` and ``bench``: the
command runs inside `metalnn.functional.ggml_int8_inputs` (int8 product inputs for decoding) or
`metalnn.functional.ggml_exact_inputs` (float32 inputs, split inputs off), restored afterwards.

The products themselves are checked against gguf-py and NumPy in
tests/functional/test_ggml_int8_inputs.py; here, that the option reaches them: the setting is on
while the command decodes the bundled SmolLM2 GGUF file, and off again after it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from bundled_model import smollm2_file  # noqa: E402
from commands import metalnn_in_process  # noqa: E402

import metalnn.functional.ggml as functional_ggml  # noqa: E402
from metalnn.cpu import ggml as cpu_ggml  # noqa: E402


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
def test_every_decoding_command_has_the_option(command):
    result = metalnn_in_process(command, "--help")
    assert result.returncode == 0
    assert "--int8-products" in result.stdout and "llama.cpp" in " ".join(result.stdout.split())
    assert "--exact-products" in result.stdout


def test_the_two_options_exclude_each_other():
    result = metalnn_in_process("generate", smollm2_file(), "--prompt", "Hi", "--int8-products", "--exact-products")
    assert result.returncode == 2
    assert "not allowed with argument" in result.stderr


def test_generate_decodes_with_int8_inputs_and_restores_the_setting(monkeypatch):
    seen = []
    real = cpu_ggml.int8_input_rows

    def recording_generate(run):
        def wrapped(args):
            seen.append(real())  # the setting while the command runs
            return run(args)
        return wrapped

    from metalnn.cli import generate

    monkeypatch.setattr(generate, "run", recording_generate(generate.run))
    before = real()
    result = metalnn_in_process("generate", smollm2_file(), "--prompt", "The capital of France is", "--max-tokens",
                                "4", "--temperature", "0", "--int8-products")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "no text generated"
    assert seen == [functional_ggml.INT8_INPUT_ROWS]
    assert real() == before

    seen.clear()
    assert metalnn_in_process("generate", smollm2_file(), "--prompt", "Hi", "--max-tokens", "2").returncode == 0
    assert seen == [before]


def test_generate_with_exact_products_switches_split_inputs_off_and_restores(monkeypatch):
    seen = []

    from metalnn.cli import generate

    run = generate.run

    def recording(args):
        seen.append((cpu_ggml.split_inputs(), cpu_ggml.int8_input_rows()))
        return run(args)

    monkeypatch.setattr(generate, "run", recording)
    before = cpu_ggml.split_inputs()
    assert before is cpu_ggml.available()  # on by default where the native kernels run
    result = metalnn_in_process("generate", smollm2_file(), "--prompt", "The capital of France is", "--max-tokens",
                                "4", "--temperature", "0", "--exact-products")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "no text generated"
    assert seen == [(False, 0)]
    assert cpu_ggml.split_inputs() is before

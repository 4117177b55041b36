"""``metalnn dpo|orpo|kto``: DPO with LoRA on a tiny model writes PEFT adapters that PEFT loads on the
transformers model to the logits metalnn gives with them (float32, 1e-4: the same weights through two
implementations); ``--log-file`` lines carry TRL's metric names; bad options and data are one line
naming the option or the file."""

import json

import mlx.core as mx
import numpy as np
import pytest

from metalnn.cli import main
from metalnn.llm.models import load_pretrained
from metalnn.llm.tuner import lora
from metalnn.weights import load_safetensors

from commands import assert_one_line_error, metalnn_cmd
from peft_adapters import peft_logits
from preference_models import STANDARD_PAIRS, save_preference_model, unpaired, write_jsonl

DPO_NAMES = {"step", "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
             "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy",
             "num_tokens"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_preference_model(tmp_path_factory.mktemp("pref") / "model")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "pairs.jsonl", STANDARD_PAIRS)


def test_dpo_with_lora_writes_adapters_peft_reads(folder, pairs, tmp_path):
    out, log = tmp_path / "adapters", tmp_path / "metrics.jsonl"
    result = metalnn_cmd("dpo", folder, "--train", pairs, "--out", out, "--steps", 3, "--batch-size", 2,
                         "--lr", "0.05", "--rank", 4, "--log-file", log)
    assert result.returncode == 0, result.stderr
    assert "reference: the model with its adapters switched off" in result.stdout
    assert "step 3/3: train loss" in result.stdout and f"wrote {out}" in result.stdout
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and all(set(r) == DPO_NAMES for r in lines)
    assert lines[0]["loss"] == pytest.approx(np.log(2), rel=1e-6)  # policy = reference at the start
    assert lines[-1]["rewards/margins"] != 0.0
    weights = load_safetensors(out / "adapter_model.safetensors")
    assert any(float(mx.abs(v).max()) > 0 for k, v in weights.items() if "lora_B" in k)  # trained
    tokens = np.array([[5, 17, 30, 2, 44, 61, 9, 12]])
    model = load_pretrained(folder)
    lora.load_adapters(model, out)
    got = np.array(model(mx.array(tokens)))
    want = peft_logits(folder, out, tokens)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.abs(want - peft_logits(folder, None, tokens)).max() > 1e-4  # the adapters change the logits


@pytest.mark.parametrize("method, names", [
    ("orpo", {"nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/accuracies", "logps/chosen"}),
    ("kto", {"kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "entropy", "num_tokens"}),
])
def test_orpo_and_kto_log_trls_names(folder, tmp_path, capsys, method, names):
    data = write_jsonl(tmp_path / "d.jsonl", STANDARD_PAIRS if method == "orpo" else unpaired(STANDARD_PAIRS))
    log = tmp_path / "m.jsonl"
    argv = [method, str(folder), "--train", str(data), "--out", str(tmp_path / "o"), "--steps", "2", "--batch-size",
            "3", "--lr", "0.01", "--full", "--optimizer", "sgd", "--log-file", str(log)]
    if method == "kto":
        argv.append("--precompute-ref-log-probs")
    assert main(argv) == 0
    printed = capsys.readouterr().out
    if method == "kto":
        assert "reference: the model's weights before training (log-probabilities precomputed)" in printed
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 2 and names <= set(lines[0])
    assert (tmp_path / "o" / "model.safetensors").exists() or list((tmp_path / "o").glob("*.safetensors"))


@pytest.mark.parametrize("argv, mentions", [
    (["dpo", "--loss", "sigmoid", "--label-smoothing", "0.1"], ["--label-smoothing is used only by --loss robust"]),
    (["dpo", "--loss", "robust", "--label-smoothing", "0.5"], ["--label-smoothing must be in [0, 0.5)"]),
    (["dpo", "--loss", "ipo", "--beta", "0"], ["--beta must be > 0 with --loss ipo"]),
    (["orpo", "--ref-model", "x"], ["--ref-model: ORPO uses no reference model"]),
    (["kto", "--desirable-weight", "-1"], ["--desirable-weight must be a positive number"]),
    (["dpo", "--lr", "0"], ["--lr must be a positive number"]),
])
def test_bad_options_are_named(folder, pairs, tmp_path, capsys, argv, mentions):
    method, *rest = argv
    assert main([method, str(folder), "--train", str(pairs), "--out", str(tmp_path / "o"), *rest]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"metalnn {method}: error: ")
    for m in mentions:
        assert m in err


def test_bad_data_is_one_line_naming_the_file_and_line(folder, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(STANDARD_PAIRS[0]) + "\n" + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    result = metalnn_cmd("dpo", folder, "--train", bad, "--out", tmp_path / "o", "--steps", 1)
    assert_one_line_error(result, f"{bad}:2", "missing field 'rejected'")

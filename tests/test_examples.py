"""The demos people run: they must reach what their docstrings promise."""

import importlib.util
import sys
from pathlib import Path

import numpy as np

import metalnn as mn

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


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
    np.testing.assert_array_equal(np.array(fresh(xte, mn.Device())), np.array(model(xte, mn.Device())))

"""``metalnn lora --zero 2`` under ``mlx.launch -n 2 --backend ring``: the adapters equal one process's
``metalnn lora`` on the same data, only rank 0 prints and writes.

The data is packed text (``--packed --train-prompt``): every row is full, so each process's mean loss
over its half of a batch averages to the whole batch's mean and the two runs do the same arithmetic up
to the order of float32 additions (1e-5 on adapters of order 0.01 to 0.1 after 3 Adam steps).
"""

import json
import sys

import mlx.core as mx
import numpy as np

from app_models import save_tiny_model
from commands import metalnn_cmd
from ring_launch import launch_ranks


def test_lora_zero_under_mlx_launch_equals_one_process(tmp_path):
    tiny = save_tiny_model(tmp_path / "tiny")
    data = tmp_path / "train.jsonl"
    words = "red blue green gold teal pink gray navy".split()
    data.write_text("".join(json.dumps({"text": " ".join(words[i:] + words[:i]) * 3}) + "\n" for i in range(8)))
    args = ["lora", tiny, "--train", data, "--steps", "3", "--batch-size", "4", "--packed", "--max-length", "16",
            "--train-prompt", "--learning-rate", "1e-2", "--rank", "4", "--grad-checkpoint"]
    one = metalnn_cmd(*args, "--out", tmp_path / "one")
    assert one.returncode == 0, one.stderr

    two = launch_ranks(2, [sys.executable, "-m", "metalnn", *args, "--out", tmp_path / "two", "--zero", "2"],
                       timeout=300)
    assert two.ok, two.text
    assert two.stdout.count("LoRA: ") == 1 and two.stdout.count("wrote ") == 1, two.stdout  # rank 0 alone
    assert two.stdout.count("step 3/3: train loss") == 1, two.stdout

    want = mx.load(str(tmp_path / "one" / "adapter_model.safetensors"))
    got = mx.load(str(tmp_path / "two" / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and want
    for name in want:
        np.testing.assert_allclose(np.array(got[name]), np.array(want[name]), atol=1e-5, err_msg=name)
    loss = lambda out: out.stdout.split("step 3/3: train loss")[1].split()[0]  # noqa: E731
    assert abs(float(loss(one)) - float(loss(two))) < 1e-4  # printed to 4 decimals


def test_batch_size_must_split_over_the_processes(tmp_path):
    tiny = save_tiny_model(tmp_path / "tiny")
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "red blue green"}) + "\n")
    r = launch_ranks(2, [sys.executable, "-m", "metalnn", "lora", tiny, "--train", data, "--out", tmp_path / "a",
                         "--batch-size", "3", "--zero", "1"], timeout=300)
    assert not r.ok and "--batch-size 3 does not split evenly over 2 processes" in r.text, r.text
    assert not (tmp_path / "a").exists()

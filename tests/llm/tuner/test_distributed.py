"""Data-parallel training on mx.distributed: two ranks launched by ``mlx.launch --backend ring`` on
localhost against one process training on the whole batches (the same arithmetic up to the order of
float32 additions in the gradient average: 1e-5)."""

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

import metalnn as mn
from ring_launch import launch_ranks

WORKER = Path(__file__).resolve().parents[2] / "support" / "workers" / "data_parallel_train.py"
sys.path.insert(0, str(WORKER.parent))
import data_parallel_train as worker  # noqa: E402


def launch(out, *extra, timeout=120):
    return launch_ranks(2, [sys.executable, WORKER, out, *extra], timeout=timeout)


def test_two_ranks_equal_one_process_on_whole_batches(tmp_path):
    r = launch(tmp_path)
    assert r.ok, r.text
    logs = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for i, log in enumerate(logs):
        assert log["rank"] == i and log["size"] == 2
        # every loss evaluation saw half of the 8-row batch (the first is the Trainer's build pass)
        assert set(log["rows"]) == {worker.BATCH // 2}, log["rows"]
    assert logs[0]["loss"] == logs[1]["loss"]  # the reported loss is the mean over ranks, on both

    single = worker.build()
    trainer = mn.Trainer(single, optim.SGD(0.5), lambda m, b, d: mn.losses.cross_entropy(m(b[0], device=d), b[1]),
                         mn.Device(seed=0), compile=False, progress=False, group=None)
    assert trainer.world_size == 1
    trainer.fit(worker.batch, worker.STEPS)
    np.testing.assert_allclose(logs[0]["loss"], trainer.history["loss"], rtol=1e-5)
    got = mn.load_safetensors(tmp_path / "weights.safetensors")
    for name, value in single.named_parameters().items():
        np.testing.assert_allclose(np.array(got[name]), np.array(value), atol=1e-5, err_msg=name)


def test_a_killed_rank_stops_the_run_instead_of_hanging(tmp_path):
    """Rank 1 is killed mid-training; rank 0 must not wait forever in the gradient all-reduce: the
    launcher ends it (a hang would raise TimeoutExpired here)."""
    r = launch(tmp_path, "--crash-at", "3", timeout=90)
    assert r.failed.get(1) == -9, r.text
    assert not (tmp_path / "rank0.json").exists() and not (tmp_path / "weights.safetensors").exists()


def test_uneven_batches_are_refused():
    from metalnn.trainer import shard

    x = mx.zeros((6, 2))
    assert shard((x, {"y": x}), 1, 3)[1]["y"].shape == (2, 2)
    with pytest.raises(ValueError, match="7 rows does not split evenly over 2"):
        shard(mx.zeros((7, 2)), 0, 2)

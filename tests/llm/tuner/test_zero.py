"""ZeRO stages 1 and 2 (`metalnn.zero`, ``Trainer(zero=...)``): 2 and 3 ranks launched by ``mlx.launch
--backend ring`` on localhost against one process training unsharded on the whole batches.

The reference is `metalnn.Trainer` with ``zero=0`` in this process, which is plain ``mlx.optimizers``
on whole tensors: the sharded runs differ from it only in the order of float32 additions (the gradient
is summed across ranks, the global norm summed from per-shard parts), so after 5 AdamW steps the
weights agree within 1e-5 (absolute; the weights are of order 0.1 to 1) and the losses within 1e-5
(relative). The same launch trains the LoRA model data parallel without sharding: the sharded runs
equal it within 1e-6 (the sharding itself moves nothing; the 1e-5 against one process is the split
batch's rounding, which Adam's per-element scaling shows most on the adapters, hence their smaller
learning rate). One launch per group size runs every case (`tests/support/workers/zero_train.py`).
"""

import json
import math
import sys
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

import metalnn as mn
from metalnn.zero import ZeroSharding
from ring_launch import launch_ranks

WORKER = Path(__file__).resolve().parents[2] / "support" / "workers" / "zero_train.py"
sys.path.insert(0, str(WORKER.parent))
import zero_train as worker  # noqa: E402

TOL = 1e-5


def launch(n, out, *extra, timeout=400):
    return launch_ranks(n, [sys.executable, WORKER, out, *extra], timeout=timeout)


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def run(request, tmp_path_factory):
    n = request.param
    out = tmp_path_factory.mktemp(f"zero{n}")
    r = launch(n, out)
    assert r.ok, r.text
    logs = [json.loads((out / f"rank{i}.json").read_text()) for i in range(n)]
    return n, out, logs


@lru_cache(maxsize=None)
def reference(case, steps=worker.STEPS):
    """One process, unsharded (zero=0), on the whole batches: (losses, trainable weights, state bytes)."""
    t = worker.trainer(case, None, zero=0)
    t.fit(worker.CASES[case][2], steps)
    return t.history["loss"], worker.trainable(t.model), worker.state_bytes(t.optimizer)


@pytest.mark.parametrize("case", list(worker.CASES))
def test_sharded_training_lands_on_one_process_weights(run, case):
    n, out, logs = run
    losses, weights, _ = reference(case)
    for rank, log in enumerate(logs):
        assert log["rank"] == rank and log["size"] == n
        np.testing.assert_allclose(log["cases"][case]["loss"], losses, rtol=TOL, err_msg=f"{case} rank {rank}")
        got = mn.load_safetensors(out / f"{case}.rank{rank}.safetensors")
        assert set(got) == set(weights), case
        for name, value in weights.items():
            np.testing.assert_allclose(np.array(got[name]), np.array(value), atol=TOL,
                                       err_msg=f"{case} rank {rank} {name}")
    if case.startswith(("lora", "qlora")):  # only the adapters trained
        assert all(".lora_" in name for name in weights)


SHARDED = [c for c in worker.CASES if worker.CASES[c][4]["zero"]]


def test_sharding_adds_nothing_to_data_parallel(run):
    n, out, _ = run
    for case in ("lora_z1_ckpt", "lora_z2"):  # the same model, optimizer and batches as lora_dp
        for rank in range(n):
            dp = mn.load_safetensors(out / f"lora_dp.rank{rank}.safetensors")
            got = mn.load_safetensors(out / f"{case}.rank{rank}.safetensors")
            for name, value in dp.items():
                np.testing.assert_allclose(np.array(got[name]), np.array(value), atol=1e-6, err_msg=f"{case} {name}")


@pytest.mark.parametrize("case", SHARDED)
def test_each_rank_keeps_1_over_n_of_the_optimizer_state(run, case):
    n, _, logs = run
    _, weights, whole = reference(case)
    elements = sum(int(v.size) for v in weights.values())
    padding = math.ceil(elements / n) * n - elements  # the uneven split's zeros, at the end of the last shard
    per_element = whole // elements  # AdamW: m and v, 4 bytes each
    assert per_element == 8
    for log in logs:
        mine = log["cases"][case]
        assert mine["state_bytes"] == mine["zero_bytes"] == (whole + padding * per_element) // n
    if case == "mlp_z1" and n == 2:
        assert padding == 1  # 147 elements over 2 ranks: the padding is exercised


def test_checkpoint_resume_continues_the_unsharded_run(run, tmp_path):
    n, out, logs = run
    losses, weights, _ = reference(worker.RESUME_CASE)
    for rank, log in enumerate(logs):
        # the resumed Trainer reports the restored history and then the steps it ran itself
        np.testing.assert_allclose(log["resumed_loss"], losses, rtol=TOL)
        got = mn.load_safetensors(out / f"resumed.rank{rank}.safetensors")
        for name, value in weights.items():
            np.testing.assert_allclose(np.array(got[name]), np.array(value), atol=TOL, err_msg=f"rank {rank} {name}")

    # the checkpoint holds the whole optimizer state in one process's layout: the same tensors as an
    # unsharded run's checkpoint at that step
    t = worker.trainer(worker.RESUME_CASE, None, zero=0)
    t.fit(worker.CASES[worker.RESUME_CASE][2], worker.RESUME_AT)
    mine = mn.load_safetensors(t.save_checkpoint(tmp_path / "one") / "optimizer.safetensors")
    ckpt = out / "ckpt"
    assert (ckpt / "latest").read_text().strip() == f"step_{worker.STEPS:07d}"  # the resumed run's, at the end
    theirs = mn.load_safetensors(ckpt / f"step_{worker.RESUME_AT:07d}" / "optimizer.safetensors")
    assert set(theirs) == set(mine) and {"step", "learning_rate"} <= set(mine)
    for key, value in mine.items():
        np.testing.assert_allclose(np.array(theirs[key]), np.array(value), atol=TOL, err_msg=key)


def test_a_killed_rank_stops_every_rank(tmp_path):
    """Rank 1 of 3 is SIGKILLed mid-training; the others must not wait forever in a collective: the
    launcher ends them and names the rank (a hang would raise TimeoutExpired here)."""
    r = launch(3, tmp_path, "--crash-at", "3", timeout=120)
    assert r.failed.get(1) == -9, r.text
    assert not list(tmp_path.glob("rank*.json"))


# -- one process -------------------------------------------------------------------------------------
def test_one_process_zero_equals_plain_with_mixed_dtypes():
    """A group of one: the shard is everything; a float32 and a bfloat16 parameter group each get their
    own flat vector (the optimizer then runs in each one's dtype, as unsharded: bit for bit)."""
    def build():
        with mn.init.seeded(1):
            m = mn.Layers(mn.Linear(8, in_features=4), mn.Tanh(), mn.Linear(2, in_features=8))
        m(mx.zeros((1, 4)))
        m.layers[2].set_dtype(mx.bfloat16)
        return m

    def loss(model, b, device):
        return mn.losses.cross_entropy(model(b[0], device=device).astype(mx.float32), b[1])

    def data(step):
        x, y = worker.mlp_batch(step)
        return x[:, :4], y % 2

    runs = {}
    for zero in (0, 1, 2):
        t = mn.Trainer(build(), optim.Adam(0.05), loss, mn.Device(seed=0), progress=False, group=None, zero=zero)
        t.fit(data, 4)
        runs[zero] = worker.trainable(t.model)
        if zero:
            assert sorted(b.key for b in t.zero.buckets) == ["shard_bfloat16", "shard_float32"]
    for zero in (1, 2):
        for name, value in runs[0].items():
            assert runs[zero][name].dtype == value.dtype
            np.testing.assert_array_equal(np.array(runs[zero][name].astype(mx.float32)),
                                          np.array(value.astype(mx.float32)), err_msg=name)


def test_bad_stage_and_whole_tensor_optimizers_are_refused():
    with pytest.raises(ValueError, match="stage must be one of"):
        ZeroSharding(3, optim.AdamW(1e-3))
    with pytest.raises(ValueError, match="Adafactor updates whole tensors"):
        mn.Trainer(worker.mlp(), optim.Adafactor(), worker.mlp_loss, group=None, zero=1, progress=False)
    assert isinstance(mn.Trainer(worker.mlp(), optim.Lion(1e-3), worker.mlp_loss, group=None, zero=2,
                                 progress=False).zero, ZeroSharding)


def test_the_clipping_case_clips():
    """The clipped case would train elsewhere unclipped: its comparison above checks the global norm."""
    _, clipped, _ = reference("mlp_z2_clip_schedule")
    t = worker.trainer("mlp_z2_clip_schedule", None, zero=0, clip_grad_norm=None)
    t.fit(worker.CASES["mlp_z2_clip_schedule"][2], worker.STEPS)
    free = worker.trainable(t.model)
    assert max(float(mx.abs(free[k] - clipped[k]).max()) for k in free) > 1e-2

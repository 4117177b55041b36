"""Trainer: learning, bit-exact resume, NaN stop, checkpoints."""


import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest

import metalnn as mn


def problem():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(256, 8)).astype(np.float32)
    y = (X[:, :3].sum(1) > 0).astype(np.int32) + (X[:, 3] > 1).astype(np.int32)
    return mx.array(X), mx.array(y)


def make(seed=0):
    device = mn.Device(seed=seed)
    model = mn.Layers([mn.Linear(32), mn.ReLU(), mn.Dropout(0.2), mn.Linear(3)])
    return model, device


def loss_fn(model, batch, device):
    x, y = batch
    return mn.losses.cross_entropy(model(x, device=device), y)


X, Y = problem()


def data(step):
    i = (step * 32) % 256
    return X[i:i + 32], Y[i:i + 32]


def test_loss_falls():
    model, device = make()
    tr = mn.Trainer(model, optim.Adam(1e-2), loss_fn, device, progress=False)
    tr.fit(data, 60)
    assert len(tr.history["loss"]) == 60
    assert np.mean(tr.history["loss"][-8:]) < 0.6 * np.mean(tr.history["loss"][:8])


@pytest.mark.parametrize("compile", [True, False])
def test_resume_is_bit_exact(tmp_path, compile):
    model, device = make()
    full = mn.Trainer(model, optim.AdamW(5e-3, weight_decay=0.01), loss_fn, device, progress=False, compile=compile)
    full.fit(data, 30)

    model, device = make()
    first = mn.Trainer(model, optim.AdamW(5e-3, weight_decay=0.01), loss_fn, device, progress=False,
                       compile=compile, checkpoint_dir=tmp_path, checkpoint_every=10)
    first.fit(data, 15)  # checkpoints at 10 and (end) 15
    assert (tmp_path / "latest").read_text() == "step_0000015"

    model, device = make(seed=123)  # a different seed: everything must come from the checkpoint
    second = mn.Trainer(model, optim.AdamW(5e-3, weight_decay=0.01), loss_fn, device, progress=False,
                        compile=compile, checkpoint_dir=tmp_path)
    assert second.resume() == 15
    second.fit(data, 30)
    assert second.history["loss"] == full.history["loss"]  # exact float equality
    for k, v in model.for_update().items():
        np.testing.assert_array_equal(np.array(v), np.array(full.model.for_update()[k]))


def test_resume_with_iterable_skips_seen_batches(tmp_path):
    batches = [data(i) for i in range(20)]
    model, device = make()
    full = mn.Trainer(model, optim.Adam(1e-2), loss_fn, device, progress=False)
    full.fit(batches, 20)
    model, device = make()
    a = mn.Trainer(model, optim.Adam(1e-2), loss_fn, device, progress=False, checkpoint_dir=tmp_path)
    a.fit(batches, 8)
    model, device = make(seed=123)  # other initial weights: only the checkpoint can make them equal
    b = mn.Trainer(model, optim.Adam(1e-2), loss_fn, device, progress=False)
    assert b.resume(tmp_path) == 8
    b.fit(batches, 20)
    assert b.history["loss"] == full.history["loss"]


def test_nan_detected_at_exact_step():
    model, device = make()
    tr = mn.Trainer(model, optim.SGD(0.01), loss_fn, device, progress=False)

    def batches(step):
        x, y = data(step)
        return (x * float("nan"), y) if step == 4 else (x, y)

    with pytest.raises(mn.TrainingDivergedError, match="at step 5"):
        tr.fit(batches, 10)
    assert tr.step_count == 5


def test_eval_callback_and_keep_checkpoints(tmp_path):
    model, device = make()
    seen = []

    def evaluate(trainer):
        seen.append(trainer.step_count)
        acc = mn.losses.accuracy(trainer.model(X, device=trainer.device), Y).item()
        return {"accuracy": acc}

    tr = mn.Trainer(model, optim.Adam(1e-2), loss_fn, device, progress=True, eval_fn=evaluate, eval_every=5,
                    checkpoint_dir=tmp_path, checkpoint_every=2, keep_checkpoints=2)
    tr.fit(data, 12)
    assert seen == [5, 10, 12]
    assert [m["step"] for m in tr.history["eval"]] == [5, 10, 12]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_0000010", "step_0000012"]


def test_items_per_batch_may_count_each_batch():
    """A function of the batch counts varying items (tokens of batches of varying length): it sees
    every step's batch once."""
    model, device = make()
    seen = []
    trainer = mn.Trainer(model, optim.Adam(1e-2), loss_fn, device, progress=False)
    trainer.fit(data, 3, items_per_batch=lambda batch: seen.append(batch[0]) or batch[0].size)
    assert len(seen) == 3 and all(np.array_equal(np.array(a), np.array(data(i)[0])) for i, a in enumerate(seen))

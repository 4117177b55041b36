"""Providers, strict all-or-nothing loading, atomic save, damaged files."""

import json

import mlx.core as mx
import numpy as np
import pytest

import metalnn as mn
from metalnn import weights as W


def make_model(device):
    m = mn.Layers([mn.Linear(6), mn.ReLU(), mn.Linear(3)])
    m.compile(device, mn.Data(mx.zeros((1, 4))))
    return m


def snapshot(m):
    return {k: np.array(v) for k, v in m.named_parameters().items()}


def other_weights(m, seed=1):
    rng = np.random.default_rng(seed)
    return {k: mx.array(rng.normal(size=v.shape).astype(np.float32)) for k, v in m.named_parameters().items()}


def test_dict_provider_round_trip(device):
    m = make_model(device)
    w = other_weights(m)
    loaded = m.load_from_provider(w)
    assert sorted(loaded) == sorted(w)
    for k, v in snapshot(m).items():
        np.testing.assert_array_equal(v, np.array(w[k]))


def test_strict_collects_all_problems_and_loads_nothing(device):
    m = make_model(device)
    before = snapshot(m)
    w = other_weights(m)
    del w["layers.0.bias"]
    w["layers.2.weight"] = mx.zeros((3, 5))
    w["layers.1.weight"] = mx.zeros((2,))
    w["layers.0.weight"] = w["layers.0.weight"].astype(mx.int32)
    with pytest.raises(mn.WeightLoadError) as e:
        m.load_from_provider(w)
    err = e.value
    assert err.missing == ["layers.0.bias"]
    assert err.unexpected == ["layers.1.weight"]
    assert set(err.mismatched) == {"layers.2.weight", "layers.0.weight"}
    assert "(3, 6)" in str(err) and "(3, 5)" in str(err) and "int32" in str(err)
    for k, v in snapshot(m).items():
        np.testing.assert_array_equal(v, before[k])


def test_non_strict_loads_what_matches(device):
    m = make_model(device)
    w = other_weights(m)
    del w["layers.0.bias"]
    w["extra"] = mx.zeros((1,))
    loaded = m.load_from_provider(w, strict=False)
    assert sorted(loaded) == ["layers.0.weight", "layers.2.bias", "layers.2.weight"]


def test_float_cast_on_load(device):
    m = make_model(device)
    w = {k: v.astype(mx.float16) for k, v in other_weights(m).items()}
    m.load_from_provider(w)
    assert m.layers[0].weight.dtype == mx.float32
    with pytest.raises(mn.WeightLoadError, match="float16"):
        m.load_from_provider(w, cast=False)


def test_save_and_load_safetensors_file(device, tmp_path):
    m = make_model(device)
    path = tmp_path / "w.safetensors"
    m.save(path)
    m2 = make_model(mn.Device(seed=9))
    m2.load_from_provider(path)
    for k, v in snapshot(m2).items():
        np.testing.assert_array_equal(v, snapshot(m)[k])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_npz_and_folder_providers(device, tmp_path):
    m = make_model(device)
    w = {k: np.array(v) for k, v in other_weights(m).items()}
    np.savez(tmp_path / "w.npz", **w)
    m.load_from_provider(tmp_path / "w.npz")
    np.testing.assert_array_equal(np.array(m.layers[0].weight), w["layers.0.weight"])
    folder = tmp_path / "hf"
    folder.mkdir()
    W.save_safetensors(folder / "model.safetensors", {k: mx.array(v) * 2 for k, v in w.items()})
    m.load_from_provider(folder)
    np.testing.assert_allclose(np.array(m.layers[0].weight), w["layers.0.weight"] * 2)


def test_sharded_folder(device, tmp_path):
    m = make_model(device)
    w = other_weights(m)
    names = sorted(w)
    W.save_safetensors(tmp_path / "model-00001-of-00002.safetensors", {k: w[k] for k in names[:2]})
    W.save_safetensors(tmp_path / "model-00002-of-00002.safetensors", {k: w[k] for k in names[2:]})
    index = {"metadata": {}, "weight_map": {k: f"model-0000{1 if i < 2 else 2}-of-00002.safetensors"
                                            for i, k in enumerate(names)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    m.load_from_provider(tmp_path)
    np.testing.assert_array_equal(np.array(m.layers[2].bias), np.array(w["layers.2.bias"]))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(mn.WeightLoadError, match="shard files missing"):
        m.load_from_provider(tmp_path)


@pytest.mark.parametrize("damage", ["truncate_data", "truncate_header", "garbage", "empty"])
def test_damaged_file_gives_clear_error_and_keeps_weights(device, tmp_path, damage):
    m = make_model(device)
    before = snapshot(m)
    path = tmp_path / "w.safetensors"
    W.save_safetensors(path, other_weights(m))
    raw = path.read_bytes()
    if damage == "truncate_data":
        path.write_bytes(raw[:-10])
    elif damage == "truncate_header":
        path.write_bytes(raw[:20])
    elif damage == "garbage":
        path.write_bytes(raw[:8] + b"\xff" * (len(raw) - 8))
    else:
        path.write_bytes(b"")
    with pytest.raises(mn.WeightLoadError, match=r"w\.safetensors"):
        m.load_from_provider(path)
    for k, v in snapshot(m).items():
        np.testing.assert_array_equal(v, before[k])


def test_missing_path_and_unbuilt_model(device, tmp_path):
    m = make_model(device)
    with pytest.raises(mn.WeightLoadError, match="no such file"):
        m.load_from_provider(tmp_path / "nope.safetensors")
    with pytest.raises(mn.WeightLoadError, match="no parameters yet"):
        mn.Layers([mn.Linear(3)]).load_from_provider({})
    built = mn.Linear(3, in_features=2)
    built.load_from_provider({"weight": mx.ones((3, 2)), "bias": mx.zeros((3,))})
    assert np.all(np.array(built.weight) == 1)


def test_failed_save_keeps_old_file(device, tmp_path, monkeypatch):
    m = make_model(device)
    path = tmp_path / "w.safetensors"
    m.save(path)
    original = path.read_bytes()

    def boom(file, arrays, metadata=None):
        with open(file, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        W.save_safetensors(path, other_weights(m))
    assert path.read_bytes() == original
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]


def test_save_requires_safetensors_suffix(device, tmp_path):
    with pytest.raises(ValueError, match=".safetensors"):
        make_model(device).save(tmp_path / "w.bin")

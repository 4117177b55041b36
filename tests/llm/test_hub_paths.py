"""What a model argument names: a local checkpoint, a mistyped local path, or a Hub name. Only a name
shaped like org/name that is not a local path may reach the Hub; every other failure names the path
and what was expected."""

import subprocess
import sys

import mlx.core as mx
import pytest

from metalnn.llm import hub


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "char_lm").mkdir(parents=True)
    (tmp_path / "runs" / "char_lm" / "config.json").write_text("{}")
    mx.save_safetensors(str(tmp_path / "runs" / "char_lm" / "model.safetensors"), {"w": mx.zeros(2)})
    return tmp_path


def no_hub(*args, **kwargs):
    raise AssertionError("the Hub was asked")


def test_a_weights_file_where_a_folder_is_expected_is_named(workdir):
    with pytest.raises(FileNotFoundError, match=r"runs/char_lm/model.safetensors: a safetensors weights file, not a "
                       r"model \(expected a model folder.*its folder runs/char_lm holds a config.json: pass the folder"):
        hub.local_path("runs/char_lm/model.safetensors")


def test_a_mistyped_local_path_is_not_sent_to_the_hub(workdir, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    with pytest.raises(FileNotFoundError, match=r"runs/char_lmm: no such file or folder \(in runs: char_lm\)"):
        hub.local_path("runs/char_lmm")
    with pytest.raises(FileNotFoundError, match=r"no such file or folder \(and no folder absent/deeper\)"):
        hub.local_path("absent/deeper/model")
    with pytest.raises(FileNotFoundError, match=r"\./runs/xyz: no such file or folder in runs"):
        hub.local_path("./runs/xyz")


def test_local_checkpoints_are_returned_as_they_are(workdir):
    assert hub.local_path("runs/char_lm") == hub.Path("runs/char_lm")
    assert hub.local_path("runs/char_lm/config.json").name == "config.json"


def test_only_org_name_shapes_go_to_the_hub(workdir, monkeypatch):
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda name, **kw: asked.append(name) or str(workdir))
    assert hub.local_path("someorg/somemodel") == workdir
    assert asked == ["someorg/somemodel"]


def test_the_command_names_the_file(workdir):
    out = subprocess.run([sys.executable, "-m", "metalnn", "info", "runs/char_lm/model.safetensors"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "runs/char_lm/model.safetensors: a safetensors weights file" in out.stderr
    assert "utf-8" not in out.stderr and "Traceback" not in out.stderr

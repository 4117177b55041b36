"""Hugging Face Hub names: ``"org/name"`` -> a local snapshot folder (``huggingface_hub``).

`local_path` returns a path that exists on this machine: the argument itself when it names a local
file or folder, else the snapshot ``huggingface_hub.snapshot_download`` provides (from its cache,
or downloaded, with only the files named by ``allow_patterns``). ``HF_HUB_OFFLINE=1`` keeps it to
the cache.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

#: files a model needs: config, weights, tokenizer and chat template (no PyTorch / GGUF copies)
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja"]
#: files a tokenizer needs
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


def is_repo_id(name) -> bool:
    """``"org/name"`` (one slash, Hub characters only)."""
    return isinstance(name, str) and bool(_REPO_ID.match(name)) and ".." not in name


#: files a model argument may name directly (anything else must be a folder)
CHECKPOINT_SUFFIXES = (".gguf", ".json")


def _describe_file(path: Path) -> str:
    kinds = {".safetensors": "a safetensors weights file", ".npz": "a NumPy weights archive",
             ".bin": "a PyTorch weights file", ".pt": "a PyTorch weights file", ".pth": "a PyTorch weights file"}
    return kinds.get(path.suffix.lower(), "a file")


def _check_local(path: Path) -> Path:
    """``path`` itself when it can hold a checkpoint: a folder, a ``.gguf`` file or a ``config.json``."""
    if path.is_dir() or path.suffix.lower() in CHECKPOINT_SUFFIXES:
        return path
    hint = ""
    if (path.parent / "config.json").is_file():
        hint = f"; its folder {path.parent} holds a config.json: pass the folder"
    raise FileNotFoundError(f"{path}: {_describe_file(path)}, not a model (expected a model folder with config.json "
                            f"and its weights, a .gguf file, or a Hub name org/name){hint}")


def _local_miss(path: Path) -> str | None:
    """Why ``path`` (which does not exist) is a mistyped local path rather than a Hub name, or None.

    A name is local when it is absolute, starts with ``.`` or ``~``, has more than one folder, or when
    its first folder exists here (``runs/char_lmm`` with a ``runs`` folder present)."""
    text = str(path)
    if path.is_absolute() or text.startswith((".", "~")) or len(path.parts) > 2 or not is_repo_id(text):
        parent = path.expanduser().parent
    elif Path(path.parts[0]).is_dir():
        parent = Path(path.parts[0])
    else:
        return None
    if not parent.is_dir():
        return f"no such file or folder (and no folder {parent})"
    near = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir()], n=3)
    return "no such file or folder" + (f" (in {parent}: {', '.join(near)})" if near else f" in {parent}")


def local_path(path_or_name, allow_patterns=MODEL_FILES) -> Path:
    """A local path for ``path_or_name``: itself if it exists, else a Hub snapshot folder.

    Only a name shaped like ``org/name`` that is not a local path goes to the Hub: ``runs/char_lmm``,
    when a ``runs`` folder exists here, is a mistyped local path and fails as one.

    Raises:
        FileNotFoundError: a local file that is not a checkpoint (a ``.safetensors`` file where a
            folder is expected), a missing local path (with the closest names in its folder), or a
            name the Hub (or its cache) cannot provide.
    """
    path = Path(path_or_name)
    if path.exists():
        return _check_local(path)
    name = str(path_or_name)
    miss = _local_miss(path)
    if miss is not None:
        raise FileNotFoundError(f"{name}: {miss}; expected a model folder with config.json, a .gguf file, or a "
                                f"Hub name org/name")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a dependency
        raise FileNotFoundError(f"{name}: not a local path, and huggingface_hub is not installed to fetch it") from None
    try:
        return Path(snapshot_download(name, allow_patterns=list(allow_patterns)))
    except Exception as e:  # RepositoryNotFoundError, LocalEntryNotFoundError (offline), HTTP errors
        raise FileNotFoundError(f"{name}: not a local file or folder, and the Hugging Face Hub could not provide it "
                                f"({type(e).__name__}: {e})") from None

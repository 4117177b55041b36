"""Hugging Face Hub names: ``"org/name"`` -> a local snapshot folder (``huggingface_hub``).

`local_path` returns a path that exists on this machine: the argument itself when it names a local
file or folder, else the snapshot ``huggingface_hub.snapshot_download`` provides (from its cache,
or downloaded, with only the files named by ``allow_patterns``). ``HF_HUB_OFFLINE=1`` keeps it to
the cache.
"""

from __future__ import annotations

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


def local_path(path_or_name, allow_patterns=MODEL_FILES) -> Path:
    """A local path for ``path_or_name``: itself if it exists, else a Hub snapshot folder.

    Raises:
        FileNotFoundError: neither a local path nor a Hub model the cache (or the Hub) provides.
    """
    path = Path(path_or_name)
    if path.exists():
        return path
    name = str(path_or_name)
    if not is_repo_id(name):
        raise FileNotFoundError(f"{name}: no such file or folder (expected a model folder with config.json, a .gguf "
                                f"file, or a Hub name org/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a dependency
        raise FileNotFoundError(f"{name}: not a local path, and huggingface_hub is not installed to fetch it") from None
    try:
        return Path(snapshot_download(name, allow_patterns=list(allow_patterns)))
    except Exception as e:  # RepositoryNotFoundError, LocalEntryNotFoundError (offline), HTTP errors
        raise FileNotFoundError(f"{name}: not a local file or folder, and the Hugging Face Hub could not provide it "
                                f"({type(e).__name__}: {e})") from None

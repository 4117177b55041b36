"""Weight providers, loading by dotted name, and atomic safetensors saving.

A *provider* maps dotted parameter names to arrays. `open_provider` accepts:

* a ``dict`` of ``mx.array`` / numpy arrays;
* a ``.safetensors`` file;
* a folder holding ``model.safetensors`` or a sharded ``model.safetensors.index.json``
  (the Hugging Face layout);
* an ``.npz`` file.

Files are checked before use: a truncated or corrupt safetensors file raises `WeightLoadError`
with the reason instead of crashing.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .errors import WeightLoadError

_ST_DTYPES = {
    "F64": mx.float32, "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16,
    "I64": mx.int64, "I32": mx.int32, "I16": mx.int16, "I8": mx.int8,
    "U64": mx.uint64, "U32": mx.uint32, "U16": mx.uint16, "U8": mx.uint8, "BOOL": mx.bool_,
}
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


def read_safetensors_header(path) -> dict:
    """Parse and validate a safetensors header: ``{name: (shape, dtype_string)}``.

    Raises `WeightLoadError` if the file is too short, the header is not JSON, or a tensor's byte
    range lies outside the file or does not match its shape and dtype.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightLoadError(source=str(path), message=f"{path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise WeightLoadError(source=str(path),
                                  message=f"{path}: corrupt or truncated safetensors file (header length {n}, "
                                          f"file size {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightLoadError(source=str(path), message=f"{path}: corrupt safetensors header ({e})") from None
    data_size = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise WeightLoadError(source=str(path), message=f"{path}: corrupt entry for {name!r}") from None
        want = int(np.prod(shape, dtype=np.int64)) * _ST_ITEMSIZE.get(dtype, 0)
        if dtype not in _ST_DTYPES or end - start != want or end > data_size or start < 0:
            raise WeightLoadError(
                source=str(path),
                message=f"{path}: tensor {name!r} ({dtype} {shape}) has byte range [{start}, {end}) but the data "
                        f"section holds {data_size} bytes: the file is truncated or corrupt")
        out[name] = (tuple(shape), _ST_DTYPES[dtype])
    return out


class Provider:
    """A read-only mapping of names to arrays, loaded lazily."""

    def __init__(self, source: str):
        self.source = source

    def keys(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def spec(self, name):
        """(shape, dtype) of ``name`` without loading it."""
        a = self.get(name)
        return tuple(a.shape), a.dtype

    def get(self, name) -> mx.array:  # pragma: no cover - abstract
        raise NotImplementedError

    def __contains__(self, name):
        return name in set(self.keys())

    def __getitem__(self, name):
        return self.get(name)

    def __repr__(self):
        return f"{type(self).__name__}({self.source!r})"


class DictProvider(Provider):
    def __init__(self, weights: dict, source="dict"):
        super().__init__(source)
        self._w = {k: (v if isinstance(v, mx.array) else mx.array(np.asarray(v))) for k, v in weights.items()}

    def keys(self):
        return list(self._w)

    def get(self, name):
        return self._w[name]

    def spec(self, name):
        a = self._w[name]
        return tuple(a.shape), a.dtype


class SafetensorsProvider(Provider):
    """One or more safetensors files (shards), validated on open, loaded on first ``get``."""

    def __init__(self, files, source=None):
        files = [Path(f) for f in files]
        super().__init__(source or str(files[0]))
        self._files = files
        self._where = {}
        self._specs = {}
        for f in files:
            for name, spec in read_safetensors_header(f).items():
                self._where[name] = f
                self._specs[name] = spec
        self._loaded = {}

    def keys(self):
        return list(self._specs)

    def spec(self, name):
        return self._specs[name]

    def get(self, name):
        f = self._where[name]
        if f not in self._loaded:
            try:
                self._loaded[f] = mx.load(str(f))
            except Exception as e:  # MLX raises RuntimeError/ValueError on bad files
                raise WeightLoadError(source=str(f), message=f"{f}: could not read safetensors data ({e})") from None
        return self._loaded[f][name]


class NpzProvider(DictProvider):
    def __init__(self, path):
        try:
            with np.load(path) as z:
                weights = {k: z[k] for k in z.files}
        except Exception as e:
            raise WeightLoadError(source=str(path), message=f"{path}: could not read .npz ({e})") from None
        super().__init__(weights, source=str(path))


def open_provider(provider) -> Provider:
    """Turn a dict, path (file or Hugging Face folder) or Provider into a `Provider`."""
    if isinstance(provider, Provider):
        return provider
    if isinstance(provider, dict):
        return DictProvider(provider)
    path = Path(provider)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        single = path / "model.safetensors"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise WeightLoadError(source=str(index), message=f"{index}: bad index file ({e})") from None
            shards = sorted({path / f for f in weight_map.values()})
            missing = [str(s) for s in shards if not s.exists()]
            if missing:
                raise WeightLoadError(source=str(index), message=f"{index}: shard files missing: {missing}")
            return SafetensorsProvider(shards, source=str(path))
        if single.exists():
            return SafetensorsProvider([single], source=str(path))
        files = sorted(path.glob("*.safetensors"))
        if files:
            return SafetensorsProvider(files, source=str(path))
        raise WeightLoadError(source=str(path), message=f"{path}: no model.safetensors, sharded index or "
                                                        f"*.safetensors files in this folder")
    if not path.exists():
        raise WeightLoadError(source=str(path), message=f"{path}: no such file or folder")
    if path.suffix == ".npz":
        return NpzProvider(path)
    if path.suffix == ".safetensors":
        return SafetensorsProvider([path])
    raise WeightLoadError(source=str(path), message=f"{path}: unsupported weight file (use .safetensors, .npz "
                                                    f"or a Hugging Face folder)")


def _kind(dtype):
    if dtype == mx.bool_:
        return "bool"
    return "float" if mx.issubdtype(dtype, mx.floating) else "int"


def load_into(model, provider, strict: bool = True, cast: bool = True, rename=None, transform=None):
    """Load ``provider``'s arrays into ``model``'s parameters by dotted name, all or nothing.

    Args:
        model: an ``mlx.nn.Module`` (every metalnn layer is one) whose parameters exist.
        provider: anything `open_provider` accepts.
        strict: collect every missing, unexpected and mismatched name into one `WeightLoadError`
            and load nothing if any. With ``strict=False``, load the names that match and ignore
            the rest (mismatched shapes still raise).
        cast: cast floating-point arrays to the parameter's dtype (fp16 checkpoint into an fp32
            model); a change of kind (float <-> int) is always a mismatch.
        rename: optional ``f(provider_name) -> model_name or None`` (None drops the tensor).
        transform: optional ``f(model_name, array) -> array`` applied before checking shapes.
    Returns:
        the list of model names that were loaded.
    """
    prov = open_provider(provider)
    params = dict(tree_flatten(model.parameters()))
    if not params:
        raise WeightLoadError(source=prov.source, message=(
            f"{type(model).__name__} has no parameters yet: compile it once (or call build_for(dims)) "
            f"before loading weights"))
    names = {}
    for key in prov.keys():
        target = rename(key) if rename else key
        if target is not None:
            names[target] = key
    missing = [n for n in params if n not in names]
    unexpected = [n for n in names if n not in params]
    mismatched = {}
    new = {}
    for name, key in names.items():
        if name not in params:
            continue
        p = params[name]
        if transform is None:
            shape, dtype = prov.spec(key)
            arr = None
        else:
            arr = transform(name, prov.get(key))
            shape, dtype = tuple(arr.shape), arr.dtype
        if shape != tuple(p.shape) or (_kind(dtype) != _kind(p.dtype)) or (not cast and dtype != p.dtype):
            mismatched[name] = (f"{tuple(p.shape)} {p.dtype}", f"{shape} {dtype}")
            continue
        new[name] = (key, arr)
    if mismatched or (strict and (missing or unexpected)):
        raise WeightLoadError(missing if strict else (), unexpected if strict else (), mismatched, source=prov.source)
    loaded = {}
    for name, (key, arr) in new.items():
        a = prov.get(key) if arr is None else arr
        loaded[name] = a.astype(params[name].dtype) if a.dtype != params[name].dtype else a
    mx.eval(list(loaded.values()))
    model.update(tree_unflatten(list(loaded.items())))
    return list(loaded)


def save_safetensors(path, arrays: dict, metadata: dict | None = None) -> None:
    """Write ``{name: mx.array}`` to ``path`` atomically: a temp file in the same folder, fsync, rename.

    A crash or error mid-save leaves any existing file at ``path`` untouched.
    """
    import tempfile  # (only saving needs it: not imported with metalnn)

    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"save: path must end in .safetensors, got {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {k: (v if isinstance(v, mx.array) else mx.array(v)) for k, v in arrays.items()}
    mx.eval(list(arrays.values()))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".safetensors", dir=path.parent)
    os.close(fd)
    try:
        mx.save_safetensors(tmp, arrays, metadata={str(k): str(v) for k, v in (metadata or {}).items()})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_safetensors(path) -> dict:
    """Read a safetensors file into ``{name: mx.array}`` after validating it."""
    prov = SafetensorsProvider([path])
    return {k: prov.get(k) for k in prov.keys()}

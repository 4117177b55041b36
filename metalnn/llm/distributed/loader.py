"""Loading one rank's part of a checkpoint: `shard_model` (cut a model built from its config to the
rank's part, pipeline or tensor parallel), `TensorReader` (safetensors shards read one tensor at a
time, counting what it reads) and `gguf_config` / `read_gguf_part` (a GGUF file's config without its
data, then only the tensors of the blocks a rank holds).

`metalnn.llm.models.load_pretrained` (``pipeline=`` / ``tensor=``) runs these: the model is built
from the config with lazy parameters (nothing allocated), quantized layers placed as the checkpoint
says, cut to the rank's part, and loaded through the cut model's names: a pipeline rank reads only
the tensors of its blocks (and the table / head it holds); a tensor-parallel rank reads every tensor
and keeps its slice (a gathered copy, so the whole tensor is freed before the next is read).
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct

import mlx.core as mx
import numpy as np

from ...errors import UnsupportedConfigError, WeightLoadError
from ...weights import Provider, open_provider, read_safetensors_header
from ..gguf import convert as gguf_convert
from ..gguf.reader import read_header
from ..gguf.tensors import AFFINE, FLOATS, read_tensors
from .placement import owner

_NP = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
       "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
       "U8": np.uint8, "BOOL": np.bool_}


class TensorReader(Provider):
    """The tensors of a Hugging Face folder's safetensors files (or one file), each read from the file
    on ``get`` into a fresh array of its own (nothing else is read or kept). ``reads`` lists the names
    read, in order."""

    def __init__(self, path):
        base = open_provider(path)
        files = getattr(base, "_files", None)
        if files is None:
            raise WeightLoadError(source=str(path), message=f"{path}: distributed loading reads safetensors files")
        super().__init__(base.source)
        self._where = {}
        for f in files:
            read_safetensors_header(f)  # validated
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, info in header.items():
                if name != "__metadata__":
                    self._where[name] = (f, 8 + n + info["data_offsets"][0], info["dtype"], tuple(info["shape"]))
        self._base = base
        self.reads = []

    def keys(self):
        return list(self._where)

    def spec(self, name):
        return self._base.spec(name)

    def get(self, name):
        f, offset, dtype, shape = self._where[name]
        count = int(np.prod(shape, dtype=np.int64))
        raw = np.fromfile(f, dtype=_NP[dtype], count=count, offset=offset).reshape(shape)
        self.reads.append(name)
        if dtype == "BF16":
            return mx.array(raw).view(mx.bfloat16)
        if dtype == "F64":
            return mx.array(raw.astype(np.float32))
        return mx.array(raw)


def gguf_config(path, converters: dict):
    """``(config, header, converter)`` of a ``.gguf`` file from its header alone (no tensor data):
    the config as `metalnn.llm.gguf.convert.read_checkpoint` gives it before the tensors are converted
    (with its ``quantization``)."""
    header = read_header(path)
    converter = gguf_convert.converter_for(header, converters)(header)
    config = converter.config()
    regroupable = not converter.keeps_ggml_blocks
    converter.packed = {} if regroupable else {i.name: i.type for i in header.tensors.values()
                                               if i.type not in FLOATS}
    q = converter.quantization({})
    if q is not None:
        config["quantization"] = q
    return config, header, converter


_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.")


def read_gguf_part(header, converter, config: dict, holds) -> tuple:
    """``(tensors, read)``: the file's tensors under Hugging Face's names, of only those GGUF tensors
    whose owner ``holds(owner)`` accepts (a block ``blk.N.*`` is ``model.layers.N``; the others by
    their converted name; tensors no name maps, such as ``rope_freqs``, are always read), and the
    GGUF names read. ``config`` takes what the converter derives from tensors (Llama 3's rope factors)."""
    keep = {}
    for name, info in header.tensors.items():
        m = _GGUF_BLOCK.match(name)
        hf = converter.hf_name(name)
        own = f"model.layers.{m.group(1)}" if m else (owner(hf) if hf is not None else None)
        if own is None or holds(own):
            keep[name] = info
    part = dataclasses.replace(header, tensors=keep)
    arrays, _ = read_tensors(part, regroupable=not converter.keeps_ggml_blocks)
    return converter.convert(arrays, config), list(keep)


class RankWeights:
    """Mixin of a `CausalLM` cut to one rank's part (`shard_model`): checkpoint tensors of the parts
    other ranks hold are dropped before they are read; tensors split across ranks are sliced after the
    model's own transform."""

    def rename_weight(self, name):
        new = super().rename_weight(name)
        if new is not None and owner(new) in self._shard.others:
            return None
        return new

    def transform_weight(self, name, array):
        array = super().transform_weight(name, array)
        cut = self._shard.cuts.get(name)
        return array if cut is None else cut(array)


@dataclasses.dataclass
class Shard:
    """What `shard_model` decided for one rank.

    Attributes:
        kind: ``"pipeline"`` or ``"tensor"``.
        group: the ``mx.distributed`` group.
        owners: the parts (`placement.owner`) this rank holds.
        others: the parts of the whole model this rank does not hold (their tensors are not read).
        cuts: ``{parameter name: function(whole tensor) -> this rank's slice}`` (tensor parallel).
        blocks: the decoder blocks this rank runs, ``(start, end)``.
    """

    kind: str
    group: object
    owners: set
    others: set
    cuts: dict
    blocks: tuple


_CLASSES: dict = {}


def _subclass(cls, mixins: tuple):
    key = (cls, mixins)
    if key not in _CLASSES:
        prefix = "".join(m.__name__.replace("LM", "").replace("Weights", "") for m in mixins)
        _CLASSES[key] = type(f"{prefix}{cls.__name__}", mixins + (cls,), {"__module__": cls.__module__})
    return _CLASSES[key]


def shard_model(model, *, pipeline=None, tensor=None, dtype=mx.float32):
    """Cut ``model`` (built from its config, weights not loaded) to rank ``group.rank()``'s part in
    place and return it: ``pipeline=group`` keeps the rank's stage (`pipeline.pipeline_model`),
    ``tensor=group`` splits heads, hidden columns and the vocabulary (`tensor_parallel.shard_tensor`).
    ``model.shard`` describes the result (`Shard`).

    Raises:
        UnsupportedConfigError: both groups given, or a model / size the split does not fit.
    """
    from .pipeline import PipelineLM, pipeline_model
    from .tensor_parallel import shard_tensor

    if (pipeline is None) == (tensor is None):
        raise ValueError("shard_model: give pipeline=group or tensor=group (one of them)")
    everything = {owner(n) for n in model.named_parameters()}
    if pipeline is not None:
        blocks = pipeline_model(model, pipeline, dtype)
        cuts, kind, group, mixins = {}, "pipeline", pipeline, (RankWeights, PipelineLM)
    else:
        cuts = shard_tensor(model, tensor)
        blocks = (0, model.num_layers)
        kind, group, mixins = "tensor", tensor, (RankWeights,)
    owners = {owner(n) for n in model.named_parameters()}
    model.__class__ = _subclass(type(model), mixins)
    object.__setattr__(model, "_shard", Shard(kind, group, owners, everything - owners, cuts, blocks))
    return model


def check_group(group, what: str):
    """``group`` if it is an ``mx.distributed.Group``; TypeError otherwise."""
    if not isinstance(group, mx.distributed.Group):
        raise TypeError(f"{what} must be an mx.distributed.Group (mx.distributed.init()), got {type(group).__name__}")
    return group


def refuse_both(pipeline, tensor):
    if pipeline is not None and tensor is not None:
        raise UnsupportedConfigError("give pipeline= or tensor=, not both (a model is split one way)")


__all__ = ["TensorReader", "gguf_config", "read_gguf_part", "RankWeights", "Shard", "shard_model", "check_group"]

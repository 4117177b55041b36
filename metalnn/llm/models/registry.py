"""The one registry of language-model architectures, keyed by Hugging Face architecture name (a
config's ``architectures``), ``model_type`` and GGUF architecture (``general.architecture``).

Each architecture module registers its model class once, next to its definition::

    @register("LlamaForCausalLM", model_types=("llama",), gguf=LlamaConverter)
    class LlamaForCausalLM(CausalLM):
        args_class = ModelArgs
        ...

The first name and model type are the ones `save_pretrained` writes (``cls.architecture``,
``cls.model_type``); the others are read too (``Qwen3_5ForConditionalGeneration`` folders load as
`Qwen3_5ForCausalLM`). ``gguf`` is the `metalnn.llm.gguf.convert.Converter` of the llama.cpp
architecture whose files load as this model (None: no GGUF files).

`ARCHITECTURES` is the registry: a mapping ``{Hugging Face architecture name: model class}`` with
`Registry.for_config`, `Registry.for_model_type` and `Registry.for_gguf`.
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass

from ...errors import UnsupportedConfigError
from .base import BaseModelArgs, CausalLM


@dataclass(frozen=True)
class Architecture:
    """One registered architecture.

    Attributes:
        model: the `CausalLM` subclass.
        names: Hugging Face architecture names (the first is written by `save_pretrained`).
        model_types: config ``model_type`` values (the first is written by `save_pretrained`).
        gguf: the GGUF `Converter` class of its files (its ``architecture`` is the GGUF key), or None.
        more_gguf: the converters of further llama.cpp architectures of the same model (Nemotron-H's
            ``nemotron_h_moe``); `Registry.for_gguf` gives each an entry whose ``gguf`` is that converter.
    """

    model: type
    names: tuple
    model_types: tuple
    gguf: type | None = None
    more_gguf: tuple = ()


class Registry(Mapping):
    """Registered architectures; as a mapping ``{Hugging Face architecture name: model class}``."""

    def __init__(self):
        self._by_name: dict = {}
        self._by_model_type: dict = {}
        self._by_gguf: dict = {}
        self._entries: list = []

    def add(self, entry: Architecture):
        """Register ``entry``; ValueError when one of its keys (or its class) is registered already."""
        taken = [f"architecture {n!r}" for n in entry.names if n in self._by_name]
        taken += [f"model_type {t!r}" for t in entry.model_types if t in self._by_model_type]
        converters = ([entry.gguf] if entry.gguf is not None else []) + list(entry.more_gguf)
        taken += [f"GGUF architecture {c.architecture!r}" for c in converters if c.architecture in self._by_gguf]
        if any(e.model is entry.model for e in self._entries):
            taken.append(f"class {entry.model.__name__}")
        if taken:
            raise ValueError(f"{entry.model.__name__}: already registered: {', '.join(taken)}")
        self._entries.append(entry)
        for n in entry.names:
            self._by_name[n] = entry
        for t in entry.model_types:
            self._by_model_type[t] = entry
        if entry.gguf is not None:
            self._by_gguf[entry.gguf.architecture] = entry
        for c in entry.more_gguf:
            self._by_gguf[c.architecture] = dataclasses.replace(entry, gguf=c, more_gguf=())

    # -- Mapping ---------------------------------------------------------------------------------
    def __getitem__(self, name: str):
        return self._by_name[name].model

    def __iter__(self):
        return iter(self._by_name)

    def __len__(self):
        return len(self._by_name)

    # -- lookups ---------------------------------------------------------------------------------
    def entries(self) -> list:
        """Every `Architecture`, in registration order."""
        return list(self._entries)

    def for_model_type(self, model_type: str) -> Architecture | None:
        return self._by_model_type.get(model_type)

    def for_gguf(self, architecture: str) -> Architecture | None:
        return self._by_gguf.get(architecture)

    def gguf_converters(self) -> dict:
        """``{GGUF architecture: Converter class}`` of every architecture that reads GGUF files."""
        return {name: entry.gguf for name, entry in self._by_gguf.items()}

    def for_config(self, config: dict) -> Architecture:
        """The architecture of a config: its first ``architectures`` entry that is registered, or (when it
        lists none) its ``model_type``.

        Raises:
            UnsupportedConfigError: naming the config's architectures and the supported ones.
        """
        archs = config.get("architectures") or []
        for arch in archs:
            if arch in self._by_name:
                return self._by_name[arch]
        if not archs and config.get("model_type") in self._by_model_type:
            return self._by_model_type[config["model_type"]]
        named = ", ".join(archs) if archs else f"model_type={config.get('model_type')!r}"
        raise UnsupportedConfigError(f"unsupported architecture {named}; metalnn supports "
                                     f"{', '.join(sorted(self._by_name))}")


#: the registry of every architecture `metalnn.llm.models` implements
ARCHITECTURES = Registry()


def register(*names: str, model_types: tuple, gguf=None, registry: Registry = ARCHITECTURES):
    """Class decorator: register a `CausalLM` subclass under Hugging Face architecture ``names``,
    ``model_types`` and (optionally) the GGUF converter of its files (a tuple: the converters of
    several llama.cpp architectures); sets ``architecture`` and ``model_type`` to the first of each.

    Raises:
        TypeError: the class is no `CausalLM`, or its ``args_class`` no `BaseModelArgs` dataclass.
        ValueError: no name or model type, or a key taken already.
    """

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, CausalLM)):
            raise TypeError(f"register: {cls!r} is not a CausalLM subclass")
        args = cls.__dict__.get("args_class")
        if not (isinstance(args, type) and issubclass(args, BaseModelArgs) and args is not BaseModelArgs):
            raise TypeError(f"register: {cls.__name__} must set args_class to its ModelArgs (a BaseModelArgs "
                            "dataclass)")
        if not names or not model_types:
            raise ValueError(f"register: {cls.__name__} needs at least one architecture name and model type")
        converters = tuple(gguf) if isinstance(gguf, (tuple, list)) else (gguf,)
        registry.add(Architecture(cls, tuple(names), tuple(model_types), converters[0], converters[1:]))
        cls.architecture, cls.model_type = names[0], model_types[0]
        return cls

    return decorate


def model_class(config: dict):
    """The metalnn class for a config's ``architectures`` (or ``model_type``)."""
    return ARCHITECTURES.for_config(config).model

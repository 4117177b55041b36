"""Expert weights of mixture-of-experts checkpoints: per-expert tensors <-> stacked parameters.

Hugging Face checkpoints store each expert as its own gated MLP
(``<prefix>.experts.<e>.gate_proj.weight`` ``[I, W]``, ``.up_proj.weight`` ``[I, W]``,
``.down_proj.weight`` ``[W, I]``); metalnn's `SwitchGLU` (as transformers 5 in memory) holds them
stacked: ``<prefix>.experts.gate_up_proj`` ``[E, 2*I, W]`` (each expert's gate rows, then its up
rows) and ``<prefix>.experts.down_proj`` ``[E, W, I]``.
"""

from __future__ import annotations

import re

import mlx.core as mx

from ...errors import WeightLoadError
from ...weights import Provider, open_provider

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$")
_KINDS = ("gate_proj", "up_proj", "down_proj")


class StackedExpertsProvider(Provider):
    """A provider that shows per-expert tensors of ``base`` as stacked ``experts.gate_up_proj`` /
    ``experts.down_proj`` arrays (built on first ``get``); every other name passes through.

    Raises `WeightLoadError` when a layer's experts are incomplete (an expert number or one of its
    three projections missing) or their shapes disagree.
    """

    def __init__(self, base):
        base = open_provider(base)
        super().__init__(base.source)
        self.base = base
        groups: dict = {}
        self._plain = []
        for key in base.keys():
            m = _PER_EXPERT.match(key)
            if m is None:
                self._plain.append(key)
            else:
                groups.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})[m["kind"]] = key
        self._stacked = {}     # virtual name -> (list of key lists, concat kind)
        self._specs = {}
        for prefix, experts in groups.items():
            n = len(experts)
            problems = [f"{prefix}.{e}.{k}.weight" for e in range(n) for k in _KINDS if k not in experts.get(e, {})]
            if problems or sorted(experts) != list(range(n)):
                raise WeightLoadError(missing=problems, source=self.source, message=(
                    f"{self.source}: the experts under {prefix!r} are incomplete: expected experts 0..{n - 1} each "
                    f"with gate_proj, up_proj and down_proj; missing {problems or 'expert numbers'}"))
            shapes = {k: {base.spec(experts[e][k])[0] for e in range(n)} for k in _KINDS}
            if any(len(s) != 1 for s in shapes.values()) or shapes["gate_proj"] != shapes["up_proj"]:
                raise WeightLoadError(source=self.source, message=(
                    f"{self.source}: the experts under {prefix!r} disagree in shape: {shapes}"))
            (i, w), = shapes["gate_proj"]
            dtype = base.spec(experts[0]["gate_proj"])[1]
            self._stacked[f"{prefix}.gate_up_proj"] = [[experts[e]["gate_proj"], experts[e]["up_proj"]]
                                                       for e in range(n)]
            self._specs[f"{prefix}.gate_up_proj"] = ((n, 2 * i, w), dtype)
            self._stacked[f"{prefix}.down_proj"] = [[experts[e]["down_proj"]] for e in range(n)]
            self._specs[f"{prefix}.down_proj"] = ((n,) + tuple(next(iter(shapes["down_proj"]))), dtype)

    def keys(self):
        return self._plain + list(self._stacked)

    def spec(self, name):
        return self._specs[name] if name in self._specs else self.base.spec(name)

    def get(self, name):
        if name not in self._stacked:
            return self.base.get(name)
        return mx.stack([mx.concatenate([self.base.get(k) for k in keys], axis=0)
                         for keys in self._stacked[name]])


def split_experts(params: dict) -> dict:
    """``{name: array}`` with every stacked ``*.experts.gate_up_proj`` / ``*.experts.down_proj``
    replaced by the per-expert tensors of the Hugging Face layout."""
    out = {}
    for name, a in params.items():
        if name.endswith(".experts.gate_up_proj") and a.ndim == 3:
            prefix, half = name[:-len(".gate_up_proj")], a.shape[1] // 2
            for e in range(a.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = a[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = a[e, half:]
        elif name.endswith(".experts.down_proj") and a.ndim == 3:
            prefix = name[:-len(".down_proj")]
            for e in range(a.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = a[e]
        else:
            out[name] = a
    return out

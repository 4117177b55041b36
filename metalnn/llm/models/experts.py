"""Mixture-of-experts models: expert weights of checkpoints (per-expert tensors <-> stacked
parameters) and `RoutedExperts`, the model-level API shared by the sparse-expert families
(Qwen3-Next, Qwen3-MoE, Mixtral): stacking on load, splitting on save, the router's auxiliary loss.

Hugging Face checkpoints store each expert as its own gated MLP
(``<prefix>.experts.<e>.gate_proj.weight`` ``[I, W]``, ``.up_proj.weight`` ``[I, W]``,
``.down_proj.weight`` ``[W, I]``); metalnn's `SwitchGLU` (as transformers 5 in memory) holds them
stacked: ``<prefix>.experts.gate_up_proj`` ``[E, 2*I, W]`` (each expert's gate rows, then its up
rows) and ``<prefix>.experts.down_proj`` ``[E, W, I]``. Checkpoints that name the three
projections otherwise (Mixtral's ``w1`` gate, ``w3`` up, ``w2`` down) pass their names as ``names``.

"""

from __future__ import annotations

import re

import mlx.core as mx

from ...errors import WeightLoadError
from ...layers.moe import SparseMoE, load_balancing_loss
from ...weights import Provider, open_provider

#: the per-expert projection names of Hugging Face's Qwen-MoE checkpoints: (gate, up, down)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: Mixtral's: ``w1`` gate, ``w3`` up, ``w2`` down
MIXTRAL_PROJECTIONS = ("w1", "w3", "w2")


def _per_expert(names: tuple):
    kinds = "|".join(map(re.escape, names))
    return re.compile(rf"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<kind>{kinds})\.weight$")


class StackedExpertsProvider(Provider):
    """A provider that shows per-expert tensors of ``base`` as stacked ``experts.gate_up_proj`` /
    ``experts.down_proj`` arrays (built on first ``get``); every other name passes through.

    ``names``: the checkpoint's (gate, up, down) projection names (`PROJECTIONS`, `MIXTRAL_PROJECTIONS`).

    Raises `WeightLoadError` when a layer's experts are incomplete (an expert number or one of its
    three projections missing) or their shapes disagree.
    """

    def __init__(self, base, names: tuple = PROJECTIONS):
        base = open_provider(base)
        super().__init__(base.source)
        self.base = base
        gate_name, up_name, down_name = names
        pattern = _per_expert(names)
        groups: dict = {}
        self._plain = []
        for key in base.keys():
            m = pattern.match(key)
            if m is None:
                self._plain.append(key)
            else:
                groups.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})[m["kind"]] = key
        self._stacked = {}     # virtual name -> (list of key lists, concat kind)
        self._specs = {}
        for prefix, experts in groups.items():
            n = max(experts) + 1
            problems = [f"{prefix}.{e}.{k}.weight" for e in range(n) for k in names if k not in experts.get(e, {})]
            if problems:
                raise WeightLoadError(missing=problems, source=self.source, message=(
                    f"{self.source}: the experts under {prefix!r} are incomplete: expected experts 0..{n - 1} each "
                    f"with {', '.join(names)}; missing {problems}"))
            shapes = {k: {base.spec(experts[e][k])[0] for e in range(n)} for k in names}
            if any(len(s) != 1 for s in shapes.values()) or shapes[gate_name] != shapes[up_name]:
                raise WeightLoadError(source=self.source, message=(
                    f"{self.source}: the experts under {prefix!r} disagree in shape: {shapes}"))
            (i, w), = shapes[gate_name]
            dtype = base.spec(experts[0][gate_name])[1]
            self._stacked[f"{prefix}.gate_up_proj"] = [[experts[e][gate_name], experts[e][up_name]]
                                                       for e in range(n)]
            self._specs[f"{prefix}.gate_up_proj"] = ((n, 2 * i, w), dtype)
            self._stacked[f"{prefix}.down_proj"] = [[experts[e][down_name]] for e in range(n)]
            self._specs[f"{prefix}.down_proj"] = ((n,) + tuple(next(iter(shapes[down_name]))), dtype)

    def keys(self):
        return self._plain + list(self._stacked)

    def spec(self, name):
        return self._specs[name] if name in self._specs else self.base.spec(name)

    def get(self, name):
        if name not in self._stacked:
            return self.base.get(name)
        return mx.stack([mx.concatenate([self.base.get(k) for k in keys], axis=0)
                         for keys in self._stacked[name]])


def split_experts(params: dict, names: tuple = PROJECTIONS) -> dict:
    """``{name: array}`` with every stacked ``*.experts.gate_up_proj`` / ``*.experts.down_proj``
    replaced by the per-expert tensors of the Hugging Face layout (projections named ``names``:
    gate, up, down)."""
    gate_name, up_name, down_name = names
    out = {}
    for name, a in params.items():
        if name.endswith(".experts.gate_up_proj") and a.ndim == 3:
            prefix, half = name[:-len(".gate_up_proj")], a.shape[1] // 2
            for e in range(a.shape[0]):
                out[f"{prefix}.{e}.{gate_name}.weight"] = a[e, :half]
                out[f"{prefix}.{e}.{up_name}.weight"] = a[e, half:]
        elif name.endswith(".experts.down_proj") and a.ndim == 3:
            prefix = name[:-len(".down_proj")]
            for e in range(a.shape[0]):
                out[f"{prefix}.{e}.{down_name}.weight"] = a[e]
        else:
            out[name] = a
    return out


class RoutedExperts:
    """Model-level API of a `CausalLM` whose decoder blocks' ``mlp`` is a `SparseMoE` on some layers:
    per-expert checkpoint tensors stacked on load (`StackedExpertsProvider`) and split again by
    `save_pretrained` (`split_experts`; ``expert_names``: the checkpoint's projection names), the
    router-logit switch and the auxiliary load-balancing loss, as transformers' ``aux_loss``.

    Training with it::

        model.output_router_logits = True
        def loss_fn(model, batch, device):
            logits = model(batch[:, :-1], device=device)
            ce = metalnn.losses.cross_entropy(logits, batch[:, 1:])
            return ce + model.args.router_aux_loss_coef * model.aux_loss()
    """

    #: the checkpoint's per-expert (gate, up, down) projection names
    expert_names = PROJECTIONS

    @property
    def output_router_logits(self) -> bool:
        """Keep each MoE layer's router logits of the most recent call (for `aux_loss`)."""
        layers = self.moe_layers()
        return bool(layers) and all(moe.record_router_logits for moe in layers)

    @output_router_logits.setter
    def output_router_logits(self, value: bool):
        for moe in self.moe_layers():
            moe.record_router_logits = bool(value)
            moe.forget_router_logits()

    def moe_layers(self) -> list:
        """The `SparseMoE` feed-forward blocks, in layer order."""
        return [block.mlp for block in self.decoder_layers if isinstance(block.mlp, SparseMoE)]

    def router_logits(self) -> list:
        """The router logits ``[tokens, E]`` of every MoE layer from the most recent call (needs
        ``output_router_logits``)."""
        return [moe.router_logits for moe in self.moe_layers() if moe.router_logits is not None]

    def aux_loss(self):
        """The load-balancing loss (`load_balancing_loss`, as transformers' ``aux_loss``) of the most
        recent call, over all MoE layers; the kept router logits are released. Call it inside the
        loss function, after the forward pass, with ``output_router_logits`` set."""
        logits = self.router_logits()
        if not logits:
            raise ValueError(f"{self.architecture}.aux_loss: no router logits; set model.output_router_logits = "
                             "True and run the model first")
        first = self.moe_layers()[0]
        loss = load_balancing_loss(logits, first.num_experts, first.top_k)
        for moe in self.moe_layers():
            moe.forget_router_logits()
        return loss

    def load_weights_from(self, provider, strict: bool = True):
        return super().load_weights_from(StackedExpertsProvider(provider, self.expert_names), strict=strict)

    def export_weights(self):
        return split_experts(self.named_parameters(), self.expert_names)

    def moe_features(self) -> list:
        """One phrase on the experts (for ``features``): experts per token, which layers are dense."""
        moe = self.moe_layers()
        if not moe:
            return []
        out = [f"mixture of experts: {moe[0].top_k} of {moe[0].num_experts} experts per token"
               f"{' (renormalised)' if moe[0].norm_topk_prob else ''}"]
        dense = [i for i, block in enumerate(self.decoder_layers) if not isinstance(block.mlp, SparseMoE)]
        if dense:
            out.append(f"dense feed-forward on layers {', '.join(map(str, dense))}")
        return out

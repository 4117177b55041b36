"""The models a server answers for: its base model and its named LoRA adapters (`ServedModels`).

``metalnn serve MODEL --adapter NAME=DIR`` serves each adapter under the model id ``NAME`` (as vLLM
does with ``--lora-modules NAME=DIR``): ``GET /v1/models`` lists the base model, then one card per
adapter with ``"parent"`` naming the base model, and a request with ``"model": "NAME"`` is decoded
with that adapter (``"model"`` left out, or the base model's id: no adapter). The official clients
send ``model`` as an opaque string, so a bare name is what they expect; any other id gets 404
``model_not_found`` listing the ids served.
"""

from __future__ import annotations

from .errors import APIError

__all__ = ["ServedModels", "check_adapter_name"]


def check_adapter_name(name: str, base: str) -> str:
    """``name`` if it can be an adapter's model id next to the base model ``base``, else ValueError."""
    if not name or name != name.strip() or any(c.isspace() for c in name):
        raise ValueError(f"adapter name {name!r}: expected a non-empty id without spaces")
    if name == base:
        raise ValueError(f"adapter name {name!r} is the base model's id; give the adapter another name "
                         "(or the base model another one with --model-name)")
    return name


class ServedModels:
    """The base model's id ``name`` and the adapters' ids ``adapters`` (their folders by name, for
    the cards)."""

    def __init__(self, name: str, adapters: dict | None = None):
        self.name = name
        self.adapters = dict(adapters or {})
        for adapter in self.adapters:
            check_adapter_name(adapter, name)

    @property
    def ids(self) -> list:
        return [self.name, *self.adapters]

    def not_found(self, model_id: str) -> APIError:
        served = ", ".join(f"'{i}'" for i in self.ids)
        return APIError(404, f"The model '{model_id}' does not exist; this server serves {served}.",
                        param="model", code="model_not_found")

    def adapter(self, model_id: str | None) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for an id not served."""
        if model_id is None or model_id == self.name:
            return None
        if model_id in self.adapters:
            return model_id
        raise self.not_found(model_id)

    def model_id(self, adapter: str | None) -> str:
        """The id answers carry in their ``model`` field."""
        return self.name if adapter is None else adapter

    def cards(self, base_card: dict) -> list:
        """``/v1/models``' data: the base model's card, then each adapter's (the same fields, its own
        ``id``, and ``parent``: the base model's id)."""
        return [base_card] + [{**base_card, "id": adapter, "parent": self.name} for adapter in self.adapters]

    def card(self, model_id: str, base_card: dict) -> dict:
        for card in self.cards(base_card):
            if card["id"] == model_id:
                return card
        raise self.not_found(model_id)

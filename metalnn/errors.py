"""Exceptions raised by metalnn."""


class MetalnnError(Exception):
    """Base class of every error metalnn raises on purpose."""


class ShapeError(MetalnnError, ValueError):
    """A layer was given data whose dims or dtype differ from what it was built for.

    Attributes:
        layer: dotted path of the layer that raised (``"layers.2"``, ``"model.layers.0.self_attn"``).
        expected: what the layer needed (dims, shape or a description).
        given: what it received.
    """

    def __init__(self, layer, expected, given, detail=""):
        self.layer = layer
        self.expected = expected
        self.given = given
        msg = f"{layer}: expected {expected}, got {given}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class WeightLoadError(MetalnnError, KeyError):
    """Weights could not be loaded; nothing was changed.

    Attributes:
        missing: names the model needs that the provider lacks.
        unexpected: names the provider has that the model does not use.
        mismatched: ``{name: (expected, given)}`` for wrong shapes or dtypes.
    """

    def __init__(self, missing=(), unexpected=(), mismatched=None, source=None, message=None):
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = dict(mismatched or {})
        self.source = source
        if message is None:
            parts = []
            if self.missing:
                parts.append(f"{len(self.missing)} missing: {_short(self.missing)}")
            if self.unexpected:
                parts.append(f"{len(self.unexpected)} unexpected: {_short(self.unexpected)}")
            if self.mismatched:
                items = [f"{k} (expected {e}, got {g})" for k, (e, g) in sorted(self.mismatched.items())]
                parts.append(f"{len(items)} mismatched: {_short(items)}")
            where = f" from {source}" if source else ""
            message = f"could not load weights{where}; nothing was loaded. " + "; ".join(parts)
        self.message = message
        super().__init__(message)

    def __str__(self):
        return self.message


class UnsupportedConfigError(MetalnnError, ValueError):
    """A config (or checkpoint) asks for an architecture or feature metalnn does not implement; the
    message names the field."""


class TrainingDivergedError(MetalnnError, FloatingPointError):
    """The training loss became NaN or infinite."""

    def __init__(self, step, loss):
        self.step = step
        self.loss = loss
        super().__init__(f"loss became {loss} at step {step}; stopping. "
                         "Lower the learning rate, clip gradients, or resume from the last checkpoint.")


def _short(items, limit=12):
    items = list(items)
    text = ", ".join(items[:limit])
    if len(items) > limit:
        text += f", ... (+{len(items) - limit} more)"
    return text

"""``metalnn info MODEL``: architecture, size, weights format, context length, tokenizer."""

from __future__ import annotations

import json
from collections import Counter

from .common import add_model, load


def add_parser(commands):
    p = commands.add_parser("info", help="describe a model", description=(
        "Describe a model: architecture, layers, parameter count, dtype or quantization, context length, "
        "tokenizer and chat template."))
    add_model(p)
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    p.set_defaults(run=run)


def parameter_count(model) -> int:
    """Number of parameters, counting a quantized weight by its logical (unpacked) size and leaving
    out the quantization scales and biases."""
    from ..quantization import quantized_layers

    quantized = dict(quantized_layers(model))
    total = 0
    for name, array in model.named_parameters().items():
        owner, _, leaf = name.rpartition(".")
        layer = quantized.get(owner)
        if layer is None:
            total += array.size
        elif leaf == "weight" and hasattr(layer, "ggml_type"):   # GGML blocks: rows x values per row
            total += array.shape[0] * array.shape[-1] // layer.qtype.type_size * layer.qtype.block_size
        elif leaf == "weight":
            total += array.size * 32 // layer.bits
        elif leaf not in ("scales", "biases"):
            total += array.size
    return total


def describe(path) -> dict:
    """The facts `metalnn info` prints, as a dict."""
    import mlx.core as mx

    from ..llm.models import load_tokenizer
    from ..llm.models.base import dtype_name
    from ..quantization import config_of, eligible_layers, quantized_layers

    model, _ = load(path, tokenizer=False, quiet=True)
    quantized = dict(quantized_layers(model))
    floats = sorted({dtype_name(a.dtype) for name, a in model.named_parameters().items()
                     if mx.issubdtype(a.dtype, mx.floating)
                     and not (name.rpartition(".")[0] in quantized and name.endswith((".scales", ".biases")))})
    facts = {
        "model": str(path),
        "architecture": model.architecture,
        "features": list(model.features),
        "layers": model.num_layers,
        "parameters": parameter_count(model),
        "dtype": ", ".join(floats) or None,
        "quantization": None,
        "context_length": model.context_length,
        "vocab_size": model.vocab_size,
        "tokenizer": False,
        "chat_template": False,
        "eos_tokens": [],
    }
    q = config_of(model)
    if q is not None:
        layers = quantized_layers(model)
        ggml_types = Counter(m.ggml_type for _, m in layers if hasattr(m, "ggml_type"))
        affine = len(layers) - sum(ggml_types.values())
        facts["quantization"] = {"bits": q["bits"] if affine else None, "group_size": q["group_size"] if affine else None,
                                 "mode": q["mode"] if affine else None, "quantized_layers": len(layers),
                                 "float_layers": len(eligible_layers(model)), "ggml_types": dict(sorted(ggml_types.items()))}
    try:
        tok = load_tokenizer(path)
    except FileNotFoundError:
        return facts
    facts["tokenizer"] = True
    facts["chat_template"] = bool(tok.chat_template)
    facts["eos_tokens"] = [tok.tokenizer.id_to_token(i) or str(i) for i in sorted(tok.eos_token_ids)]
    return facts


def format_facts(facts: dict) -> str:
    q = facts["quantization"]
    if q is None:
        weights = facts["dtype"] or "no float parameters"
    else:
        kinds = [f"{q['bits']}-bit {q['mode']}, group size {q['group_size']}"] if q["bits"] else []
        kinds += [f"GGML {', '.join(f'{t} x{n}' for t, n in q['ggml_types'].items())}"] if q["ggml_types"] else []
        weights = ("; ".join(kinds) + f" ({q['quantized_layers']} layers"
                   + (f"; {q['float_layers']} kept in float" if q["float_layers"] else "") + ")"
                   + (f"; other parameters {facts['dtype']}" if facts["dtype"] else ""))
    rows = [
        ("model", facts["model"]),
        ("architecture", facts["architecture"]),
        *([("features", "; ".join(facts["features"]))] if facts.get("features") else []),
        ("layers", facts["layers"]),
        ("parameters", f"{facts['parameters'] / 1e6:,.1f} M ({facts['parameters']:,})"),
        ("weights", weights),
        ("context length", facts["context_length"] or "not limited by the config"),
        ("vocabulary", f"{facts['vocab_size']:,} tokens"),
        ("tokenizer", ("yes, ends at " + ", ".join(facts["eos_tokens"])) if facts["eos_tokens"]
         else ("yes" if facts["tokenizer"] else "no")),
        ("chat template", "yes" if facts["chat_template"] else "no"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run(args):
    facts = describe(args.model)
    print(json.dumps(facts, indent=2) if args.json else format_facts(facts))

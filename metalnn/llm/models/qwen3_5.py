"""Qwen3.5 text model (`Qwen3_5ForCausalLM`): the Qwen3-Next hybrid (Gated DeltaNet and gated full
attention, zero-centred RMSNorms) with dense SwiGLU feed-forward blocks and Qwen3.5's separate
linear-attention input projections (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).

It reads a ``qwen3_5_text`` config, or the ``text_config`` of a ``qwen3_5`` folder
(``Qwen3_5ForConditionalGeneration``): the language model's tensors
(``model.language_model.*``) load as ``model.*``; the vision tower (``model.visual.*``) and the
multi-token-prediction tensors (``mtp.*``) are not used. `save_pretrained` writes a text-only
``Qwen3_5ForCausalLM`` folder.
"""

from __future__ import annotations

from .qwen3_next import Qwen3NextForCausalLM

_LANGUAGE_MODEL = "model.language_model."


def text_config(config: dict) -> dict:
    """The text model's config: ``config["text_config"]`` for a multimodal ``qwen3_5`` config
    (with the top level's ``tie_word_embeddings``, which decides the tying there, as in
    transformers), else ``config``."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return dict(config)
    out = dict(text)
    if "tie_word_embeddings" in config:
        out["tie_word_embeddings"] = config["tie_word_embeddings"]
    out.pop("architectures", None)
    return out


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (dense text model) built from a Hugging Face ``Qwen3_5TextConfig`` dict, or from a
    ``Qwen3_5Config`` whose ``text_config`` holds it.

    Config keys: those of `Qwen3NextForCausalLM` except the mixture-of-experts ones; every
    feed-forward block is a `SwiGLU` of ``intermediate_size``.
    """

    architecture = "Qwen3_5ForCausalLM"
    model_type = "qwen3_5_text"
    gguf_architecture = "qwen35"
    separate_projections = True

    def __init__(self, config: dict, seed: int = 0):
        super().__init__(text_config(config), seed=seed)

    def is_sparse(self, layer: int) -> bool:
        return False

    def rename_weight(self, name):
        if name.startswith(_LANGUAGE_MODEL):
            name = "model." + name[len(_LANGUAGE_MODEL):]
        elif name.startswith(("model.visual.", "visual.")):
            return None
        return super().rename_weight(name)

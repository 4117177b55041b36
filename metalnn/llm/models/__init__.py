"""Pretrained language models: build from a Hugging Face folder, run, generate, save back.

>>> model = metalnn.llm.models.load_pretrained("path/to/folder")      # config.json + *.safetensors
>>> logits = model(mx.array([[1, 2, 3]]))                           # [1, 3, vocab]
>>> new = metalnn.generate(model, [1, 2, 3], max_new_tokens=20)     # greedy
>>> model.save_pretrained("out/")                                   # transformers can load it

One architecture a module (``llama``, ``gpt2``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``mistral``, ``mixtral``,
``qwen3_next``, ``qwen3_5``, ``qwen3_5_moe``, ``phi3``, ``gemma2``, ``gemma3``, ``smollm3``, ``deepseek_v3``, ``lfm2``, ``gpt_oss``, ``granitemoehybrid``, ``nemotron_h``), each a typed ``ModelArgs`` dataclass and a `CausalLM`
subclass built from shared blocks (`metalnn.layers`, `decoder`, `hybrid`, `rope`, `experts`) that registers itself
in `ARCHITECTURES` (`registry`: keyed by Hugging Face architecture, ``model_type`` and GGUF architecture). Checkpoints:
Hugging Face folders (float or MLX-quantized), GGUF files (`metalnn.llm.gguf`) and Hub names
(``"org/name"``); see `loading`.

Supported architectures: ``LlamaForCausalLM``, ``GPT2LMHeadModel``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, ``MistralForCausalLM``, ``Phi3ForCausalLM``, ``Qwen3NextForCausalLM``,
``Qwen3_5ForCausalLM`` (also the text model of a ``Qwen3_5ForConditionalGeneration`` folder),
``Qwen3_5MoeForCausalLM`` (also the text model of a ``Qwen3_5MoeForConditionalGeneration`` folder),
``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``, ``SmolLM3ForCausalLM``, ``MixtralForCausalLM``,
``DeepseekV3ForCausalLM``, ``Lfm2ForCausalLM``, ``GptOssForCausalLM``,
``GraniteMoeHybridForCausalLM`` and ``NemotronHForCausalLM``.
"""

from __future__ import annotations

from ...errors import UnsupportedConfigError
from .. import gguf
from ..tokenizer import Tokenizer, char_tokenizer, load_tokenizer
from .base import BaseModelArgs, CausalLM
from .deepseek_v3 import DeepseekV3ForCausalLM
from .gemma2 import Gemma2ForCausalLM
from .gemma3 import Gemma3ForCausalLM
from .gpt2 import GPT2LMHeadModel
from .gpt_oss import GptOssForCausalLM
from .granitemoehybrid import GraniteMoeHybridForCausalLM
from .lfm2 import Lfm2ForCausalLM
from .llama import LlamaForCausalLM, llama_config
from .loading import from_config, load_pretrained, read_config, read_gguf
from .mistral import MistralForCausalLM
from .mixtral import MixtralForCausalLM
from .nemotron_h import NemotronHForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_5 import Qwen3_5ForCausalLM
from .qwen3_5_moe import Qwen3_5MoeForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM
from .qwen3_next import Qwen3NextForCausalLM
from .registry import ARCHITECTURES, model_class, register
from .smollm3 import SmolLM3ForCausalLM

__all__ = ["ARCHITECTURES", "BaseModelArgs", "CausalLM", "DeepseekV3ForCausalLM", "Gemma2ForCausalLM",
           "Gemma3ForCausalLM", "GPT2LMHeadModel", "GptOssForCausalLM", "GraniteMoeHybridForCausalLM", "Lfm2ForCausalLM",
           "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "NemotronHForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3_5ForCausalLM",
           "Qwen3_5MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM",
           "SmolLM3ForCausalLM", "Tokenizer", "UnsupportedConfigError", "char_tokenizer", "from_config", "gguf",
           "llama_config", "load_pretrained", "load_tokenizer", "model_class", "read_config", "read_gguf",
           "register"]

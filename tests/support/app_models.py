"""A tiny chat model for the command, server and page tests: a 2-layer Llama with random weights, a
character tokenizer (plus ChatML's two special tokens) and a ChatML chat template, saved as a
Hugging Face folder. It answers gibberish, quickly and reproducibly."""

from __future__ import annotations

import string

import metalnn as mn
from metalnn.llm.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHARACTERS = string.ascii_letters + string.digits + string.punctuation + " \n"


def tiny_tokenizer(chat_template: str | None = CHATML) -> Tokenizer:
    chars = mn.models.char_tokenizer(CHARACTERS)
    chars.tokenizer.add_special_tokens(["<unk>", "<|im_start|>", "<|im_end|>"])  # <unk> exists: now not shown
    eos = chars.tokenizer.token_to_id("<|im_end|>")
    return Tokenizer(chars.tokenizer, eos_token_id=eos, chat_template=chat_template,
                     special_tokens={"eos_token": "<|im_end|>"})


def save_tiny_model(folder, *, chat_template: str | None = CHATML, seed: int = 0, context: int = 4096,
                    hidden_size: int = 64, num_hidden_layers: int = 2):
    """Write the tiny model to ``folder`` (config.json, model.safetensors, tokenizer files)."""
    tok = tiny_tokenizer(chat_template)
    config = mn.models.llama_config(tok.vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                                    num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * hidden_size,
                                    max_position_embeddings=context)
    model = mn.models.from_config(config, seed=seed)
    model.save_pretrained(folder)
    tok.save(folder)
    return folder

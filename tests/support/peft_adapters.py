"""LoRA adapters made and run by PEFT on transformers: the reference for the adapter tests.

`save_peft_adapter` writes a PEFT folder for a Hugging Face checkpoint, its ``lora_B`` drawn at random
(PEFT initialises B to zeros, which would make the adapter a no-op); `peft_logits` and `peft_greedy`
run the checkpoint with it through PEFT (or without, ``adapter=None``).
"""

from __future__ import annotations

import numpy as np
import peft
import torch
import transformers

transformers.logging.set_verbosity_error()


def save_peft_adapter(model_folder, out, *, targets=("q_proj", "v_proj"), r=4, alpha=8, seed=0, std=0.1):
    """Write a PEFT LoRA adapter for ``model_folder`` into ``out``; returns ``out``."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_folder, torch_dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                      lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    model.eval().save_pretrained(out)
    return out


def _model(model_folder, adapter):
    base = transformers.AutoModelForCausalLM.from_pretrained(model_folder, torch_dtype=torch.float32).eval()
    return base if adapter is None else peft.PeftModel.from_pretrained(base, adapter).eval()


def peft_logits(model_folder, adapter, tokens) -> np.ndarray:
    """Logits ``[B, T, vocab]`` of ``tokens`` ``[B, T]``."""
    with torch.no_grad():
        return _model(model_folder, adapter)(torch.tensor(np.asarray(tokens))).logits.numpy()


def peft_greedy(model_folder, adapter, prompt, max_new_tokens: int, eos=None) -> list:
    """Greedy new tokens after ``prompt`` (ending after the first token in ``eos``)."""
    model = _model(model_folder, adapter)
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    for i, t in enumerate(new):
        if eos is not None and t in eos:
            return new[:i + 1]
    return new

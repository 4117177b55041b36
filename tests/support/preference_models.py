"""The preference-training tests' model, data and oracle: a tiny random transformers Llama saved with a
character tokenizer that adds a BOS (so TRL's BOS handling shows) and a ChatML template; small
preference sets, standard and conversational; and `trl_steps`, which runs TRL 1.13's DPOTrainer,
ORPOTrainer or KTOTrainer on the same folder and data (full fine-tuning, SGD, a sequential sampler,
float32 on the CPU) and returns the loss and the metrics it logs at each step."""

from __future__ import annotations

import json

import torch
import transformers

from metalnn.llm.tokenizer import Tokenizer

from app_models import CHATML, tiny_tokenizer
from hf_models import hf_model

transformers.logging.set_verbosity_error()


def bos_tokenizer() -> Tokenizer:
    """The character tokenizer of `tests.support.app_models` plus ``<s>``, put before every
    encoded text (a post-processor, as Llama's tokenizers do)."""
    from tokenizers.processors import TemplateProcessing

    tok = tiny_tokenizer().tokenizer
    tok.add_special_tokens(["<s>"])
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("<|im_end|>")
    tok.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)])
    return Tokenizer(tok, eos_token_id=eos, bos_token_id=bos, chat_template=CHATML,
                     special_tokens={"eos_token": "<|im_end|>", "bos_token": "<s>"})


def save_preference_model(folder, seed=0, hidden_size=32):
    """A 2-layer Llama (random, gains perturbed) with `bos_tokenizer`, saved to ``folder``."""
    tok = bos_tokenizer()
    hf = hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, seed=seed, vocab_size=tok.vocab_size,
                  hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    hf.save_pretrained(folder)
    tok.save(folder)
    return folder


STANDARD_PAIRS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green, or so I heard."},
    {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5!"},
    {"prompt": "Say hi:", "chosen": " hi there", "rejected": " no."},
    {"prompt": "Capital of France?", "chosen": " Paris.", "rejected": " Rome, I think"},
    {"prompt": "Opposite of up:", "chosen": " down", "rejected": " sideways"},
    {"prompt": "Water is", "chosen": " wet.", "rejected": " dry"},
]


def conversational(pairs):
    return [{"prompt": [{"role": "user", "content": p["prompt"].strip()}],
             "chosen": [{"role": "assistant", "content": p["chosen"].strip()}],
             "rejected": [{"role": "assistant", "content": p["rejected"].strip()}]} for p in pairs]


def unpaired(pairs):
    """KTO records: chosen completions desirable, rejected ones not, interleaved unevenly."""
    out = []
    for i, p in enumerate(pairs):
        out.append({"prompt": p["prompt"], "completion": p["chosen"], "label": True})
        if i % 2 == 0:
            out.append({"prompt": p["prompt"], "completion": p["rejected"], "label": False})
    return out


def unpaired_conversational(pairs):
    return [{"prompt": [{"role": "user", "content": r["prompt"].strip()}],
             "completion": [{"role": "assistant", "content": r["completion"].strip()}], "label": r["label"]}
            for r in unpaired(pairs)]


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def trl_steps(method, folder, records, out_dir, steps=3, batch_size=2, lr=0.5, **settings):
    """Run TRL's trainer of ``method`` for ``steps`` steps; returns one dict per step: ``loss`` (the
    exact value, before the Trainer's rounding of logged losses) and TRL's logged metrics."""
    from datasets import Dataset

    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny matrices: threads only contend on a busy machine
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.pad_token = tok.eos_token
    common = dict(output_dir=str(out_dir), per_device_train_batch_size=batch_size, max_steps=steps, learning_rate=lr,
                  optim="sgd", lr_scheduler_type="linear", warmup_steps=0, logging_steps=1, report_to="none",
                  use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, save_strategy="no",
                  train_sampling_strategy="sequential", dataloader_drop_last=False, seed=0, **settings)
    if method == "dpo":
        from trl import DPOConfig as Config, DPOTrainer as Base
    elif method == "kto":
        from trl import KTOConfig as Config, KTOTrainer as Base
    else:
        from trl.experimental.orpo import ORPOConfig as Config, ORPOTrainer as Base
    losses = []

    class Recording(Base):
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    trainer = Recording(model=model, args=Config(**common), train_dataset=Dataset.from_list(records),
                        processing_class=tok)
    trainer.train()
    logs = [dict(h) for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == steps == len(losses)
    for log, loss in zip(logs, losses):
        log["loss"] = loss
        for k in ("grad_norm", "learning_rate", "epoch", "step"):
            log.pop(k, None)
    return logs

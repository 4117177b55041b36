"""Fine-tuning language models: `lora` (LoRA / QLoRA adapters in PEFT's format) and `datasets`
(chat and completion data, tokenised and masked as transformers does)."""

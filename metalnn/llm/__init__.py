"""The language-model stack: checkpoints (`models`, `gguf`, `hub`, `tokenizer`, `chat_template`),
text generation (`generation`, `text_generation`, `chat`), fine-tuning (`tuner`) and serving
(`server`). Only `metalnn.llm` itself and `metalnn.cli` import it; the core packages never do."""

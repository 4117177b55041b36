"""GGUF checkpoints: the file `reader`, the `tokenizer` stored in the metadata, and `convert`
(GGUF tensor names and transforms back to the Hugging Face layout the models read)."""

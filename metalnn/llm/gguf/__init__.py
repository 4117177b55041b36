"""GGUF checkpoints: the file `reader`, the `tokenizer` stored in the metadata, `convert` (the generic
reading of a file as a Hugging Face style checkpoint) and `converters` (one class per llama.cpp
architecture: its tensor names and the transforms undone)."""

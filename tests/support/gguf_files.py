"""Tiny GGUF files for the tests, written with the ``gguf`` package the way llama.cpp's converter
writes them: tensor names from gguf-py's own name table, the Llama Q/K row permutation, tensors
quantized with ``gguf.quants``, and tokenizer metadata.

Vocabularies are trained here with the ``tokenizers`` library on a few lines of the King James
text in examples/data (no downloads).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from gguf_writing import finish

TEXT = (Path(__file__).resolve().parents[2] / "examples" / "data" / "kjv_genesis_exodus.txt").read_text()[:20000]
SAMPLES = ["In the beginning God created the heaven and the earth.", "  leading spaces and  double  spaces\n\nnew lines",
           "Numbers 12345 and 3.14, punctuation!? (brackets) [x] {y}", "unicode: é ü 日本語 🙂 — done",
           "<|im_start|>user\nHello<|im_end|>\n", "tabs\tand\r\ncarriage returns", ""]
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a test.<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_vocab(size=400):
    """(tokens in id order, merges "a b") of a byte-level BPE trained on `TEXT`; specials first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, merges


def sentencepiece_vocab(size=300):
    """(tokens, scores, types) of a SentencePiece-style BPE vocabulary: <unk>, <s>, </s>, the 256
    byte tokens, then pieces trained on `TEXT` with ``▁`` for spaces (scores: earlier is better)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=size, show_progress=False))
    vocab = tok.get_vocab()
    pieces = sorted(vocab, key=vocab.get)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


def hf_model(arch="llama", vocab=400, tie=False, seed=0):
    """A tiny random transformers model of ``arch`` (llama, qwen2, qwen3)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=tie, initializer_range=0.1, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    # transformers reads no head_dim from Qwen3 GGUF files and uses Qwen3Config's default, 128
    extra = {"head_dim": 128} if arch == "qwen3" else {}
    model = cls[1](cls[0](**common, **extra)).eval()
    with torch.no_grad():  # biases and norm weights away from their 0 / 1 initial values
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def permute(w, n_head):
    """llama.cpp's Q/K row order (its converter's ``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


#: GGUF tensor kind -> type used for it in the test files; every type metalnn reads occurs
TYPES = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q4_1, "attn_q.weight": Q.Q4_0, "attn_k.weight": Q.Q4_1,
         "attn_v.weight": Q.Q8_0, "attn_output.weight": Q.F16, "ffn_gate.weight": Q.Q8_0, "ffn_up.weight": Q.BF16,
         "ffn_down.weight": Q.Q4_0}


def _type_for(name, types):
    return types.get(".".join(name.split(".")[-2:]), Q.F32)  # "blk.0.attn_q.weight" -> "attn_q.weight"


def write(path, model=None, *, arch="llama", tokenizer="gpt2", pre="default", types=None, add_bos=None,
          chat_template=CHATML, extra_tensors=None, metadata=None, skip=()):
    """Write ``model`` (a transformers model, or None for a tokenizer-only file) as a GGUF file; GGUF
    tensor names in ``skip`` are left out of the model's (``extra_tensors`` then gives them)."""
    path = Path(path)
    types = TYPES if types is None else types
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("metalnn test model")
    if model is not None:
        c = model.config
        w.add_block_count(c.num_hidden_layers)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_rope_freq_base(float((getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        w.add_rope_dimension_count(head_dim)
        if arch == "qwen3":
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
    if tokenizer == "gpt2":
        tokens, merges = byte_level_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_unk_token_id(tokens.index("<|endoftext|>"))
        w.add_pad_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(bool(add_bos))
    elif tokenizer == "llama":
        tokens, scores, ttypes = sentencepiece_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(ttypes)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        if add_bos is not None:
            w.add_add_bos_token(add_bos)
    if chat_template is not None and tokenizer is not None:
        w.add_chat_template(chat_template)
    for key, value in (metadata or {}).items():
        w.add_key_value(key, value[0], value[1])
    if model is not None:
        arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
        names = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
        c = model.config
        for hf_name, p in model.state_dict().items():
            if c.tie_word_embeddings and hf_name == "lm_head.weight":
                continue
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            assert name is not None, hf_name
            if name in skip:
                continue
            a = p.detach().numpy().astype(np.float32)
            if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
                a = permute(a, c.num_attention_heads if ".q_proj." in hf_name else c.num_key_value_heads)
            _add(w, name, a, _type_for(name, types) if a.ndim == 2 else Q.F32)
        for name, (a, t) in (extra_tensors or {}).items():
            _add(w, name, a, t)
    return finish(w, path)


def _add(writer, name, a, qtype):
    if qtype == Q.F32:
        writer.add_tensor(name, a.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, a.astype(np.float16))
    elif a.dtype == np.uint8:  # raw blocks given by the caller
        writer.add_tensor(name, a, raw_shape=a.shape, raw_dtype=qtype)
    else:
        q = gguf.quants.quantize(a, qtype)
        writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

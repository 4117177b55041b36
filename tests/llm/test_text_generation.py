"""`metalnn.llm.text_generation.TextStream` and `metalnn.llm.chat.ChatSession`.

A scripted model (it always predicts the next token of a fixed script) makes the token sequence
known in advance, so the text a stream produces can be checked against plain string operations on
the tokenizer's decoding of that script. A byte-level tokenizer with no merges splits every
non-ASCII character over several tokens.
"""

import threading

import mlx.core as mx
import pytest
import tokenizers

from metalnn.llm.chat import ChatSession
from metalnn.llm.text_generation import CANCELLED, LENGTH, STOP, TextStream
from metalnn.llm.tokenizer import Tokenizer

from app_models import CHATML

TEXT = "Grüße, wörld: ✓ 日本 done. Stop here STOP then more"


class ScriptedModel:
    """Predicts ``script[k]`` as the k-th new token (greedy decoding follows the script); records the
    prompts it was given."""

    eos_token_ids = frozenset()

    def __init__(self, script, vocab):
        self.script, self.vocab, self.prompts = list(script), vocab, []

    def make_cache(self):
        return [{"seen": 0, "prompt": None}]

    def __call__(self, tokens, *, cache, device=None):
        state = cache[0]
        if state["prompt"] is None:
            state["prompt"] = tokens.shape[1] + 1  # the prefill leaves out the last prompt token
            self.prompts.append(tokens.tolist()[0])
        state["seen"] += tokens.shape[1]
        k = state["seen"] - state["prompt"]
        nxt = self.script[min(k, len(self.script) - 1)]
        logits = mx.zeros((tokens.shape[0], tokens.shape[1], self.vocab))
        return logits + mx.array([float(i == nxt) for i in range(self.vocab)])


def byte_tokenizer():
    """Byte-level BPE with the 256 byte symbols and no merges, plus an end-of-sequence token."""
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return Tokenizer(tok, eos_token_id=tok.token_to_id("<eos>"))


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def stream(tok, script, max_tokens=None, **kw):
    model = ScriptedModel(script, tok.vocab_size)
    return TextStream(model, tok, tok.encode("hi"), max_tokens or len(script), **kw)


def test_pieces_are_whole_characters_and_add_up_to_the_decoded_text(tok):
    script = tok.encode(TEXT)
    assert len(script) > len(TEXT)  # several characters take more than one token
    s = stream(tok, script)
    pieces = list(s)
    assert "".join(pieces) == s.text == tok.decode(script) == TEXT
    assert all(p and "\ufffd" not in p for p in pieces)
    assert s.finish_reason == LENGTH and s.completion_tokens == len(script) and s.prompt_tokens == 2


@pytest.mark.parametrize("stops", [["STOP"], ["日本"], ["wörld", "STOP"], ["Stop here STOP then more"], ["ü"]])
def test_stop_strings_cut_the_text_before_the_first_one(tok, stops):
    s = stream(tok, tok.encode(TEXT), stop=stops)
    text = "".join(s)
    first = min(TEXT.find(x) for x in stops)
    assert text == TEXT[:first]
    assert s.finish_reason == STOP
    # generation stopped at the token that completed a stop string (one token per byte here)
    end = min(TEXT.find(x) + len(x) for x in stops)
    assert s.completion_tokens == len(TEXT[:end].encode())


def test_text_that_only_begins_a_stop_string_is_shown_in_the_end(tok):
    # "Stop here" and "STOP the" begin the stop strings but never complete them
    s = stream(tok, tok.encode(TEXT), stop=["Stop here!", "STOP them"])
    assert "".join(s) == TEXT and s.finish_reason == LENGTH


def test_held_back_text_waits_for_the_next_piece(tok):
    s = stream(tok, tok.encode("abcXYd"), stop=["XYZ"])
    assert list(s) == ["a", "b", "c", "XYd"]


def test_end_of_sequence_ends_the_text(tok):
    script = tok.encode("Hello") + [tok.eos_token_id] + tok.encode("never shown")
    s = stream(tok, script)
    assert "".join(s) == "Hello"
    assert s.finish_reason == STOP and s.tokens == script[:6]


def test_max_tokens_ends_the_text(tok):
    s = stream(tok, tok.encode(TEXT), max_tokens=6)
    assert "".join(s) == "Grüß" and s.finish_reason == LENGTH and s.completion_tokens == 6
    # 5 tokens end inside "ß" (2 bytes): the half character is not shown
    s = stream(tok, tok.encode(TEXT), max_tokens=5)
    assert "".join(s) == "Grü" and s.completion_tokens == 5


def test_cancel_from_another_thread_and_close(tok):
    finished = []
    s = stream(tok, tok.encode(TEXT), on_finish=finished.append)
    assert next(s) == "G"
    threading.Thread(target=s.cancel).start()
    rest = list(s)
    assert len(rest) <= 1  # at most the piece already decoded when the flag was seen
    assert s.finish_reason == CANCELLED and finished == [s]

    s = stream(tok, tok.encode(TEXT), on_finish=finished.append)
    next(s), next(s)
    s.close()
    assert s.text == "Gr" and s.finish_reason == CANCELLED and finished == [finished[0], s]
    assert list(s) == []


def test_speeds_are_reported(tok):
    s = stream(tok, tok.encode(TEXT))
    list(s)
    assert s.prompt_seconds > 0 and s.generation_seconds > 0
    assert s.prompt_tps == pytest.approx(2 / s.prompt_seconds)
    assert s.generation_tps == pytest.approx((s.completion_tokens - 1) / s.generation_seconds)


def test_bad_arguments(tok):
    model = ScriptedModel([0], tok.vocab_size)
    with pytest.raises(ValueError, match="prompt is empty"):
        TextStream(model, tok, [], 5)
    with pytest.raises(ValueError, match="max_tokens"):
        TextStream(model, tok, [1], 0)


def test_chat_session_keeps_the_conversation(tok):
    chat_tok = Tokenizer(tok.tokenizer, eos_token_id=tok.eos_token_id, chat_template=CHATML)
    model = ScriptedModel(tok.encode("Answer.") + [tok.eos_token_id], tok.vocab_size)
    session = ChatSession(model, chat_tok, system="Be brief.", max_tokens=50)
    assert "".join(session.ask("First?")) == "Answer."
    assert "".join(session.ask("Second?")) == "Answer."
    assert session.history == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "First?"},
        {"role": "assistant", "content": "Answer."}, {"role": "user", "content": "Second?"},
        {"role": "assistant", "content": "Answer."}]
    # each turn's prompt is the chat template of the whole conversation so far
    assert model.prompts[1] == chat_tok.apply_chat_template(session.history[:4])[:-1]
    stopped = session.ask("Third?", max_tokens=3)
    assert "".join(stopped) == "Ans" and session.history[-1] == {"role": "assistant", "content": "Ans"}
    session.reset()
    assert session.history == [{"role": "system", "content": "Be brief."}]
    with pytest.raises(ValueError, match="no chat template"):
        ChatSession(model, tok)

"""`metalnn.llm.chat.ChatSession` within the model's context length: the oldest turns go first, the
system message stays, an answer gets the room left, a message too long on its own is refused.

The model is the tiny character-level chat model (tests/support/app_models.py) with a 64-token
context: one character is one token, so the prompts' lengths are easy to reason about. The expected
prompts are rendered here with the tokenizer's chat template from the messages that should remain.
"""

import pytest

import metalnn as mn
from metalnn.llm.chat import ChatSession, ContextFull

from app_models import save_tiny_model

CONTEXT = 64


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", context=CONTEXT)
    return mn.models.load_pretrained(folder), mn.models.load_tokenizer(folder)


def test_the_oldest_turns_are_dropped_and_the_system_message_stays(local):
    model, tok = local
    assert model.context_length == CONTEXT
    system = {"role": "system", "content": "Be brief."}
    session = ChatSession(model, tok, system="Be brief.", max_tokens=10, temperature=0.0)
    first = session.ask("Hello")
    "".join(first)
    assert session.dropped == 0 and first.max_tokens == 10
    second = session.ask("Again")
    # system (19 tokens) + two user turns (13 each) + an answer + two generation prompts: past 64 - 10
    assert session.dropped == 2
    assert second.prompt == tok.apply_chat_template([system, {"role": "user", "content": "Again"}])
    "".join(second)
    assert session.history[0] == system and [m["content"] for m in session.history[1:2]] == ["Again"]
    assert len(second.prompt) + second.max_tokens <= CONTEXT


def test_an_answer_gets_the_room_left_and_a_message_too_long_is_refused(local):
    model, tok = local
    session = ChatSession(model, tok, system="Be brief.", max_tokens=10, temperature=0.0)
    "".join(session.ask("Hi"))
    before = list(session.history)
    text = "x" * 20  # 19 (system) + 8 + 20 (user) + 11 (generation prompt) = 58: room for 6
    stream = session.ask(text)
    want = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}])
    assert len(want) == 58 and stream.prompt == want and stream.max_tokens == CONTEXT - 58
    "".join(stream)
    assert stream.completion_tokens <= 6
    kept = list(session.history)
    with pytest.raises(ContextFull, match=r"takes 84 tokens, and the model's context length is 64") as full:
        session.ask("y" * 46)
    assert (full.value.prompt_tokens, full.value.context_length) == (84, 64)
    assert session.history == kept  # nothing dropped by the refused message
    assert before[0] == kept[0]


def test_a_model_without_a_context_length_is_not_limited(local):
    model, tok = local

    class Unlimited:
        """The model, stating no context length."""
        eos_token_ids = model.eos_token_ids
        context_length = None

        def make_cache(self):
            return model.make_cache()

        def __call__(self, tokens, **kw):
            return model(tokens, **kw)

    session = ChatSession(Unlimited(), tok, max_tokens=100, temperature=0.0)
    stream = session.ask("z" * 80)
    assert stream.max_tokens == 100 and session.dropped == 0
    stream.close()

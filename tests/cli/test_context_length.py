"""``metalnn generate``, ``chat`` and ``bench`` stay within the model's context length.

The tiny character-level chat model (tests/support/app_models.py) is saved with a 64-token context
(one character, one token). What the commands print is compared with `TextStream` run in this
process on the prompts that should remain (rendered here with the chat template; greedy decoding).
"""

import re

import pytest

import metalnn as mn
from metalnn.llm.text_generation import TextStream

from app_models import save_tiny_model
from commands import assert_one_line_error, metalnn_cmd

CONTEXT = 64




@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny", context=CONTEXT)


@pytest.fixture(scope="module")
def local(tiny):
    return mn.models.load_pretrained(tiny), mn.models.load_tokenizer(tiny)


def greedy(local, ids, max_tokens):
    model, tok = local
    stream = TextStream(model, tok, ids, max_tokens, temperature=0.0)
    return "".join(stream), stream


def test_generate_refuses_a_prompt_that_fills_the_context(tiny):
    result = metalnn_cmd("generate", tiny, "--prompt", "x" * CONTEXT)
    assert_one_line_error(result, f"the prompt has {CONTEXT} tokens", f"context length is {CONTEXT} tokens")
    assert result.stdout == ""


def test_generate_lowers_max_tokens_to_the_room_left(tiny, local):
    _, tok = local
    prompt = "Once upon a time, in a land far away, there"  # 43 tokens: room for 21
    ids = tok.encode(prompt)
    assert len(ids) == 43
    want, ref = greedy(local, ids, CONTEXT - 43)
    result = metalnn_cmd("generate", tiny, "--prompt", prompt, "--max-tokens", "100", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout == want + "\n"
    assert "[--max-tokens 100 lowered to 21: the prompt has 43 tokens and the model's context length is 64]" in \
        result.stderr
    assert re.search(rf"generation: {ref.completion_tokens} tokens", result.stderr), result.stderr
    # within the room: no note
    fits = metalnn_cmd("generate", tiny, "--prompt", prompt, "--max-tokens", "21", "--temperature", "0")
    assert fits.stdout == result.stdout and "lowered" not in fits.stderr


def test_chat_drops_the_oldest_turns_and_refuses_a_message_too_long(tiny, local):
    _, tok = local
    system = {"role": "system", "content": "Be brief."}
    hello = {"role": "user", "content": "Hello"}
    a1, _ = greedy(local, tok.apply_chat_template([system, hello]), 10)
    again = {"role": "user", "content": "Again"}
    # the first turn no longer fits beside the second: only the system message and "Again" remain
    assert len(tok.apply_chat_template([system, hello, {"role": "assistant", "content": a1}, again])) + 10 > CONTEXT
    a2, _ = greedy(local, tok.apply_chat_template([system, again]), 10)
    long = "x" * 20  # 58 tokens with the system message and the template: room for 6
    a3, _ = greedy(local, tok.apply_chat_template([system, {"role": "user", "content": long}]), 6)
    result = metalnn_cmd("chat", tiny, "--system", "Be brief.", "--max-tokens", "10", "--temperature", "0",
                         input=f"Hello\nAgain\n{'y' * 60}\n{long}\n/exit\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "> " + a1 + "\n> " + a2 + "\n> > " + a3 + "\n> "
    assert "[the 2 oldest messages dropped to fit the model's context length of 64 tokens]" in result.stderr
    assert "[not sent: the message is too long: with the system message and the chat template it takes 98 tokens, " \
           "and the model's context length is 64 tokens]" in result.stderr
    assert "[this answer has room for 6 tokens in the context length of 64]" in result.stderr
    assert "Traceback" not in result.stderr


def test_bench_refuses_more_positions_than_the_context(tiny):
    result = metalnn_cmd("bench", tiny, "--prompt-tokens", "60", "--gen-tokens", "8", "--runs", "1")
    assert_one_line_error(result, "--prompt-tokens 60 and --gen-tokens 8 make 68 positions",
                          "context length is 64 tokens")
    fits = metalnn_cmd("bench", tiny, "--prompt-tokens", "56", "--gen-tokens", "8", "--runs", "1")
    assert fits.returncode == 0, fits.stderr


def test_the_help_says_what_happens_at_the_context_length():
    assert "context length" in " ".join(metalnn_cmd("generate", "--help").stdout.split())
    assert "oldest turns are dropped" in " ".join(metalnn_cmd("chat", "--help").stdout.split())
    assert "context length" in " ".join(metalnn_cmd("bench", "--help").stdout.split())

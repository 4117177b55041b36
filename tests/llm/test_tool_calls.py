"""Tool calls: the parsers (`metalnn.llm.tool_calls`) on hand-written answers in each format,
streamed in arbitrary pieces, and conversations with tools through chat templates
(`metalnn.llm.tool_prompt`) against transformers' own ``apply_chat_template`` with the same
template, plus the generic fallback for templates without tools. The forced-call grammars are
sampled at random and every call validated with ``jsonschema`` against its tool's parameters.
"""

import json
import re

import jsonschema
import numpy as np
import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import metalnn as mn
from metalnn.llm.constrained import GrammarConstraint
from metalnn.llm.tool_calls import (HERMES, LLAMA3, ToolCallParser, parse_tool_calls, tool_call_grammar,
                                    tool_format)
from metalnn.llm.tool_prompt import (calls_as_text, describe_tools, output_format, render_conversation,
                                     tool_support)

from app_models import CHATML, tiny_tokenizer
from bundled_model import smollm2_file
from tool_templates import LLAMA31, QWEN25

transformers.logging.set_verbosity_error()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now, anywhere"}}
TOOLS = [WEATHER, TIME]

# (answer, format, expected content, expected calls as (name, arguments dict))
ANSWERS = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>', HERMES,
     None, [("get_weather", {"city": "Paris", "days": 2})]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n', HERMES,
     "Let me look.", [("get_weather", {"city": "Lima", "days": 1}), ("get_time", {})]),
    # arguments written as a JSON string, "parameters" instead of "arguments", an unclosed last call
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Tokyo\\", \\"days\\": 3}"}</tool_call>', HERMES,
     None, [("get_weather", {"city": "Tokyo", "days": 3})]),
    ('<tool_call>\n{"name": "get_time", "parameters": {"zone": "UTC"}}', HERMES, None, [("get_time", {"zone": "UTC"})]),
    # not calls: stays text, exactly
    ("The weather is fine <toolbox> and 21 °C.\n", HERMES, "The weather is fine <toolbox> and 21 °C.\n", []),
    ("<tool_call>not json</tool_call> sorry", HERMES, "<tool_call>not json</tool_call> sorry", []),
    ('<tool_call>{"city": "Paris"}</tool_call>', HERMES, '<tool_call>{"city": "Paris"}</tool_call>', []),
    # Llama 3.1 JSON, after <|python_tag|> or not, several separated by ";"
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 5}}', LLAMA3,
     None, [("get_weather", {"city": "Paris", "days": 5})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
     '{"city": "Lima", "days": 7}}', LLAMA3, None, [("get_time", {}), ("get_weather", {"city": "Lima", "days": 7})]),
    ("It is sunny in Paris.", LLAMA3, "It is sunny in Paris.", []),
    ('{"answer": 42}', LLAMA3, '{"answer": 42}', []),
    ('{"name": "get_time", "parameters": {}} and more', LLAMA3, '{"name": "get_time", "parameters": {}} and more', []),
]


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("answer,format,content,calls", ANSWERS, ids=[str(i) for i in range(len(ANSWERS))])
def test_parse_whole_answers(answer, format, content, calls):
    got_content, got_calls = parse_tool_calls(answer, format)
    assert got_content == content
    assert _calls(got_calls) == calls
    for call in got_calls:
        assert call["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
        assert isinstance(call["function"]["arguments"], str)
    assert len({c["id"] for c in got_calls}) == len(got_calls)


@settings(max_examples=60, deadline=None)
@given(index=st.integers(0, len(ANSWERS) - 1), cuts=st.lists(st.integers(1, 200), max_size=12))
def test_streamed_pieces_give_the_whole_answer_s_result(index, cuts):
    """However the text is split, the events add up to the whole-text parse; no event is a call
    before its closing marker has arrived (hermes) or the answer has ended (llama3)."""
    answer, format, content, calls = ANSWERS[index]
    cuts = sorted({c for c in cuts if c < len(answer)})
    pieces = [answer[a:b] for a, b in zip([0] + cuts, cuts + [len(answer)])]
    parser, events, seen = ToolCallParser(format), [], ""
    for piece in pieces:
        seen += piece
        events += parser.feed(piece)
        fed_calls = sum(isinstance(e, dict) for e in events)
        assert fed_calls <= (seen.count("</tool_call>") if format == HERMES else 0)
    events += parser.finish()
    text = "".join(e for e in events if isinstance(e, str))
    assert (text or None) == content
    assert _calls([e for e in events if isinstance(e, dict)]) == calls


def test_text_that_may_begin_a_call_is_held_back():
    parser = ToolCallParser(HERMES)
    assert parser.feed("Sure <tool") == ["Sure"]  # the space waits too: it is dropped before a call
    assert parser.feed("_ca") == []
    assert parser.feed("r is red ") == [" <tool_car is red"]
    assert parser.finish() == [" "]
    llama = ToolCallParser(LLAMA3)
    assert llama.feed("  {\"name\": ") == []  # may be a call: held until the end
    assert llama.feed('"get_time", "parameters": {}}') == []
    [call] = llama.finish()
    assert call["function"] == {"name": "get_time", "arguments": "{}"}
    assert ToolCallParser(LLAMA3).feed("Hello") == ["Hello"]  # plain text goes straight through


def test_the_format_comes_from_the_template():
    assert tool_format(QWEN25) == HERMES
    assert tool_format(LLAMA31) == LLAMA3
    assert tool_format(CHATML) == HERMES  # the generic fallback's format
    with pytest.raises(ValueError, match="format"):
        ToolCallParser("xml")


# -- rendering ---------------------------------------------------------------------------------------
def conversation(arguments_as):
    """A round trip as the openai client sends it ("string" arguments) or as transformers' templates
    take it ("dict")."""
    args = {"city": "Paris", "days": 2}
    call = {"id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(args) if arguments_as == "string" else args}}
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_abc", "content": '{"sky": "clear", "celsius": 21}'},
            {"role": "user", "content": "And tomorrow?"}]


@pytest.mark.parametrize("template", [QWEN25, LLAMA31], ids=["qwen2.5", "llama3.1"])
def test_templates_with_tools_render_as_transformers_does(template):
    ours = tiny_tokenizer(template)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=ours.tokenizer, eos_token="<|im_end|>")
    ref.chat_template = template
    support = tool_support(ours)
    assert (support.tools, support.tool_calls, support.tool_responses) == (True, True, True)
    for messages, tools in ((conversation("string"), TOOLS), (conversation("string")[:2], TOOLS),
                            (conversation("string")[:2], None)):
        hf = [m if m["role"] != "assistant" else conversation("dict")[2] for m in messages]
        want = ref.apply_chat_template(hf, tools=tools, tokenize=False, add_generation_prompt=True)
        assert render_conversation(ours, messages, tools, tokenize=False) == want
        assert render_conversation(ours, messages, tools) == ours.encode(want, add_special_tokens=False)
    # the dict arguments reach the template: written once, not as a quoted string
    text = render_conversation(ours, conversation("string"), TOOLS, tokenize=False)
    assert '"arguments": {"city": "Paris", "days": 2}' in text or '"parameters": {"city": "Paris", "days": 2}' in text


def test_generic_fallback_for_a_template_without_tools():
    """SmolLM2's template renders no tools: they are described in the system prompt, the earlier call is
    written in the assistant turn in the format the parser reads, the result comes back as a user turn."""
    tok = mn.models.load_tokenizer(smollm2_file())
    support = tool_support(tok)
    assert not support.tools and not support.tool_calls
    assert output_format(tok) == HERMES
    text = render_conversation(tok, conversation("string"), TOOLS, tokenize=False)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    want = ("<|im_start|>system\nBe brief.\n\n" + describe_tools(TOOLS) + "<|im_end|>\n"
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
            f"<|im_start|>assistant\n{call}<|im_end|>\n"
            '<|im_start|>user\n<tool_response>\n{"sky": "clear", "celsius": 21}\n</tool_response><|im_end|>\n'
            "<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n")
    assert text == want
    for tool in TOOLS:  # the description carries each tool's whole schema and the answer format
        assert json.dumps(tool, ensure_ascii=False) in describe_tools(TOOLS)
    assert '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>' in want
    # what the fallback writes for a call, the parser reads back
    written = calls_as_text(conversation("string")[2]["tool_calls"])
    assert written == call
    assert _calls(parse_tool_calls(written)[1]) == [("get_weather", {"city": "Paris", "days": 2})]
    # without a system message the description becomes one
    first = render_conversation(tok, conversation("string")[1:2], TOOLS, tokenize=False)
    assert first.startswith("<|im_start|>system\n" + describe_tools(TOOLS) + "<|im_end|>\n<|im_start|>user\n")
    # no tools at all: exactly the template's own rendering
    plain = [{"role": "user", "content": "hi"}]
    assert render_conversation(tok, plain) == tok.apply_chat_template(plain)


def test_consecutive_tool_results_share_one_user_turn():
    tok = tiny_tokenizer(CHATML)
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
             for i in range(2)]
    messages = [{"role": "user", "content": "Times?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_0", "content": "10:00"},
                {"role": "tool", "tool_call_id": "call_1", "content": "11:00"}]
    text = render_conversation(tok, messages, [TIME], tokenize=False)
    assert ("<|im_start|>assistant\nChecking.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call><|im_end|>\n") in text
    assert ("<|im_start|>user\n<tool_response>\n10:00\n</tool_response>\n<tool_response>\n11:00\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text


# -- forced calls --------------------------------------------------------------------------------------
@pytest.mark.parametrize("format", [HERMES, LLAMA3])
@pytest.mark.parametrize("name", [None, "get_weather"])
def test_forced_call_grammars_only_produce_valid_calls(format, name):
    """Random walks through the grammar (uniform over the allowed tokens): every text parses into
    calls of the allowed tools, with arguments valid under the tool's parameters."""
    tok = tiny_tokenizer(QWEN25)
    rng = np.random.default_rng(0)
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "maxProperties": 0}
               for t in TOOLS}
    names = set()
    for _ in range(8):
        c = GrammarConstraint.lark(tok, tool_call_grammar(TOOLS, format, name=name, parallel=True))
        ids = []
        while not c.done and len(ids) < 400:
            token = int(rng.choice(np.nonzero(c.allowed())[0]))
            if token in tok.eos_token_ids:
                break
            c.accept(token)
            ids.append(token)
        content, calls = parse_tool_calls(tok.decode(ids), format)
        assert content is None and calls, tok.decode(ids)
        for fn, args in _calls(calls):
            jsonschema.validate(args, schemas[fn])
            names.add(fn)
    assert names == ({name} if name else set(schemas))
    with pytest.raises(ValueError, match="no tool is named"):
        tool_call_grammar(TOOLS, format, name="get_news")


def test_tool_schemas_are_lenient_unless_every_tool_is_strict():
    """Keywords llguidance does not implement ("not") are ignored for ordinary tools and refused
    once the tools say "strict": true, as OpenAI's strict mode promises the schema exactly."""
    from metalnn.llm.constrained import GrammarError

    tok = tiny_tokenizer(QWEN25)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {"required": ["a"]}}}}
    GrammarConstraint.lark(tok, tool_call_grammar([tool]))
    strict = {"type": "function", "function": {**tool["function"], "strict": True}}
    with pytest.raises(GrammarError, match="not"):
        GrammarConstraint.lark(tok, tool_call_grammar([strict]))

"""Tool calls and constrained output of `metalnn serve`, through the official ``openai`` client.

Two servers: the tiny random model with a Qwen2.5-style template (tools rendered natively,
``<tool_call>`` answers), where ``tool_choice`` (required or a named function) forces the answer
into a call so that even a random model's round trip is well defined, and the bundled SmolLM2,
whose template renders no tools (the generic fallback). References: transformers'
``apply_chat_template`` for the prompts the server builds (compared through ``usage.prompt_tokens``),
``jsonschema`` for every call's arguments and every structured answer, and the library run in
this process on the same checkpoint (greedy decoding is deterministic) for the answers' text.
"""

import json
import re

import jsonschema
import openai
import pytest
import transformers

import metalnn as mn
from metalnn.llm.constrained import GrammarConstraint
from metalnn.llm.text_generation import TextStream
from metalnn.llm.tool_calls import parse_tool_calls, tool_call_grammar
from metalnn.llm.tool_prompt import describe_tools, render_conversation

from app_models import save_tiny_model
from bundled_model import smollm2_file
from server_process import running_server
from tool_templates import QWEN25

transformers.logging.set_verbosity_error()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                         "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]
RESULT = '{"sky": "clear", "celsius": 21}'

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("qwen") / "tiny", chat_template=QWEN25)


@pytest.fixture(scope="module")
def reference(tiny):
    """transformers' tokenizer of the same folder: the independent renderer of the prompts."""
    return transformers.AutoTokenizer.from_pretrained(tiny)


def hf_messages(messages):
    """The conversation in transformers' convention (arguments as dicts), from the client's objects."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            m = m.model_dump(exclude_none=True)
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
            m.setdefault("content", None)
        out.append(m)
    return out


def prompt_length(reference, messages, tools):
    return len(reference.apply_chat_template(hf_messages(messages), tools=tools, add_generation_prompt=True,
                                             tokenize=True, return_dict=False))


def arguments(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMETERS[call.function.name])
    return args


def test_named_tool_call_round_trip(client, local, reference):
    """Call -> the tool's result sent back (the assistant message with content null, then a tool
    message) -> the final answer; each prompt is transformers' rendering of the conversation."""
    model, tok = local
    r = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice=NAMED,
                                       temperature=0, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and re.fullmatch(r"call_[0-9a-f]{24}",
                                                                                             call.id)
    args = arguments(call)
    assert r.usage.prompt_tokens == prompt_length(reference, QUESTION, TOOLS)
    # the library, forced the same way, writes the same call
    grammar = GrammarConstraint.lark(tok, tool_call_grammar(TOOLS, "hermes", name="get_weather"))
    text = "".join(TextStream(model, tok, render_conversation(tok, QUESTION, TOOLS), 200, processors=[grammar]))
    [want] = parse_tool_calls(text)[1]
    assert json.loads(want["function"]["arguments"]) == args

    messages = QUESTION + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=24)
    assert final.usage.prompt_tokens == prompt_length(reference, messages, TOOLS)
    prompt = reference.apply_chat_template(hf_messages(messages), tools=TOOLS, add_generation_prompt=True,
                                           tokenize=False)
    assert "<tool_response>\n" + RESULT + "\n</tool_response>" in prompt
    stream = TextStream(model, tok, tok.encode(prompt, add_special_tokens=False), 24)
    content, calls = parse_tool_calls("".join(stream))
    assert final.choices[0].message.content == content and not calls
    assert final.choices[0].finish_reason == stream.finish_reason


def test_streamed_forced_call_equals_the_whole_one(client):
    whole = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=200)
    chunks = list(client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS,
                                                 tool_choice="required", parallel_tool_calls=False, temperature=0,
                                                 max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    streamed = [tc for d in deltas for tc in d.tool_calls or ()]
    [want] = whole.choices[0].message.tool_calls
    assert [(tc.index, tc.type, tc.function.name, tc.function.arguments) for tc in streamed] == [
        (0, "function", want.function.name, want.function.arguments)]
    assert re.fullmatch(r"call_[0-9a-f]{24}", streamed[0].id)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert whole.choices[0].finish_reason == "tool_calls"
    # the client's own stream accumulator reads the deltas into the same message
    with client.chat.completions.stream(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, temperature=0, max_tokens=200) as stream:
        final = stream.get_final_completion()
    [got] = final.choices[0].message.tool_calls
    assert (got.function.name, got.function.arguments) == (want.function.name, want.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"


def test_required_sampled_calls_are_all_valid(client):
    """Temperature 1: whatever calls come out (one or more), each is a valid call of a tool."""
    finished = 0
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=400)
        choice = r.choices[0]
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.finish_reason == "tool_calls":
            finished += 1
            assert choice.message.content is None and choice.message.tool_calls
            for call in choice.message.tool_calls:
                arguments(call)
            assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)
    assert finished


def test_auto_and_none_leave_plain_answers_alone(client, local, reference):
    """The random model writes no call: with "auto" the text is the library's; with "none" too (the
    tools are still in the prompt), streamed or not."""
    model, tok = local
    stream = TextStream(model, tok, render_conversation(tok, QUESTION, TOOLS), 30)
    want = "".join(stream)
    assert "<tool_call>" not in want
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                           temperature=0, max_tokens=30)
        assert r.choices[0].message.content == (want if choice == "none" else parse_tool_calls(want)[0])
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == stream.finish_reason
        assert r.usage.prompt_tokens == prompt_length(reference, QUESTION, TOOLS)
        chunks = client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, tool_choice=choice,
                                                temperature=0, max_tokens=30, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


def test_response_format_json_schema(client):
    for seed in range(3):
        for stream in (False, True):
            kwargs = dict(model="tiny", messages=[{"role": "user", "content": "A person, please"}], temperature=1.0,
                          seed=seed, max_tokens=200,
                          response_format={"type": "json_schema",
                                           "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                    stream=True, **kwargs) if c.choices)
            else:
                r = client.chat.completions.create(**kwargs)
                text = r.choices[0].message.content
                assert r.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(text), PERSON)


def test_response_format_json_object(client):
    finished = 0
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON!"}],
                                           temperature=1.0, seed=seed, max_tokens=400,
                                           response_format={"type": "json_object"})
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":
            finished += 1
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")
    assert finished


def test_grammar_extension_on_both_endpoints(client):
    grammar = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    language = r"\([0-9]{1,3}(,[0-9]{1,3})*\)"
    for seed in range(3):
        r = client.completions.create(model="tiny", prompt="Numbers:", temperature=1.0, seed=seed, max_tokens=100,
                                      extra_body={"grammar": grammar})
        assert re.fullmatch(language, r.choices[0].text) and r.choices[0].finish_reason == "stop"
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Numbers"}],
                                           temperature=1.0, seed=seed, max_tokens=100, extra_body={"grammar": grammar})
        assert re.fullmatch(language, r.choices[0].message.content)


BAD = [
    # (extra request fields, param the error must name (or None), text the message must contain)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format", "frob"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array",
                                                                                       "uniqueItems": True},
                                                                "strict": True}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "response_format"),
    ({"grammar": "start: nowhere"}, "grammar", "unknown name"),
    ({"grammar": "start: \"a\"", "response_format": {"type": "json_object"}}, None, "grammar"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, None, "get_news"),
    ({"tool_choice": "required"}, None, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "name"),
    ({"tools": [WEATHER, WEATHER]}, None, "distinct"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools", "frob"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True,
                                                  "parameters": {"type": "object", "not": {"required": ["a"]}}}}],
      "tool_choice": "required"}, "tools", "not"),
    ({"tools": TOOLS, "tool_choice": "required", "grammar": "start: \"a\""}, None, "tool_choice"),
    ({"messages": [{"role": "user", "content": None}]}, "messages", "messages[0].content"),
    ({"messages": QUESTION + [{"role": "tool", "content": "x"}]}, "messages", "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages", "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls[0].function.arguments", "arguments"),
]


@pytest.mark.parametrize("extra,param,mention", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_tool_and_format_requests_are_400s(client, extra, param, mention):
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 5, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/chat/completions", cast_to=object, body=body)
    error = e.value.body
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert mention in error["message"], error


def test_after_bad_requests_nothing_failed(server, client):
    # the server still answers (a sampled answer of the tiny model may be its end-of-sequence token alone,
    # so the test asks for tokens generated, not for text)
    answer = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens >= 1
    health = server.wait_idle()
    assert health["failed"] == 0


# -- the bundled SmolLM2: a template without tools ------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = smollm2_file()
    with running_server(path, tmp_path_factory.mktemp("smollm2-logs"), "--model-name", "smollm2") as s:
        yield s, path
        assert "Traceback" not in s.logs(), s.logs()


def test_smollm2_round_trip_through_the_generic_fallback(smollm2):
    server, path = smollm2
    model, tok = mn.models.load_pretrained(path), mn.models.load_tokenizer(path)
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice=NAMED,
                                       temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    args = arguments(call)
    # the prompt: SmolLM2's template, the tools described in a system turn it renders
    described = ("<|im_start|>system\n" + describe_tools(TOOLS) + "<|im_end|>\n<|im_start|>user\n"
                 + QUESTION[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    assert r.usage.prompt_tokens == len(tok.encode(described, add_special_tokens=False))

    messages = QUESTION + [choice.message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, temperature=0,
                                           max_tokens=24)
    written = '<tool_call>\n' + json.dumps({"name": "get_weather", "arguments": args}) + '\n</tool_call>'
    prompt = (described + written + "<|im_end|>\n<|im_start|>user\n<tool_response>\n" + RESULT
              + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert render_conversation(tok, hf_messages(messages), TOOLS, tokenize=False) == prompt
    assert final.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    stream = TextStream(model, tok, tok.encode(prompt, add_special_tokens=False), 24)
    content, calls = parse_tool_calls("".join(stream))
    got = final.choices[0]
    assert got.message.content == content
    assert [c.function.name for c in got.message.tool_calls or ()] == [c["function"]["name"] for c in calls]
    assert got.finish_reason == ("tool_calls" if calls and stream.finish_reason == "stop" else stream.finish_reason)

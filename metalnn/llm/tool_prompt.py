"""Conversations with tools through a chat template: `render_conversation`.

OpenAI clients describe tools as ``[{"type": "function", "function": {"name", "description",
"parameters"}}]``, send back the assistant's calls as a message with ``content: null`` and
``tool_calls`` (``function.arguments`` a JSON string), and the results as ``role: "tool"``
messages with a ``tool_call_id``. Chat templates written for transformers receive the same
``tools`` list and messages, except that ``arguments`` is a dict (transformers' convention:
Qwen2.5's template writes it with ``tojson``, which would quote a string a second time);
`template_messages` converts.

Many templates render no tools at all (SmolLM2's, for one). `tool_support` finds out what a
template renders by rendering probes (as llama.cpp does): the tools, an assistant message's
calls, a tool result. What it does not render, `render_conversation` writes as text in the
generic fallback: a system-prompt description of the tools (their JSON schemas and the
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` answer format, which
`metalnn.llm.tool_calls` parses), earlier calls as that text in the assistant's turn, and tool
results as a user turn of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from .chat_template import render
from .tool_calls import CLOSE, HERMES, LLAMA3, OPEN, tool_format

_PROBE_TOOL = "metalnn_probe_tool"
_PROBE_CALL = "metalnn_probe_call"
_PROBE_RESULT = "metalnn_probe_result"


@dataclass(frozen=True)
class ToolSupport:
    """What a chat template renders: the ``tools`` list, assistant ``tool_calls``, ``tool`` messages."""

    tools: bool
    tool_calls: bool
    tool_responses: bool


def _arguments(value):
    """``function.arguments`` for a template: a JSON string of an object becomes the dict."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def template_messages(messages) -> list[dict]:
    """OpenAI chat messages as chat templates expect them (transformers' convention): ``arguments``
    as dicts, ``developer`` as ``system``, and each ``tool`` message with the ``name`` of the call
    it answers (some templates write it)."""
    out, names = [], {}
    for m in messages:
        m = dict(m)
        if m.get("role") == "developer":
            m["role"] = "system"
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                call = dict(call)
                function = dict(call.get("function") or {})
                function["arguments"] = _arguments(function.get("arguments"))
                call["function"] = function
                calls.append(call)
                if call.get("id") is not None:
                    names[call["id"]] = function.get("name")
            m["tool_calls"] = calls
        if m.get("role") == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out


def _renders(template, special, marker, messages, tools=None, add_generation_prompt=False) -> bool:
    try:
        return marker in render(template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                **dict(special))
    except Exception:  # a template that refuses the probe does not support it
        return False


@lru_cache(maxsize=32)
def _support(template: str, special: tuple) -> ToolSupport:
    tool = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
                                             "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
    user = {"role": "user", "content": "probe"}
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_probe", "type": "function",
                            "function": {"name": _PROBE_CALL, "arguments": {"x": "probe"}}}]}
    tools = _renders(template, special, _PROBE_TOOL, [user], [tool], add_generation_prompt=True)
    calls = _renders(template, special, _PROBE_CALL, [user, call], [tool])
    said = call if calls else {"role": "assistant", "content": "probe"}
    result = {"role": "tool", "tool_call_id": "call_probe", "name": _PROBE_CALL, "content": _PROBE_RESULT}
    responses = _renders(template, special, _PROBE_RESULT, [user, said, result], [tool], add_generation_prompt=True)
    return ToolSupport(tools, calls, responses)


def tool_support(tokenizer) -> ToolSupport:
    """What ``tokenizer``'s chat template renders of tools (probed once per template)."""
    if not tokenizer.chat_template:
        return ToolSupport(False, False, False)
    return _support(tokenizer.chat_template, tuple(sorted(tokenizer.special_tokens.items())))


def output_format(tokenizer) -> str:
    """The tool-call format to expect from the model (`metalnn.llm.tool_calls`): the template's own
    when it renders tools, else the generic fallback's (`HERMES`)."""
    return tool_format(tokenizer.chat_template) if tool_support(tokenizer).tools else HERMES


def describe_tools(tools) -> str:
    """The generic fallback's system-prompt text: the tools' JSON schemas and the answer format."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions to help answer the user. The functions, as JSON schemas:\n"
            f"<tools>\n{schemas}\n</tools>\n\n"
            "To call functions, answer with one JSON object per call, each inside <tool_call></tool_call> tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{CLOSE}\n'
            "The results come back inside <tool_response></tool_response> tags.")


def calls_as_text(calls, format: str = HERMES) -> str:
    """An assistant's ``tool_calls`` written as the model would (`HERMES` blocks or `LLAMA3` JSON)."""
    parts = []
    for call in calls:
        function = call.get("function") or {}
        args = _arguments(function.get("arguments"))
        if format == LLAMA3:
            parts.append(json.dumps({"name": function.get("name"), "parameters": args}, ensure_ascii=False))
        else:
            body = json.dumps({"name": function.get("name"), "arguments": args}, ensure_ascii=False)
            parts.append(f"{OPEN}\n{body}\n{CLOSE}")
    return ("; " if format == LLAMA3 else "\n").join(parts)


def _fallback(messages, tools, support: ToolSupport, format: str) -> list[dict]:
    """``messages`` with what the template does not render written as text."""
    out = []
    for m in messages:
        if m.get("tool_calls") and not support.tool_calls:
            text = calls_as_text(m["tool_calls"], format)
            content = m.get("content")
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{content}\n{text}" if content else text
        if m.get("role") == "tool" and not support.tool_responses:
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
                continue
            m = {"role": "user", "content": block, "_tool_results": True}
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if tools and not support.tools:
        description = describe_tools(tools)
        if out and out[0].get("role") == "system":
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{first}\n\n{description}" if first else description}
        else:
            out.insert(0, {"role": "system", "content": description})
    return out


def render_conversation(tokenizer, messages, tools=None, *, add_generation_prompt: bool = True,
                        tokenize: bool = True, **variables):
    """The prompt for OpenAI-style ``messages`` (with tool calls and results) and ``tools``.

    What the chat template renders itself goes to it as transformers would pass it
    (`template_messages`); the rest is written as text by the generic fallback (module docs).

    Args:
        tokenizer: a `metalnn.llm.tokenizer.Tokenizer` with a chat template.
        messages: ``[{"role", "content", "tool_calls"?, "tool_call_id"?}, ...]``.
        tools: OpenAI function tools (None or empty: none).
        add_generation_prompt, tokenize, variables: as `Tokenizer.apply_chat_template`.
    Returns:
        ``list[int]`` token ids (``str`` with ``tokenize=False``).
    Raises:
        ValueError / `metalnn.llm.chat_template.ChatTemplateError`: as `Tokenizer.apply_chat_template`.
    """
    messages = template_messages(messages)
    uses_tools = bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if uses_tools:
        support = tool_support(tokenizer)
        if not support.tools:  # the whole generic fallback: the tools, calls and results all as its text
            support = ToolSupport(False, False, False)
        if not (support.tools and support.tool_calls and support.tool_responses):
            messages = _fallback(messages, tools, support, output_format(tokenizer))
            tools = tools if support.tools else None
    return tokenizer.apply_chat_template(messages, add_generation_prompt, tools=tools or None, tokenize=tokenize,
                                         **variables)

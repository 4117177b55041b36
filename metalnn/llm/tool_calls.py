"""Tool calls in model output: the formats, their parsers (whole text or streamed) and grammars.

Two formats cover the common open chat models:

* ``"hermes"`` (Qwen2.5, Qwen3, Hermes, and metalnn's generic fallback for templates without tool
  support, see `metalnn.llm.tool_prompt`): each call is a JSON object between tags, any number of
  them, text around them is the answer's content::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

* ``"llama3"`` (Llama 3.1 / 3.2 JSON tool calling): the whole answer is one JSON object
  ``{"name": ..., "parameters": {...}}`` (several separated by ``;``), possibly after
  ``<|python_tag|>``.

`tool_format(template)` picks the format a chat template asks for. `parse_tool_calls` splits a
whole answer into content and OpenAI tool calls; `ToolCallParser` does the same on streamed text
pieces, holding back text that may be the beginning of a call until it knows, and returns each
call once it is complete. Both give the same result for the same text however it is split.
`tool_call_grammar` writes the Lark grammar (llguidance's syntax) that forces a call of the given
tools in a format, for ``tool_choice`` "required" or a named function
(`metalnn.llm.constrained.GrammarConstraint.lark`).

Calls are OpenAI's: ``{"id": "call_<random>", "type": "function", "function": {"name": str,
"arguments": str}}`` with ``arguments`` a JSON string.
"""

from __future__ import annotations

import json
import secrets

HERMES, LLAMA3 = "hermes", "llama3"
FORMATS = (HERMES, LLAMA3)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def tool_format(template: str | None) -> str:
    """The tool-call format a chat template's model writes: `LLAMA3` when the template mentions
    ``<|python_tag|>`` or ``"parameters"`` (and not ``<tool_call>``), else `HERMES` (also the
    format of the generic fallback for templates without tools)."""
    text = template or ""
    if OPEN in text:
        return HERMES
    if PYTHON_TAG in text or '"parameters"' in text:
        return LLAMA3
    return HERMES


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def make_call(name: str, arguments) -> dict:
    """An OpenAI tool call; ``arguments`` a dict (or a JSON string) becomes a JSON string."""
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            arguments = json.dumps(arguments, ensure_ascii=False)  # not JSON: keep it as a JSON string
    else:
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _call_from(obj, *argument_keys):
    """The call an object describes (``{"name": str, <argument key>: object or str}``), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            return make_call(obj["name"], args)
    return make_call(obj["name"], {}) if set(obj) == {"name"} else None


def _hermes_call(body: str):
    try:
        return _call_from(json.loads(body), "arguments", "parameters")
    except ValueError:
        return None


def _llama3_calls(text: str):
    """The calls of a whole llama3-format answer, or None when it is not one (or several) calls."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].lstrip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            obj, end = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = _call_from(obj, "parameters", "arguments")
        if call is None:
            return None
        calls.append(call)
        at = end
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
    return calls or None


def _prefix_at_end(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (it may be one starting)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolCallParser:
    """Split streamed model text into content and tool calls (one parser per sequence).

    ``feed(piece)`` and, at the end, ``finish()`` return events: ``str`` (content to show now) or
    ``dict`` (a complete OpenAI tool call). Content is held back while it may be the start of a
    call; whitespace next to a call (between the text and a call, between calls, at the end) is
    dropped. A ``<tool_call>`` block whose body is not a call stays content, as written.

    Args:
        format: `HERMES` or `LLAMA3`.
    """

    def __init__(self, format: str = HERMES):
        if format not in FORMATS:
            raise ValueError(f"ToolCallParser: format must be one of {FORMATS}, got {format!r}")
        self.format = format
        self.calls: list[dict] = []
        self._buffer = ""      # text not decided yet
        self._space = ""       # whitespace held back (dropped if a call follows)
        self._inside = False   # hermes: within <tool_call> ... (the buffer holds the body)
        self._mode = None      # llama3: None (undecided), "json" (maybe calls: hold all), "text"
        self._after_call = False  # the last event was a call
        self.finished = False

    # -- content with whitespace held back -----------------------------------------------------
    def _text(self, text: str, out: list):
        core = text.strip()
        if not core:
            self._space += text
            return
        lead = text[:len(text) - len(text.lstrip())]
        # whitespace right after a call is dropped; otherwise held whitespace is shown with the text
        out.append(core if self._after_call else self._space + lead + core)
        self._space, self._after_call = text[len(text.rstrip()):], False

    def _call(self, call: dict, out: list):
        self._space, self._after_call = "", True
        self.calls.append(call)
        out.append(call)

    # -- feeding --------------------------------------------------------------------------------
    def feed(self, piece: str) -> list:
        """Events for the next piece of text."""
        if self.finished:
            raise RuntimeError("ToolCallParser.feed after finish()")
        self._buffer += piece
        out: list = []
        if self.format == HERMES:
            self._hermes(out, final=False)
        else:
            self._llama3(out, final=False)
        return out

    def finish(self) -> list:
        """Events for the text still held back (the answer has ended)."""
        if self.finished:
            return []
        out: list = []
        if self.format == HERMES:
            self._hermes(out, final=True)
        else:
            self._llama3(out, final=True)
        if self._space and not self.calls:
            out.append(self._space)
        self._space = ""
        self.finished = True
        return out

    def _hermes(self, out: list, final: bool):
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    if final:  # an unclosed call at the end: a call if its body is one
                        call = _hermes_call(self._buffer)
                        if call is not None:
                            self._call(call, out)
                        else:
                            self._text(OPEN + self._buffer, out)
                        self._buffer, self._inside = "", False
                    return
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._inside = False
                call = _hermes_call(body)
                if call is not None:
                    self._call(call, out)
                else:
                    self._text(OPEN + body + CLOSE, out)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                self._text(self._buffer[:start], out)
                self._buffer, self._inside = self._buffer[start + len(OPEN):], True
                continue
            keep = 0 if final else _prefix_at_end(self._buffer, OPEN)
            ready, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
            self._text(ready, out)
            return

    def _llama3(self, out: list, final: bool):
        if self._mode is None:
            head = self._buffer.lstrip()
            if not head:
                if not final:
                    return
                self._mode = "text"
            elif head.startswith("{") or head.startswith(PYTHON_TAG):
                self._mode = "json"
            elif PYTHON_TAG.startswith(head) and not final:
                return  # may still become <|python_tag|>
            else:
                self._mode = "text"
        if self._mode == "text":
            text, self._buffer = self._buffer, ""
            self._text(text, out)
            return
        if final:  # "json": decided at the end, all at once
            text, self._buffer = self._buffer, ""
            calls = _llama3_calls(text)
            if calls is None:
                self._text(text, out)
            else:
                for call in calls:
                    self._call(call, out)


def parse_tool_calls(text: str, format: str = HERMES) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a whole answer: the text outside the calls (None when empty) and
    the OpenAI tool calls, in order (see `ToolCallParser`)."""
    parser = ToolCallParser(format)
    events = parser.feed(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return (content or None), [e for e in events if isinstance(e, dict)]


# -- forcing a call -------------------------------------------------------------------------------
def call_schema(tool: dict, format: str = HERMES) -> dict:
    """The JSON schema of one call of an OpenAI function ``tool`` in ``format``: the name as a
    constant, then its parameters' schema (an empty object when it has none: OpenAI's meaning)."""
    function = tool.get("function", tool)
    params = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    key = "parameters" if format == LLAMA3 else "arguments"
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}


def tool_call_grammar(tools: list, format: str = HERMES, name: str | None = None, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's syntax) whose every text is a call of ``tools`` in ``format``.

    The JSON is compact (`metalnn.llm.constrained.COMPACT_JSON`). Parameter schemas are followed
    leniently (keywords llguidance does not implement are ignored) unless every tool says
    ``"strict": true``.

    Args:
        tools: OpenAI tools (``{"type": "function", "function": {"name", "parameters", ...}}``).
        format: `HERMES` or `LLAMA3`.
        name: exactly one call of this function (``tool_choice`` naming one); default: any of ``tools``.
        parallel: `HERMES` without ``name`` only: one or more calls (each on its own line) instead of
            exactly one.
    Raises:
        ValueError: ``name`` is not among ``tools``, or no tools.
    """
    if format not in FORMATS:
        raise ValueError(f"tool_call_grammar: format must be one of {FORMATS}, got {format!r}")
    names = [t.get("function", t)["name"] for t in tools]
    if name is not None:
        if name not in names:
            raise ValueError(f"tool_call_grammar: no tool is named {name!r} (tools: {', '.join(names)})")
        tools = [t for t, n in zip(tools, names) if n == name]
    if not tools:
        raise ValueError("tool_call_grammar: no tools to call")
    from .constrained import COMPACT_JSON

    schemas = [call_schema(t, format) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # keywords llguidance does not implement are refused only when every tool asks to be strict
    strict = all(t.get("function", t).get("strict") for t in tools)
    schema = {"x-guidance": {**COMPACT_JSON, "lenient": not strict}, **schema}
    lines = [f"call: %json {json.dumps(schema, ensure_ascii=False)}"]
    if format == LLAMA3:
        return "\n".join(["start: call"] + lines)
    block = f"{json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}"
    start = f"start: block ({json.dumps(chr(10))} block)*" if parallel and name is None else "start: block"
    return "\n".join([start, f"block: {block}"] + lines)

"""Tool calls and constrained output of one request: its grammar, and its answer's tool calls.

`constraint` turns a request's ``tool_choice`` ("required" or a named function), ``grammar`` or
``response_format`` into a `metalnn.llm.constrained.GrammarConstraint` (a refused grammar or
schema is a 400 naming the field). `ToolCallDeltas` turns the generated text into OpenAI's
message fields: streamed deltas (``content`` pieces and complete ``tool_calls`` entries, each with
its ``index``) or, for a whole answer, ``content`` and ``tool_calls``; ``finish_reason`` becomes
"tool_calls" when the answer ended normally with calls.
"""

from __future__ import annotations

from ..constrained import GrammarConstraint, GrammarError
from ..text_generation import STOP
from ..tool_calls import ToolCallParser, parse_tool_calls, tool_call_grammar
from ..tool_prompt import output_format
from .errors import APIError

TOOL_CALLS = "tool_calls"


def tool_dicts(body) -> list[dict] | None:
    """A chat request's ``tools`` as plain OpenAI dicts (None: none)."""
    tools = getattr(body, "tools", None)
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def parses_tool_calls(body) -> bool:
    """Whether the answer is searched for tool calls: tools are given and ``tool_choice`` is not "none"."""
    return bool(getattr(body, "tools", None)) and getattr(body, "tool_choice", None) != "none"


def _refused(param: str, what: str, error: Exception) -> APIError:
    return APIError(400, f"Invalid '{param}': {what} was refused: {error}", param=param, code="invalid_value")


def constraint(tokenizer, body) -> GrammarConstraint | None:
    """The grammar a request's output must follow (None: free text). Compiling it can take a while
    for a large grammar, and the first one builds llguidance's copy of the vocabulary: call it off
    the event loop.

    Raises:
        APIError: 400 naming ``tools``, ``grammar`` or ``response_format`` when llguidance refuses it.
    """
    if getattr(body, "forces_tool_call", False):
        choice = body.tool_choice
        name = None if choice == "required" else choice.function.name
        try:
            grammar = tool_call_grammar(tool_dicts(body), output_format(tokenizer), name, body.parallel_tool_calls)
            return GrammarConstraint.lark(tokenizer, grammar)
        except (GrammarError, ValueError) as e:
            raise _refused("tools", "a parameters schema", e) from None
    if body.grammar:
        try:
            return GrammarConstraint.lark(tokenizer, body.grammar)
        except GrammarError as e:
            raise _refused("grammar", "the grammar", e) from None
    fmt = getattr(body, "response_format", None)
    if fmt is None or fmt.type == "text":
        return None
    try:
        if fmt.type == "json_object":
            return GrammarConstraint.json_object(tokenizer)
        schema = fmt.json_schema.schema_ if fmt.json_schema.schema_ is not None else {"type": "object"}
        return GrammarConstraint.json_schema(tokenizer, schema, strict=bool(fmt.json_schema.strict))
    except GrammarError as e:
        raise _refused("response_format", "the JSON schema", e) from None


class ToolCallDeltas:
    """One answer's tool calls, found in its text as it streams (see `metalnn.llm.tool_calls`).

    Args:
        format: the tool-call format of the model (`metalnn.llm.tool_prompt.output_format`).
    """

    def __init__(self, format: str):
        self.format = format
        self.parser = ToolCallParser(format)
        self._sent = 0  # tool calls sent so far (the next one's index)

    def _deltas(self, events) -> list[dict]:
        out = []
        for e in events:
            if isinstance(e, str):
                out.append({"content": e})
            else:
                out.append({"tool_calls": [{"index": self._sent, **e}]})
                self._sent += 1
        return out

    def piece(self, text: str) -> list[dict]:
        """The deltas of the next piece of text (none while it may be part of a call)."""
        return self._deltas(self.parser.feed(text))

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """The deltas of the text held back, and the answer's ``finish_reason``."""
        deltas = self._deltas(self.parser.finish())
        return deltas, (TOOL_CALLS if self.parser.calls and finish_reason == STOP else finish_reason)

    def whole(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The assistant ``message`` of a whole answer and its ``finish_reason``."""
        content, calls = parse_tool_calls(text, self.format)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, (TOOL_CALLS if calls and finish_reason == STOP else finish_reason)

"""Request bodies of the OpenAI API subset the server answers (pydantic models, strict types).

Types are strict (a number sent as a string is an error, not converted), ranges are OpenAI's.
A null for an optional field means its default, as in OpenAI's API: the sampling defaults are the
model's ``generation_config.json`` (`metalnn.llm.sampling.SamplingParams.from_generation_config`).
Unknown fields are ignored, as OpenAI's server does; known features the server does not implement
(``echo``, ``suffix``) are refused when asked for. Chat takes ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` and ``response_format``; both endpoints take ``grammar`` (an extension: a
Lark grammar in llguidance's syntax).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..sampling import MAX_LOGIT_BIAS

#: stop strings per request (OpenAI's limit)
MAX_STOP = 4
#: choices per request (``n``)
MAX_N = 8
#: alternatives per token: chat's ``top_logprobs`` (OpenAI's limit), completions' ``logprobs`` (OpenAI's)
MAX_CHAT_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = 20, 5


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class _Generation(BaseModel):
    """The fields both endpoints take."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, description="sample among the k most likely tokens; 0: no limit (extension)")
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False,
                                description="leave out tokens less than min_p times as likely as the most likely "
                                            "one (extension)")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, allow_inf_nan=False,
                                             description="transformers' multiplicative penalty (extension)")
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    grammar: str | None = Field(None, min_length=1,
                                description="the output follows this Lark grammar, llguidance's syntax (extension)")

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        """``{"token id": bias}`` -> ``{id: bias}``; ids are numbers, biases in [-100, 100] (OpenAI's)."""
        if v is None:
            return None
        out = {}
        for key, value in v.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (whole numbers >= 0 as strings), got {key!r}")
            if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
                raise ValueError(f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value} for {key}")
            out[int(key)] = value
        return out

    @property
    def choices(self) -> int:
        """How many independent answers were asked for (``n``)."""
        return self.n or 1

    def sampling_overrides(self) -> dict:
        """The request's `metalnn.llm.sampling.SamplingParams` fields (None: the default)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k or None,
                "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                "logit_bias": self.logit_bias, "seed": self.seed, **self._logprobs()}

    def _logprobs(self) -> dict:
        return {}

    @model_validator(mode="after")
    def _implemented(self):
        unsupported = self._unsupported()
        if unsupported:
            raise ValueError("not supported by this server: " + "; ".join(unsupported))
        return self

    def _unsupported(self) -> list:
        return []


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


#: the ``tool_choice`` words (or an object naming a function)
TOOL_CHOICES = ("none", "auto", "required")
#: OpenAI's rule for function names
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call the assistant made (sent back in the conversation)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def problem(self) -> tuple[str, str] | None:
        """``(field, what is wrong)`` when a field is missing or misplaced (checked by the request,
        which knows the message's index)."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            return "content", "it is required (it may be null only in an assistant message with tool_calls)"
        if self.tool_calls and self.role != "assistant":
            return "tool_calls", f"only assistant messages have them, not {self.role} ones"
        if self.role == "tool" and not self.tool_call_id:
            return "tool_call_id", "it is required in a tool message"
        return None

    def as_template_message(self) -> dict:
        """The message for `metalnn.llm.tool_prompt.render_conversation`: ``{"role", "content"}``
        (text parts joined), plus ``tool_calls``, ``tool_call_id`` and ``name`` when given."""
        text = self.content
        if isinstance(text, list):
            text = "".join(p.text for p in text)
        out = {"role": self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionName


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object ({\"name\", \"schema\", \"strict\"})")
        return self


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, v):
        if isinstance(v, str) and v not in TOOL_CHOICES:
            raise ValueError(f"must be one of {', '.join(TOOL_CHOICES)} or "
                             '{"type": "function", "function": {"name": ...}}')
        return v

    @field_validator("messages")
    @classmethod
    def _complete_messages(cls, messages):
        for i, m in enumerate(messages):
            problem = m.problem()
            if problem:
                raise ValueError(f"messages[{i}].{problem[0]}: {problem[1]}")
        return messages

    @model_validator(mode="after")
    def _one_constraint(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be distinct, got {names}")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice: a tool choice other than 'none' needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: the function {choice.function.name!r} is not among the tools "
                             f"({', '.join(names)})")
        structured = self.response_format is not None and self.response_format.type != "text"
        if structured and self.grammar:
            raise ValueError("response_format and grammar: give one of them, not both")
        if self.forces_tool_call and (structured or self.grammar):
            raise ValueError("tool_choice: a required or named tool call cannot be combined with response_format "
                             "or grammar (it is a grammar itself)")
        return self

    @property
    def forces_tool_call(self) -> bool:
        """``tool_choice`` is "required" or names a function (and there are tools)."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def _logprobs(self) -> dict:
        return {"logprobs": bool(self.logprobs), "top_logprobs": self.top_logprobs if self.logprobs else None}

    def _unsupported(self):
        return []

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Generation):
    prompt: str | list[str]
    echo: bool | None = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS,
                                 description="report each token's log-probability and this many alternatives")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError("exactly one prompt is supported (a string, or a list of one string)")
            v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

    def _unsupported(self):
        out = []
        if self.echo:
            out.append("echo")
        if self.suffix:
            out.append("suffix")
        return out

    def _logprobs(self) -> dict:
        return {"logprobs": self.logprobs is not None, "top_logprobs": self.logprobs}

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

"""Request bodies of the OpenAI API subset the server answers (pydantic models, strict types).

Types are strict (a number sent as a string is an error, not converted), ranges are OpenAI's.
Unknown fields are ignored, as OpenAI's server does; known features the server does not implement
(``n`` > 1, ``logprobs``, tools, penalties, ``echo``, ``suffix``) are refused when asked for.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: stop strings per request (OpenAI's limit)
MAX_STOP = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class _Generation(BaseModel):
    """The fields both endpoints take."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens; 0: no limit (extension)")
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict | None = None
    user: str | None = None

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

    @model_validator(mode="after")
    def _implemented(self):
        unsupported = []
        if self.n != 1:
            unsupported.append("n (only n=1 is supported)")
        if self.presence_penalty or self.frequency_penalty:
            unsupported.append("presence_penalty / frequency_penalty (only 0)")
        if self.logit_bias:
            unsupported.append("logit_bias")
        unsupported += self._unsupported()
        if unsupported:
            raise ValueError("not supported by this server: " + "; ".join(unsupported))
        return self

    def _unsupported(self) -> list:
        return []


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_message(self) -> dict:
        """``{"role", "content"}`` for the chat template (``developer`` is the system role)."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    tools: list | None = None
    response_format: dict | None = None

    def _unsupported(self):
        out = []
        if self.logprobs:
            out.append("logprobs")
        if self.tools:
            out.append("tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append("response_format other than text")
        return out

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Generation):
    prompt: str | list[str]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None

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
        if self.logprobs:
            out.append("logprobs")
        return out

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

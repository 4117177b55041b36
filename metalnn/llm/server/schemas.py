"""Request bodies of the OpenAI API subset the server answers (pydantic models, strict types).

Types are strict (a number sent as a string is an error, not converted), ranges are OpenAI's.
A null for an optional field means its default, as in OpenAI's API: the sampling defaults are the
model's ``generation_config.json`` (`metalnn.llm.sampling.SamplingParams.from_generation_config`).
Unknown fields are ignored, as OpenAI's server does; known features the server does not implement
(tools, ``response_format``, ``echo``, ``suffix``) are refused when asked for.
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
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list | None = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def _logprobs(self) -> dict:
        return {"logprobs": bool(self.logprobs), "top_logprobs": self.top_logprobs if self.logprobs else None}

    def _unsupported(self):
        out = []
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

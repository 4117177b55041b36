"""``POST /v1/embeddings``: the request body (`EmbeddingRequest`) and its answer (`Embeddings`).

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists (as in
OpenAI's API); each becomes one vector of the model's hidden size: its final hidden states
mean-pooled and L2-normalised (`metalnn.llm.embeddings.embed`). ``encoding_format`` ``float``
sends lists of numbers, ``base64`` the little-endian float32 bytes of each vector (what the
``openai`` client asks for by default). ``dimensions`` is accepted only when it is the model's
hidden size (the vectors cannot be shortened). The work runs on the generation worker's thread,
in its turn (MLX evaluates one model on one thread at a time).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..embeddings import embed
from .errors import SERVER_ERROR, APIError
from .worker import Call

#: inputs per request (OpenAI's limit)
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("the input list is empty")
        items = [v] if isinstance(v, str) or isinstance(v[0], int) else v  # a token list is one input
        if len(items) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs are allowed, got {len(items)}")
        if isinstance(items[0], (str, list)):
            empty = next((i for i, item in enumerate(items) if not item), None)
            if empty is not None:
                raise ValueError(f"input {empty} is empty")
        return v

    def items(self) -> list:
        """The inputs as a list: strings, or lists of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if isinstance(self.input[0], int):
            return [self.input]
        return list(self.input)


class Embeddings:
    """Turns `EmbeddingRequest` s into worker calls and their results into OpenAI's answer.

    Args:
        model, tokenizer: the served model and its tokenizer.
        name: the model's id in the API.
        submit: queues a `metalnn.llm.server.worker.Job` on the worker (raising `APIError` 503 when
            it cannot).
    """

    def __init__(self, model, tokenizer, name: str, submit):
        self.model, self.tokenizer, self.name, self.submit = model, tokenizer, name, submit
        self.hidden_size = int(model.input_embeddings.dims)  # the final hidden states' width

    def token_lists(self, body: EmbeddingRequest) -> list[list[int]]:
        """The token ids of each input, checked against the vocabulary and the context length."""
        vocab, context = self.model.vocab_size, self.model.context_length
        lists = []
        for i, item in enumerate(body.items()):
            ids = self.tokenizer.encode(item) if isinstance(item, str) else item
            if not ids:
                raise APIError(400, f"Input {i} encodes to no tokens.", param="input", code="invalid_value")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"Input {i} holds the token id {bad}; the model's token ids are 0 to {vocab - 1}.",
                               param="input", code="invalid_value")
            if context is not None and len(ids) > context:
                raise APIError(400, f"Input {i} has {len(ids)} tokens; the model's context length is {context}.",
                               param="input", code="context_length_exceeded")
            lists.append(list(ids))
        return lists

    async def respond(self, body: EmbeddingRequest) -> dict:
        if body.dimensions is not None and body.dimensions != self.hidden_size:
            raise APIError(400, f"The model {self.name} makes embeddings of {self.hidden_size} dimensions; "
                           f"dimensions={body.dimensions} cannot be given.", param="dimensions",
                           code="invalid_value")
        lists = self.token_lists(body)
        model = self.model

        def embeddings():
            return np.asarray(embed(model, lists), dtype=np.float32)  # [N, hidden]

        job = Call(embeddings, asyncio.get_running_loop(), prompt_tokens=sum(map(len, lists)))
        self.submit(job)
        try:
            kind, value = await job.events.get()
        finally:
            job.cancel()  # drops it if it still waits (the client left); nothing to stop otherwise
        if kind == "error":
            raise APIError(500, f"embedding failed: {value}", type=SERVER_ERROR)
        if value is None:
            raise APIError(503, "The server is shutting down." if job.cancel_reason == "shutdown" else
                           "The request was cancelled.", type=SERVER_ERROR, code="cancelled")
        tokens = sum(map(len, lists))
        return {"object": "list", "model": self.name,
                "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                         for i, v in enumerate(value)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encode(vector: np.ndarray, encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()

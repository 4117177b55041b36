"""The FastAPI application: the OpenAI API subset, the health check and the chat page.

Routes: ``GET /`` (the chat page), ``GET /health``, ``GET /metrics``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/embeddings``. Generation requests are validated and tokenized here, then handed to the
`GenerationWorker`; answers stream back as server-sent events (``data: {...}`` chunks, then
``data: [DONE]``) or come whole. A request naming a ``model`` other than the served one gets 404
``model_not_found`` (leaving ``model`` out is fine). With ``settings.api_key`` every path but ``/``
and ``/health`` needs ``Authorization: Bearer KEY`` (`metalnn.llm.server.auth`). Tool calls and constrained
output (a request's grammar) are in `metalnn.llm.server.tools`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from ... import __version__
from ..chat_template import ChatTemplateError
from ..batching import DraftModel, PromptLookup
from ..prefix_cache import PrefixCache
from ..text_generation import CANCELLED
from ..tool_prompt import output_format, render_conversation
from . import errors, tools
from .auth import APIKeyAuth
from .embeddings import EmbeddingRequest, Embeddings
from .errors import SERVER_ERROR, APIError, error_body
from .limits import BodyLimit
from .metrics import RequestMetrics, ServerMetrics
from .schemas import ChatCompletionRequest, CompletionRequest
from .worker import GenerationWorker, Job, QueueFull, ShuttingDown

#: seconds between checks that the client of a non-streaming request is still connected
DISCONNECT_POLL = 0.25


#: the chat page's flag that tells it to ask for an API key
KEY_FLAG = '<meta name="metalnn-api-key-required" content="{}">'


def chat_page(key_required: bool = False) -> str:
    page = resources.files(__package__).joinpath("static", "chat.html").read_text(encoding="utf-8")
    if KEY_FLAG.format("false") not in page:
        raise RuntimeError(f"chat.html lacks its flag {KEY_FLAG.format('false')}")
    return page.replace(KEY_FLAG.format("false"), KEY_FLAG.format("true" if key_required else "false"))


def model_not_found(model_id: str, served: str) -> APIError:
    """OpenAI's answer to a model it does not have: 404, code ``model_not_found``."""
    return APIError(404, f"The model '{model_id}' does not exist; this server serves '{served}'.",
                    param="model", code="model_not_found")


def enqueue(worker: GenerationWorker, job: Job):
    """Queue ``job`` on ``worker``; a full queue or a stopping server is a 503 `APIError`."""
    try:
        worker.submit(job)
    except QueueFull:
        raise APIError(503, f"The server is busy: {worker.max_queue} requests are already waiting. "
                       "Try again shortly.", type=SERVER_ERROR, code="queue_full",
                       headers={"Retry-After": "1"}) from None
    except ShuttingDown:
        raise APIError(503, "The server is shutting down.", type=SERVER_ERROR, code="shutting_down") from None


def _sse(data) -> str:
    import json

    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _usage(stream) -> dict:
    usage = {"prompt_tokens": stream.prompt_tokens, "completion_tokens": stream.completion_tokens,
             "total_tokens": stream.prompt_tokens + stream.completion_tokens}
    cached = getattr(stream, "cached_tokens", 0)
    if cached:  # OpenAI's field for prompt tokens served from its prompt cache
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _timings(stream) -> dict:
    """Speeds measured by the server (an extension of the OpenAI response)."""
    return {"prompt_tokens_per_second": round(stream.prompt_tps, 2),
            "generation_tokens_per_second": round(stream.generation_tps, 2),
            "prompt_seconds": round(stream.prompt_seconds, 4),
            "generation_seconds": round(stream.generation_seconds, 4)}


class Generations:
    """Turns validated requests into worker jobs and jobs into OpenAI responses."""

    def __init__(self, model, tokenizer, worker: GenerationWorker, name: str, settings):
        self.model, self.tokenizer, self.worker, self.name, self.settings = model, tokenizer, worker, name, settings
        self.context = model.context_length

    def token_limit(self, prompt_tokens: int, requested: int | None) -> int:
        """New tokens allowed: what was asked (or the server's default), within the context length."""
        if self.context is None:
            return requested or self.settings.max_tokens
        room = self.context - prompt_tokens
        if room < 1:
            raise APIError(400, f"The prompt has {prompt_tokens} tokens; the model's context length is {self.context}.",
                           param="messages", code="context_length_exceeded")
        if requested is not None and requested > room:
            raise APIError(400, f"The prompt ({prompt_tokens} tokens) and max_tokens ({requested}) exceed the model's "
                           f"context length of {self.context} tokens.", param="max_tokens",
                           code="context_length_exceeded")
        return min(requested or self.settings.max_tokens, room)

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if not self.tokenizer.chat_template:
            raise APIError(400, f"The model {self.name} has no chat template; use /v1/completions.",
                           param="messages", code="no_chat_template")
        try:
            return render_conversation(self.tokenizer, [m.as_template_message() for m in body.messages],
                                       tools.tool_dicts(body), add_generation_prompt=True)
        except (ChatTemplateError, TypeError) as e:  # TypeError: e.g. a template adding a null content
            raise APIError(400, f"The chat template refused the conversation: {e}", param="messages",
                           code="invalid_conversation") from None

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        ids = self.tokenizer.encode(body.prompt)
        if not ids:
            raise APIError(400, "The prompt encodes to no tokens.", param="prompt", code="invalid_value")
        return ids

    def submit(self, body, prompt: list[int], constraint=None) -> Job:
        options = {"max_tokens": self.token_limit(len(prompt), body.token_limit), "temperature": body.temperature,
                   "top_p": body.top_p if body.top_p < 1 else None, "top_k": body.top_k or None, "seed": body.seed,
                   "stop": body.stop}
        if constraint is not None:
            options["processors"] = [constraint]
        job = Job(prompt, options, asyncio.get_running_loop())
        enqueue(self.worker, job)
        return job

    # -- responses -----------------------------------------------------------------------------
    def check_model(self, body):
        if body.model is not None and body.model != self.name:
            raise model_not_found(body.model, self.name)

    async def respond(self, request: Request, body, prompt: list[int], chat: bool):
        constraint = await asyncio.to_thread(tools.constraint, self.tokenizer, body)
        job = self.submit(body, prompt, constraint)
        calls = tools.ToolCallDeltas(output_format(self.tokenizer)) if chat and tools.parses_tool_calls(body) else None
        shape = _ChatShape(self.name, calls) if chat else _CompletionShape(self.name)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(request, job, shape, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, job, shape)

    async def _stream(self, request: Request, job: Job, shape, include_usage: bool):
        # The response also stops when sending fails; the watcher notices a client that leaves while
        # its job still waits in the queue (nothing is sent then).
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        try:
            first = shape.opening()
            if first is not None:
                yield _sse(first)
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    for chunk in shape.piece(value):
                        yield _sse(chunk)
                    continue
                if kind == "error":
                    yield _sse(error_body(value, SERVER_ERROR))
                elif value is None or value.finish_reason == CANCELLED:
                    if job.cancel_reason == "shutdown":
                        yield _sse(error_body("The server is shutting down; the answer was cut short.", SERVER_ERROR,
                                              code="shutting_down"))
                else:
                    for chunk in shape.closing(value.finish_reason):
                        yield _sse(chunk)
                    if include_usage:
                        yield _sse(shape.usage(value))
                break
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            job.cancel()  # nothing left to stop if it ended; stops the generation if the client left

    async def _whole(self, request: Request, job: Job, shape):
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        try:
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    continue
                if kind == "error":
                    raise APIError(500, value, type=SERVER_ERROR)
                if value is None or value.finish_reason == CANCELLED:
                    raise APIError(503, "The server is shutting down." if job.cancel_reason == "shutdown" else
                                   "The request was cancelled.", type=SERVER_ERROR, code="cancelled")
                return shape.whole(value)
        finally:
            watcher.cancel()
            job.cancel()


async def _cancel_on_disconnect(request: Request, job: Job):
    while not job.cancelled:
        if await request.is_disconnected():
            job.cancel("client")
            return
        await asyncio.sleep(DISCONNECT_POLL)


class _ChatShape:
    """``chat.completion`` / ``chat.completion.chunk`` objects (``piece`` and ``closing`` give lists of
    chunks); with ``tool_calls`` (a `metalnn.llm.server.tools.ToolCallDeltas`) the text is searched
    for tool calls."""

    def __init__(self, name, tool_calls=None):
        self.base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": name,
                     "system_fingerprint": f"metalnn-{__version__}"}
        self.tool_calls = tool_calls

    def _chunk(self, delta, finish_reason=None):
        return {**self.base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    def opening(self):
        return self._chunk({"role": "assistant", "content": ""})

    def piece(self, text):
        if self.tool_calls is None:
            return [self._chunk({"content": text})]
        return [self._chunk(delta) for delta in self.tool_calls.piece(text)]

    def closing(self, finish_reason):
        deltas = []
        if self.tool_calls is not None:
            deltas, finish_reason = self.tool_calls.finish(finish_reason)
        return [self._chunk(delta) for delta in deltas] + [self._chunk({}, finish_reason)]

    def usage(self, stream):
        return {**self.base, "object": "chat.completion.chunk", "choices": [], "usage": _usage(stream),
                "timings": _timings(stream)}

    def whole(self, stream):
        message, finish_reason = {"role": "assistant", "content": stream.text}, stream.finish_reason
        if self.tool_calls is not None:
            message, finish_reason = self.tool_calls.whole(stream.text, finish_reason)
        return {**self.base, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
                "usage": _usage(stream), "timings": _timings(stream)}


class _CompletionShape:
    """``text_completion`` objects (whole and as stream chunks)."""

    def __init__(self, name):
        self.base = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                     "model": name, "system_fingerprint": f"metalnn-{__version__}"}

    def _choice(self, text, finish_reason=None):
        return {**self.base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

    def opening(self):
        return None

    def piece(self, text):
        return [self._choice(text)]

    def closing(self, finish_reason):
        return [self._choice("", finish_reason)]

    def usage(self, stream):
        return {**self.base, "choices": [], "usage": _usage(stream), "timings": _timings(stream)}

    def whole(self, stream):
        return {**self._choice(stream.text, stream.finish_reason), "usage": _usage(stream), "timings": _timings(stream)}


def create_app(model, tokenizer, settings, name: str, draft_model=None) -> FastAPI:
    """The application serving ``model`` under the id ``name`` (see `metalnn.llm.server.ServerSettings`;
    ``draft_model``: a loaded model for ``settings.draft_model``).

    The generation worker starts with the application and stops with it.
    """
    prefix_cache = PrefixCache(settings.prompt_cache_bytes) if settings.prompt_cache_bytes else None
    metrics = ServerMetrics()
    drafter = None
    if draft_model is not None:
        drafter = DraftModel(draft_model)
    elif getattr(settings, "prompt_lookup", False):
        drafter = PromptLookup()
    worker = GenerationWorker(model, tokenizer, settings.max_queue, max_batch=settings.max_batch,
                              prefix_cache=prefix_cache, prefill_chunk=settings.prefill_chunk, drafter=drafter,
                              max_draft=getattr(settings, "max_draft", 4),
                              prompt_cache_dir=settings.prompt_cache_dir if prefix_cache is not None else None,
                              metrics=metrics)
    generations = Generations(model, tokenizer, worker, name, settings)
    embeddings = Embeddings(model, tokenizer, name, lambda job: enqueue(worker, job))
    api_key = getattr(settings, "api_key", None)
    page = chat_page(key_required=api_key is not None)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="metalnn", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker, app.state.metrics = worker, metrics
    errors.install(app)
    # the last added runs first: metrics see every answer (401s included); the key is checked
    # before a body is read
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if api_key is not None:
        app.add_middleware(APIKeyAuth, key=api_key)
    app.add_middleware(RequestMetrics, metrics=metrics, routes=app.router.routes)
    card = {"id": name, "object": "model", "created": started, "owned_by": "metalnn",
            "context_length": generations.context}

    @app.get("/", include_in_schema=False)
    async def index():
        return HTMLResponse(page)

    @app.get("/health")
    async def health():
        status = worker.status()
        if status["worker"] != "running":  # stopped (shutting down) or crashed: no answers to expect
            return JSONResponse({"status": "unavailable", "model": name, **status}, status_code=503)
        return {"status": "ok", "model": name, **status}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != name:
            raise model_not_found(model_id, name)
        return card

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        generations.check_model(body)
        return await generations.respond(request, body, generations.chat_prompt(body), chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        generations.check_model(body)
        return await generations.respond(request, body, generations.completion_prompt(body), chat=False)

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest):
        generations.check_model(body)
        return await embeddings.respond(body)

    return app

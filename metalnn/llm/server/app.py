"""The FastAPI application: the OpenAI API subset, the health check and the chat page.

Routes: ``GET /`` (the chat page), ``GET /health``, ``GET /metrics``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/embeddings``. Generation requests are validated and tokenized here, then handed to the
`GenerationWorker` (one job per choice when ``n`` > 1); answers stream back as server-sent events
(``data: {...}`` chunks, then ``data: [DONE]``) or come whole, with OpenAI's ``logprobs`` objects
when asked for (`metalnn.llm.server.logprobs`). A request naming a ``model`` other than the served
one gets 404 ``model_not_found`` (leaving ``model`` out is fine). With ``settings.api_key`` every
path but ``/`` and ``/health`` needs ``Authorization: Bearer KEY`` (`metalnn.llm.server.auth`).
Tool calls and constrained output (a request's grammar) are in `metalnn.llm.server.tools`. Named
LoRA adapters are served as models of their own (`metalnn.llm.server.adapters`): a request's
``model`` picks the adapter its job decodes with.
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
from ..sampling import SamplingParams
from ..text_generation import CANCELLED
from ..tool_prompt import output_format, render_conversation
from . import errors, tools
from .adapters import ServedModels
from .auth import APIKeyAuth
from .embeddings import EmbeddingRequest, Embeddings
from .errors import SERVER_ERROR, APIError, error_body
from .limits import BodyLimit
from .logprobs import CompletionLogprobs, TokenText, chat_logprobs
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


def _usage(streams) -> dict:
    """Token counts of a request's choices (the prompt counts once)."""
    prompt, completion = streams[0].prompt_tokens, sum(s.completion_tokens for s in streams)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = max(getattr(s, "cached_tokens", 0) for s in streams)
    if cached:  # OpenAI's field for prompt tokens served from its prompt cache
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _timings(streams) -> dict:
    """Speeds measured by the server (an extension of the OpenAI response); for several choices, the
    tokens of all over the time of all."""
    prompt_seconds = sum(s.prompt_seconds for s in streams)
    generation_seconds = sum(s.generation_seconds for s in streams)
    generated = sum(max(s.completion_tokens - 1, 0) for s in streams)
    prompt_tps = sum(s.prompt_tokens for s in streams) / prompt_seconds if prompt_seconds > 0 else 0.0
    return {"prompt_tokens_per_second": round(prompt_tps, 2),
            "generation_tokens_per_second": round(generated / generation_seconds if generation_seconds > 0 else 0.0,
                                                  2),
            "prompt_seconds": round(prompt_seconds, 4),
            "generation_seconds": round(generation_seconds, 4)}


class Generations:
    """Turns validated requests into worker jobs and jobs into OpenAI responses."""

    def __init__(self, model, tokenizer, worker: GenerationWorker, name: str, settings, models: ServedModels = None):
        self.model, self.tokenizer, self.worker, self.name, self.settings = model, tokenizer, worker, name, settings
        self.models = models or ServedModels(name)
        self.context = model.context_length
        self.vocab_size = model.vocab_size
        #: the checkpoint's generation_config.json (None: the shared defaults of metalnn.llm.sampling)
        self.generation_config = getattr(model, "generation_config", None)
        self.defaults = SamplingParams.from_generation_config(self.generation_config)
        self.token_text = TokenText(tokenizer)

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

    def sampling(self, body, index: int = 0) -> SamplingParams:
        """The `SamplingParams` of choice ``index`` of a request: the model's generation config, then
        the request's values (with a seed, choice ``i`` draws with ``seed + i``, so the ``n``
        choices differ and each is reproducible)."""
        overrides = body.sampling_overrides()
        if overrides.get("seed") is not None:
            overrides["seed"] += index
        bias = overrides.get("logit_bias") or {}
        outside = sorted(t for t in bias if t >= self.vocab_size)
        if outside:
            raise APIError(400, f"Invalid value for 'logit_bias': token ids must be below the vocabulary size "
                           f"{self.vocab_size} (got {outside}).", param="logit_bias", code="invalid_value")
        try:
            return SamplingParams.from_generation_config(self.generation_config, **overrides)
        except ValueError as e:  # e.g. a top_logprobs the schema allows but sampling does not
            field = str(e).partition(":")[0].removeprefix("SamplingParams.").partition("[")[0]
            raise APIError(400, f"Invalid value: {e}", param=field or None, code="invalid_value") from None

    def submit(self, body, prompt: list[int], constraints=None, adapter: str | None = None) -> list[Job]:
        """One worker job per choice (``n``; ``constraints``: each choice's grammar or None; ``adapter``:
        the LoRA adapter's name or None); all or none are queued."""
        limit = self.token_limit(len(prompt), body.token_limit)
        options = [{"max_tokens": limit, "sampling": self.sampling(body, i), "stop": body.stop, "adapter": adapter}
                   for i in range(body.choices)]
        for option, constraint in zip(options, constraints or ()):
            if constraint is not None:
                option["processors"] = [constraint]
        loop = asyncio.get_running_loop()
        jobs = []
        try:
            for option in options:
                job = Job(prompt, option, loop)
                enqueue(self.worker, job)
                jobs.append(job)
        except APIError:
            _cancel(jobs)
            raise
        return jobs

    # -- responses -----------------------------------------------------------------------------
    def check_model(self, body) -> str | None:
        """The LoRA adapter the request's ``model`` names (None: the base model); 404 for others."""
        return self.models.adapter(body.model)

    async def respond(self, request: Request, body, prompt: list[int], chat: bool, adapter: str | None = None):
        # a grammar holds per-sequence state: one per choice
        constraints = [await asyncio.to_thread(tools.constraint, self.tokenizer, body) for _ in range(body.choices)]
        jobs = self.submit(body, prompt, constraints, adapter)
        calls = None
        if chat and tools.parses_tool_calls(body):
            calls = [tools.ToolCallDeltas(output_format(self.tokenizer)) for _ in jobs]
        name = self.models.model_id(adapter)
        shape = (_ChatShape(name, self.token_text, calls) if chat else
                 _CompletionShape(name, self.token_text, len(body.prompt), len(jobs)))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(request, jobs, shape, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, jobs, shape)

    async def _stream(self, request: Request, jobs: list[Job], shape, include_usage: bool):
        # The response also stops when sending fails; the watcher notices a client that leaves while
        # its jobs still wait in the queue (nothing is sent then).
        watcher = asyncio.create_task(_cancel_on_disconnect(request, jobs))
        tokens = [[] for _ in jobs]  # each choice's token choices not sent yet (with logprobs)
        ended = [None] * len(jobs)
        try:
            for index in range(len(jobs)):
                first = shape.opening(index)
                if first is not None:
                    yield _sse(first)
            async for index, kind, value in _events(jobs):
                if kind == "tokens":
                    tokens[index] += value
                    continue
                if kind == "text":
                    for chunk in shape.piece(index, value, _take(tokens[index])):
                        yield _sse(chunk)
                    continue
                if kind == "error":
                    yield _sse(error_body(value, SERVER_ERROR))
                    break
                if value is None or value.finish_reason == CANCELLED:
                    if any(job.cancel_reason == "shutdown" for job in jobs):
                        yield _sse(error_body("The server is shutting down; the answer was cut short.", SERVER_ERROR,
                                              code="shutting_down"))
                    break
                ended[index] = value
                for chunk in shape.closing(index, value.finish_reason, _take(tokens[index])):
                    yield _sse(chunk)
            else:
                if include_usage:
                    yield _sse(shape.usage(ended))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            _cancel(jobs)  # nothing left to stop if they ended; stops the generation if the client left

    async def _whole(self, request: Request, jobs: list[Job], shape):
        watcher = asyncio.create_task(_cancel_on_disconnect(request, jobs))
        ended = [None] * len(jobs)
        try:
            async for index, kind, value in _events(jobs):
                if kind in ("text", "tokens"):
                    continue
                if kind == "error":
                    raise APIError(500, value, type=SERVER_ERROR)
                if value is None or value.finish_reason == CANCELLED:
                    shutdown = any(job.cancel_reason == "shutdown" for job in jobs)
                    raise APIError(503, "The server is shutting down." if shutdown else
                                   "The request was cancelled.", type=SERVER_ERROR, code="cancelled")
                ended[index] = value
            return shape.whole(ended)
        finally:
            watcher.cancel()
            _cancel(jobs)


def _cancel(jobs):
    for job in jobs:
        job.cancel()


def _take(items: list) -> list:
    """The items, emptying the list."""
    out = items[:]
    items.clear()
    return out


async def _events(jobs: list[Job]):
    """``(index, kind, value)`` of every job's events as they come, until each has ended."""
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(index, job):
        while True:
            kind, value = await job.events.get()
            merged.put_nowait((index, kind, value))
            if kind in ("end", "error"):
                return

    tasks = [asyncio.create_task(forward(i, job)) for i, job in enumerate(jobs)]
    try:
        running = len(jobs)
        while running:
            index, kind, value = await merged.get()
            running -= kind in ("end", "error")
            yield index, kind, value
    finally:
        for task in tasks:
            task.cancel()


async def _cancel_on_disconnect(request: Request, jobs: list[Job]):
    while not all(job.cancelled for job in jobs):
        if await request.is_disconnected():
            for job in jobs:
                job.cancel("client")
            return
        await asyncio.sleep(DISCONNECT_POLL)


class _ChatShape:
    """``chat.completion`` / ``chat.completion.chunk`` objects (``piece`` and ``closing`` give lists of
    chunks); with ``tool_calls`` (a `metalnn.llm.server.tools.ToolCallDeltas`) the text is searched
    for tool calls."""

    def __init__(self, name, token_text: TokenText, tool_calls=None):
        self.base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": name,
                     "system_fingerprint": f"metalnn-{__version__}"}
        self.token_text = token_text
        self.tool_calls = tool_calls  # one `ToolCallDeltas` per choice, or None

    def _chunk(self, index, delta, finish_reason=None, choices=None):
        logprobs = chat_logprobs(choices, self.token_text) if choices else None
        return {**self.base, "object": "chat.completion.chunk",
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def opening(self, index):
        return self._chunk(index, {"role": "assistant", "content": ""})

    def piece(self, index, text, choices=None):
        if self.tool_calls is None:
            return [self._chunk(index, {"content": text}, choices=choices)]
        deltas = self.tool_calls[index].piece(text)
        if not deltas:
            return [self._chunk(index, {}, choices=choices)] if choices else []
        return [self._chunk(index, d, choices=choices if i == 0 else None) for i, d in enumerate(deltas)]

    def closing(self, index, finish_reason, choices=None):
        deltas = []
        if self.tool_calls is not None:
            deltas, finish_reason = self.tool_calls[index].finish(finish_reason)
        return [self._chunk(index, d) for d in deltas] + [self._chunk(index, {}, finish_reason, choices)]

    def usage(self, streams):
        return {**self.base, "object": "chat.completion.chunk", "choices": [], "usage": _usage(streams),
                "timings": _timings(streams)}

    def whole(self, streams):
        out = []
        for i, s in enumerate(streams):
            message, finish_reason = {"role": "assistant", "content": s.text}, s.finish_reason
            if self.tool_calls is not None:
                message, finish_reason = self.tool_calls[i].whole(s.text, finish_reason)
            out.append({"index": i, "message": message, "finish_reason": finish_reason,
                        "logprobs": chat_logprobs(s.text_choices, self.token_text) if s.sampling.logprobs else None})
        return {**self.base, "object": "chat.completion", "choices": out, "usage": _usage(streams),
                "timings": _timings(streams)}


class _CompletionShape:
    """``text_completion`` objects (whole and as stream chunks)."""

    def __init__(self, name, token_text: TokenText, prompt_chars: int, n: int):
        self.base = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                     "model": name, "system_fingerprint": f"metalnn-{__version__}"}
        self.token_text, self.prompt_chars = token_text, prompt_chars
        self.logprobs = [CompletionLogprobs(token_text, prompt_chars) for _ in range(n)]

    def _choice(self, index, text, finish_reason=None, choices=None):
        logprobs = self.logprobs[index].chunk(choices) if choices else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self, index):
        return None

    def piece(self, index, text, choices=None):
        return [{**self.base, "choices": [self._choice(index, text, choices=choices)]}]

    def closing(self, index, finish_reason, choices=None):
        return [{**self.base, "choices": [self._choice(index, "", finish_reason, choices)]}]

    def usage(self, streams):
        return {**self.base, "choices": [], "usage": _usage(streams), "timings": _timings(streams)}

    def whole(self, streams):
        choices = [self._choice(i, s.text, s.finish_reason, s.text_choices if s.sampling.logprobs else None)
                   for i, s in enumerate(streams)]
        return {**self.base, "choices": choices, "usage": _usage(streams), "timings": _timings(streams)}


def create_app(model, tokenizer, settings, name: str, draft_model=None, adapters=None, group=None) -> FastAPI:
    """The application serving ``model`` under the id ``name`` (see `metalnn.llm.server.ServerSettings`;
    ``draft_model``: a loaded model for ``settings.draft_model``; ``adapters``: the
    `metalnn.llm.tuner.multi_lora.AdapterRows` of the named LoRA adapters installed in ``model``, each
    served as the model id of its name; ``group``: the ``mx.distributed`` group ``model`` is split over,
    this process being its rank 0, see `metalnn.llm.server.lockstep`: no embeddings, and the prefix
    cache in memory only).

    The generation worker starts with the application and stops with it.
    """
    prefix_cache = PrefixCache(settings.prompt_cache_bytes) if settings.prompt_cache_bytes else None
    metrics = ServerMetrics()
    if prefix_cache is not None:
        metrics.watch_prefix_cache(prefix_cache)
    drafter = None
    if draft_model is not None:
        drafter = DraftModel(draft_model)
    elif getattr(settings, "prompt_lookup", False):
        drafter = PromptLookup()
    worker = GenerationWorker(model, tokenizer, settings.max_queue, max_batch=settings.max_batch,
                              prefix_cache=prefix_cache, prefill_chunk=settings.prefill_chunk, drafter=drafter,
                              max_draft=getattr(settings, "max_draft", 4),
                              prompt_cache_dir=settings.prompt_cache_dir if prefix_cache is not None else None,
                              metrics=metrics, adapters=adapters, group=group)
    models = ServedModels(name, dict.fromkeys(adapters.names) if adapters is not None else None)
    generations = Generations(model, tokenizer, worker, name, settings, models)
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
            "context_length": generations.context, "sampling_defaults": generations.defaults.describe()}

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
        return {"object": "list", "data": models.cards(card)}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        return models.card(model_id, card)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        adapter = generations.check_model(body)
        return await generations.respond(request, body, generations.chat_prompt(body), chat=True, adapter=adapter)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        adapter = generations.check_model(body)
        return await generations.respond(request, body, generations.completion_prompt(body), chat=False,
                                         adapter=adapter)

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest):
        if generations.check_model(body) is not None:
            raise APIError(400, f"Embeddings come from the base model '{name}'; the adapter '{body.model}' only "
                           "changes generated text.", param="model", code="invalid_value")
        if group is not None:
            raise APIError(400, f"The model '{name}' is split over {group.size()} processes; this server makes no "
                           "embeddings with it (serve it from one process for /v1/embeddings).",
                           param="model", code="unsupported")
        return await embeddings.respond(body)

    return app

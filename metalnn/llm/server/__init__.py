"""An OpenAI-compatible HTTP server for one model, with a chat page (``metalnn serve MODEL``).

Endpoints:

* ``GET /``: a self-contained chat page (no external resources) that talks to the streaming
  endpoint below;
* ``GET /v1/models``: the model served (and each named LoRA adapter, see below);
* ``POST /v1/chat/completions``: ``messages`` through the model's chat template;
* ``POST /v1/completions``: a plain ``prompt``;
* ``POST /v1/embeddings``: the model's final hidden states, mean-pooled and L2-normalised;
* ``GET /health``: ``{"status": "ok", ...}`` with the worker's state, the queue's and request counts
  and the prefix cache's size (503 and ``"unavailable"`` once the worker has stopped);
* ``GET /metrics``: Prometheus metrics (`metalnn.llm.server.metrics`).

With an API key (``ServerSettings.api_key``), every path but ``/`` and ``/health`` answers 401 unless
the request sends ``Authorization: Bearer KEY``; the chat page then asks for the key. A request for a
model other than the one served gets 404 ``model_not_found``.

LoRA adapters (PEFT folders, `metalnn.llm.tuner.adapters`): ``ServerSettings.adapter`` is merged into
the model for every request; each of ``ServerSettings.adapters`` (``{NAME: folder}``) is served as the
model id ``NAME`` (listed by ``/v1/models`` with ``"parent"``: the base model), and requests for
different adapters and for the base model decode in the same batch
(`metalnn.llm.tuner.multi_lora`, `metalnn.llm.server.adapters`).

Both generation endpoints take ``max_tokens`` (chat also ``max_completion_tokens``),
``temperature``, ``top_p``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``seed``,
``n`` (up to 8 choices), ``logprobs`` (chat: with ``top_logprobs``), ``stop`` (up to 4 strings),
``stream`` (server-sent events ending with ``data: [DONE]``) and ``stream_options.include_usage``,
plus the extensions ``top_k``, ``min_p`` and ``repetition_penalty`` (`metalnn.llm.sampling`); a
null or missing sampling value takes the model's ``generation_config.json`` value, else
`metalnn.llm.sampling.DEFAULT_TEMPERATURE` (shown as ``sampling_defaults`` in ``/v1/models``). They
answer with ``usage`` counts (plus ``timings``: the server's measured speeds). Chat also takes
``tools`` and ``tool_choice`` (calls come back as ``tool_calls``) and ``response_format`` (JSON,
or JSON following a schema); both take ``grammar`` (an extension: a Lark grammar in llguidance's
syntax the output must follow). See `metalnn.llm.server.tools`.

One worker thread generates every request together (continuous batching: up to ``max_batch``
requests decode in one batched step, new ones join between steps, long prompts are run in chunks
between steps; see `metalnn.llm.server.worker`). Prompts that begin as an earlier one did (a chat's
next turn) start from its cached keys and values (`metalnn.llm.prefix_cache`). Up to ``max_queue``
requests wait for a row, more are answered 503. A client that disconnects cancels its generation. Bad
requests get a 4xx with an OpenAI-style ``{"error": {...}}`` body. SIGTERM (or Ctrl-C) stops the
server cleanly: running answers are cut short, the worker stops, the process exits with status 0.

Built on FastAPI (routes, request validation with pydantic) and uvicorn (the HTTP server).
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .app import create_app

__all__ = ["ServerSettings", "create_app", "serve"]


@dataclass
class ServerSettings:
    """How `serve` runs.

    Attributes:
        host, port: where to listen (127.0.0.1: this machine only; port 0 picks a free port).
        model_name: the model's id in the API (default: the checkpoint's file or folder name).
        max_queue: requests that may wait for a row of the batch; more get HTTP 503.
        max_batch: requests decoded together (continuous batching).
        prefill_chunk: prompt tokens run per step while other requests decode.
        prompt_cache_bytes: memory for the prefix cache (0: off).
        prompt_cache_dir: a folder where the prefix cache is kept between runs (None: memory only).
        draft_model: a smaller model with the same vocabulary that drafts tokens for speculative
            decoding of greedy requests (anything `load_pretrained` takes; None: no draft model).
        prompt_lookup: draft tokens from the request's own text instead (prompt-lookup decoding).
        max_draft: the most draft tokens checked per request and step.
        max_tokens: new tokens for a request that does not say (always within the context length).
        max_body_bytes: largest request body; larger ones get HTTP 413.
        log_level: uvicorn's log level.
        api_key: the key clients must send (``Authorization: Bearer KEY``); None: no key needed.
        adapter: a LoRA adapter folder applied to every request (None: none).
        adapters: named LoRA adapter folders ``{NAME: folder}``, each served as the model id ``NAME``.
        split: how a run started by ``mlx.launch`` splits the model over its ranks (``"pipeline"`` or
            ``"tensor"``, see `serve`).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    model_name: str | None = None
    max_queue: int = 16
    max_batch: int = 8
    prefill_chunk: int = 256
    prompt_cache_bytes: int = 1 << 30
    prompt_cache_dir: str | None = None
    draft_model: str | None = None
    prompt_lookup: bool = False
    max_draft: int = 4
    max_tokens: int = 1024
    max_body_bytes: int = 1 << 20
    log_level: str = "info"
    api_key: str | None = None
    adapter: str | None = None
    adapters: dict = field(default_factory=dict)
    split: str = "pipeline"


def model_name(source) -> str:
    """The API id of a checkpoint: a Hub name as it is, else the file or folder name."""
    path = Path(str(source))
    if path.exists():
        return path.resolve().name
    return str(source)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server; an exit signal also cuts running answers short, so shutdown is quick."""

        def __init__(self, config, worker):
            super().__init__(config)
            self.worker = worker

        def handle_exit(self, sig, frame):
            self.worker.cancel_all()
            super().handle_exit(sig, frame)

    return Server


def _quietly(signum, frame):
    """Handler uvicorn re-raises a captured exit signal to after its clean shutdown: the process then
    ends normally (status 0) instead of being killed by the signal."""


def prepare_adapters(model, settings: ServerSettings, name: str):
    """Apply ``settings.adapter`` to ``model`` and install ``settings.adapters``; returns their
    `metalnn.llm.tuner.multi_lora.AdapterRows` (None without named adapters). Every folder is read
    and checked against the model before the server starts."""
    from ..tuner.adapters import read_adapter, use_adapter
    from ..tuner.multi_lora import install_adapters
    from .adapters import check_adapter_name

    named = {check_adapter_name(n, name): read_adapter(folder) for n, folder in settings.adapters.items()}
    if settings.adapter:
        use_adapter(model, settings.adapter)
    return install_adapters(model, named) if named else None


def serve(model, settings: ServerSettings | None = None, *, announce=None, group=None):
    """Load ``model`` (anything `metalnn.llm.models.load_pretrained` takes) and serve it until SIGTERM
    or Ctrl-C.

    ``announce(url)`` is called once the socket listens (default: a line on stdout naming the URL,
    with the real port when ``port`` is 0).

    With ``group`` (the ``mx.distributed`` group of a run started by ``mlx.launch``), the model is split
    over its ranks as ``settings.split`` says; rank 0 serves, the others follow its batch until it
    stops (`metalnn.llm.server.lockstep`), and a rank that dies ends the others
    (`metalnn.llm.distributed.watch_peers`). A draft model, adapters, a prefix cache on disk and
    embeddings are refused over a split model.
    """
    import uvicorn

    from ..models import load_pretrained, load_tokenizer

    settings = settings or ServerSettings()
    split = {}
    if group is not None:
        if settings.split not in ("pipeline", "tensor"):
            raise ValueError(f"ServerSettings.split: expected 'pipeline' or 'tensor', got {settings.split!r}")
        if settings.draft_model or settings.adapter or settings.adapters or settings.prompt_cache_dir:
            raise ValueError("a model split over ranks is served without a draft model, LoRA adapters or a "
                             "prefix cache on disk (--draft-model, --adapter, --prompt-cache-dir)")
        split = {settings.split: group}
        from ..distributed import watch_peers

        watch_peers(group)
    loaded = load_pretrained(model, **split)
    if group is not None and group.rank() != 0:
        from .lockstep import follow

        follow(loaded, group)
        return
    try:
        tokenizer = load_tokenizer(model)
    except FileNotFoundError:
        raise FileNotFoundError(f"{model}: the model has no tokenizer (tokenizer.json, or a .gguf file's "
                                "vocabulary); the server needs one") from None
    name = settings.model_name or model_name(model)
    draft = load_pretrained(settings.draft_model) if settings.draft_model else None
    if draft is not None and draft.vocab_size != loaded.vocab_size:
        raise ValueError(f"--draft-model {settings.draft_model}: its vocabulary has {draft.vocab_size} tokens, the "
                         f"model's {loaded.vocab_size}; a draft model must share the model's tokenizer")
    adapters = prepare_adapters(loaded, settings, name)
    app = create_app(loaded, tokenizer, settings, name, draft_model=draft, adapters=adapters, group=group)
    sock = _listen(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    if announce is None:
        needs_key = " (API key required)" if settings.api_key is not None else ""
        print(f"metalnn serve: {name} at {url}/ (chat page), OpenAI API at {url}/v1{needs_key}", flush=True)
    else:
        announce(url)
    config = uvicorn.Config(app, log_level=settings.log_level, lifespan="on", timeout_graceful_shutdown=10)
    server = _server_class()(config, app.state.worker)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _quietly) for s in (signal.SIGTERM, signal.SIGINT)} if in_main else {}
    try:
        server.run(sockets=[sock])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sock.close()
    sys.stdout.flush()

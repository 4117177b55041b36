"""Prometheus metrics of the server (``GET /metrics``): `ServerMetrics` and the `RequestMetrics` middleware.

Built on ``prometheus_client``; each `ServerMetrics` owns its own ``CollectorRegistry``, so several
applications in one process (tests) keep separate counts. Names, all prefixed ``metalnn_``:

* ``requests_total{endpoint, status}``: HTTP requests answered (``endpoint``: the route's path
  template, ``other`` for paths no route knows; ``status``: the HTTP status code);
* ``request_duration_seconds{endpoint}``: histogram of the time from a request's arrival to the
  last byte of its answer (a streamed answer's whole stream);
* ``prompt_tokens_total``, ``generation_tokens_total``: tokens read (generation prompts and
  embedding inputs) and generated;
* ``time_to_first_token_seconds``: histogram of the time from a generation request's arrival
  (queueing included) to its first new token;
* ``queue_depth``: requests waiting for the worker; ``running_sequences``: sequences being decoded
  (the batch size);
* ``prefix_cache_hit_tokens_total``: prompt tokens whose keys and values came from the prefix cache
  instead of being computed;
* ``prefix_cache_bytes``, ``prefix_cache_entries``: the prefix cache's size now (read when scraped;
  the bytes stay within ``--prompt-cache-mb``).

The worker reports through the methods (`ServerMetrics.tokens`, `first_token`, `queue_depth`,
`running`, `prefix_cache_hit`), the application binds the prefix cache (`watch_prefix_cache`);
`RequestMetrics` calls `request_finished` for every request.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.routing import Match

#: seconds: from fast refusals to long generations
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: seconds: prefill of a short prompt on a fast machine to a long queue on a slow one
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: the ``endpoint`` label of paths that no route matches
OTHER = "other"


class ServerMetrics:
    """The server's counters, gauges and histograms, in a registry of their own (``registry``).

    Args:
        namespace: the prefix of every metric name.
    """

    def __init__(self, namespace: str = "metalnn"):
        self.registry = CollectorRegistry()
        kw = {"namespace": namespace, "registry": self.registry}
        self._requests = Counter("requests", "HTTP requests answered, by endpoint and status code",
                                 ["endpoint", "status"], **kw)
        self._latency = Histogram("request_duration_seconds", "Seconds from a request's arrival to the end of "
                                  "its answer (a streamed answer's whole stream)", ["endpoint"],
                                  buckets=LATENCY_BUCKETS, **kw)
        self._prompt = Counter("prompt_tokens", "Tokens read by the model (generation prompts and embedding inputs)",
                               **kw)
        self._generated = Counter("generation_tokens", "Tokens generated", **kw)
        self._first = Histogram("time_to_first_token_seconds", "Seconds from a generation request's arrival "
                                "(queueing included) to its first new token", buckets=FIRST_TOKEN_BUCKETS, **kw)
        self._queue = Gauge("queue_depth", "Requests waiting for the worker", **kw)
        self._running = Gauge("running_sequences", "Sequences being decoded (the batch size)", **kw)
        self._prefix = Counter("prefix_cache_hit_tokens", "Prompt tokens whose keys and values came from the prefix "
                               "cache", **kw)
        self._cache_bytes = Gauge("prefix_cache_bytes", "Bytes of keys and values kept by the prefix cache", **kw)
        self._cache_entries = Gauge("prefix_cache_entries", "Sequences kept by the prefix cache", **kw)

    # -- what the application and the worker report -------------------------------------------
    def request_finished(self, endpoint: str, status: int, seconds: float):
        """One HTTP request answered with ``status`` after ``seconds``."""
        self._requests.labels(endpoint=endpoint, status=str(int(status))).inc()
        self._latency.labels(endpoint=endpoint).observe(max(0.0, float(seconds)))

    def tokens(self, prompt: int = 0, generated: int = 0):
        """``prompt`` tokens read and ``generated`` tokens made (by one request, or one step of a batch)."""
        if prompt:
            self._prompt.inc(int(prompt))
        if generated:
            self._generated.inc(int(generated))

    def first_token(self, seconds: float):
        """A generation's first new token came ``seconds`` after its request arrived."""
        self._first.observe(max(0.0, float(seconds)))

    def queue_depth(self, n: int):
        """``n`` requests wait for the worker now."""
        self._queue.set(int(n))

    def running(self, n: int):
        """``n`` sequences are being decoded now."""
        self._running.set(int(n))

    def prefix_cache_hit(self, tokens: int):
        """``tokens`` prompt tokens were found in the prefix cache (not computed again)."""
        if tokens:
            self._prefix.inc(int(tokens))

    def watch_prefix_cache(self, cache):
        """Report ``cache``'s (a `metalnn.llm.prefix_cache.PrefixCache`) size whenever the metrics are read."""
        self._cache_bytes.set_function(lambda: cache.nbytes)
        self._cache_entries.set_function(lambda: len(cache))

    # -- exposition ----------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """``(body, content type)`` of the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def route_path(routes, scope) -> str:
    """The path template of the route that answers ``scope`` (``/v1/models/{model_id:path}``), or `OTHER`."""
    for route in routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:  # a PARTIAL match is the route with another method (answered 405)
            return getattr(route, "path", OTHER)
    return OTHER


class RequestMetrics:
    """ASGI middleware: `ServerMetrics.request_finished` for every HTTP request, once its answer has
    been sent (or the application has failed: status 500; or the client left: the status sent).

    Args:
        app: the application measured.
        metrics: the `ServerMetrics`.
        routes: the application's routes (``app.router.routes``, read at each request: routes added
            later count), to label requests by route instead of raw path.
    """

    def __init__(self, app, metrics: ServerMetrics, routes):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        endpoint = route_path(self.routes, scope)
        status, done = 500, False

        def finish():
            nonlocal done
            if not done:
                done = True
                self.metrics.request_finished(endpoint, status, time.perf_counter() - start)

        async def measured_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finish()

        try:
            await self.app(scope, receive, measured_send)
        finally:
            finish()

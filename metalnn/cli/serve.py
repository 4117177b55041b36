"""``metalnn serve MODEL``: the OpenAI-compatible HTTP server and its chat page (`metalnn.llm.server`)."""

from __future__ import annotations

import os

from .common import CommandError, add_product_inputs, add_model, add_split, positive_int


def add_parser(commands):
    p = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API with a chat page",
                            description=(
        "Serve one model over HTTP: GET /v1/models, POST /v1/chat/completions and /v1/completions (streaming "
        "or not), POST /v1/embeddings, GET /health, GET /metrics (Prometheus) and a chat page at /. Requests are "
        "decoded together (continuous batching); prompts that begin as an earlier one did reuse its cached "
        "computation; past the queue the server answers 503. With an API key (--api-key, --api-key-file or the "
        "environment variable METALNN_API_KEY, in that order) every path but / and /health answers 401 without "
        "'Authorization: Bearer KEY'; the chat page asks for it."))
    add_model(p)
    add_product_inputs(p)
    add_split(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    p.add_argument("--model-name", metavar="NAME", help="the model's id in the API (default: the file or folder name)")
    p.add_argument("--max-queue", type=positive_int, default=16, metavar="N",
                   help="requests that may wait for a row of the batch (default 16); more get HTTP 503")
    p.add_argument("--max-batch", type=positive_int, default=8, metavar="N",
                   help="requests decoded together in one batched step (default 8)")
    p.add_argument("--prefill-chunk", type=positive_int, default=256, metavar="N",
                   help="prompt tokens run per step while other requests decode (default 256)")
    p.add_argument("--prompt-cache-mb", type=int, default=1024, metavar="MB",
                   help="memory for cached prompt prefixes, reused by prompts that begin the same way "
                        "(default 1024; 0 turns the cache off)")
    p.add_argument("--draft-model", metavar="MODEL",
                   help="a smaller model with the same tokenizer that drafts tokens for speculative decoding of "
                        "greedy requests (the answers are the same, several tokens per step when drafts are right)")
    p.add_argument("--prompt-lookup", action="store_true",
                   help="draft tokens from the request's own text instead (pays off when answers quote their input)")
    p.add_argument("--max-draft", type=positive_int, default=4, metavar="N",
                   help="the most draft tokens checked per request and step (default 4)")
    p.add_argument("--prompt-cache-dir", metavar="DIR",
                   help="keep the prompt cache in this folder between runs (read at start, written at exit)")
    p.add_argument("--max-tokens", type=positive_int, default=1024, metavar="N",
                   help="new tokens of a request that gives no max_tokens (default 1024)")
    p.add_argument("--max-body-bytes", type=positive_int, default=1 << 20, metavar="N",
                   help="largest request body (default 1 MiB); larger ones get HTTP 413")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", metavar="KEY",
                     help="the key clients must send as 'Authorization: Bearer KEY' (other users of this machine "
                          "can see a command line: prefer --api-key-file or METALNN_API_KEY)")
    key.add_argument("--api-key-file", metavar="FILE", help="read the API key from the first line of FILE")
    p.add_argument("--adapter", action="append", default=[], metavar="[NAME=]DIR",
                   help="a LoRA adapter folder (PEFT's adapter_config.json + adapter_model.safetensors, from "
                        "'metalnn lora' or PEFT). NAME=DIR serves it as the model id NAME (listed by /v1/models; a "
                        "request's model picks it; requests for several adapters and the base model are decoded "
                        "together); a bare DIR applies it to every request. Repeatable (one bare DIR at most)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="server log level (default info)")
    p.set_defaults(run=run)


def adapter_options(values) -> tuple:
    """``(DIR or None, {NAME: DIR})`` of the ``--adapter`` values: ``NAME=DIR`` names one (an existing
    folder whose own name holds '=' stays a bare DIR), a bare DIR applies to every request."""
    bare, named = None, {}
    for value in values:
        name, sep, folder = value.partition("=")
        if not sep or os.path.isdir(value):
            if bare is not None:
                raise CommandError(f"--adapter {value}: a second adapter for every request (the first: {bare}); "
                                   "name them (--adapter NAME=DIR) to serve several")
            bare = value
            continue
        if not name or not folder:
            raise CommandError(f"--adapter {value}: expected NAME=DIR or DIR")
        if name in named:
            raise CommandError(f"--adapter {value}: the name {name!r} is given twice")
        named[name] = folder
    return bare, named


def run(args):
    from .common import launch_group

    group = launch_group()
    from ..llm.server import ServerSettings, serve
    from ..llm.server.auth import load_api_key

    settings = ServerSettings(host=args.host, port=args.port, model_name=args.model_name, max_queue=args.max_queue,
                              max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                              prompt_cache_bytes=max(0, args.prompt_cache_mb) << 20,
                              prompt_cache_dir=args.prompt_cache_dir, draft_model=args.draft_model,
                              prompt_lookup=args.prompt_lookup, max_draft=args.max_draft,
                              max_tokens=args.max_tokens, max_body_bytes=args.max_body_bytes,
                              log_level=args.log_level, api_key=load_api_key(args.api_key, args.api_key_file),
                              split=args.split)
    settings.adapter, settings.adapters = adapter_options(args.adapter)
    serve(args.model, settings, group=group)

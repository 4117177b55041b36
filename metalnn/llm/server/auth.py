"""API keys: `APIKeyAuth`, ASGI middleware that answers 401 unless ``Authorization: Bearer KEY`` is sent,
and `load_api_key`, which finds the key the server was given.

With a key, every path but the open ones (``/``: the chat page, which asks for the key itself; ``/health``)
needs it: the ``/v1`` API, ``/metrics``, and paths that do not exist (so they reveal nothing either).
A missing or wrong key gets OpenAI's answer: HTTP 401, ``WWW-Authenticate: Bearer`` and
``{"error": {"message", "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}``.
Keys are compared with `hmac.compare_digest` (the time taken does not depend on where they differ).
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from fastapi.responses import JSONResponse

from .errors import error_body

#: paths answered without a key
OPEN_PATHS = frozenset({"/", "/health"})
#: the environment variable `load_api_key` falls back to
ENV_VAR = "METALNN_API_KEY"


def check_key(key: str, source: str) -> str:
    """``key`` if it can be sent in an HTTP header: printable ASCII without spaces, not empty.
    Raises ValueError naming ``source`` (where the key came from) otherwise."""
    if not key:
        raise ValueError(f"{source}: the API key is empty")
    if not all("!" <= c <= "~" for c in key):
        raise ValueError(f"{source}: the API key must be printable ASCII without spaces (it is sent in the "
                         f"Authorization header), got {len(key)} characters with others")
    return key


def load_api_key(key: str | None = None, key_file=None, environ=None) -> str | None:
    """The server's API key: ``key``, else the first line of ``key_file`` (surrounding whitespace
    removed), else the environment variable ``METALNN_API_KEY``; None when none is given (no key:
    every path is open).

    Raises:
        ValueError: both ``key`` and ``key_file`` given, or a key that is empty or not printable ASCII.
        OSError: ``key_file`` cannot be read.
    """
    if key is not None and key_file is not None:
        raise ValueError("give the API key once: --api-key or --api-key-file, not both")
    if key is not None:
        return check_key(key, "--api-key")
    if key_file is not None:
        lines = Path(key_file).read_text(encoding="utf-8").strip().splitlines()
        return check_key(lines[0].strip() if lines else "", str(key_file))
    value = (os.environ if environ is None else environ).get(ENV_VAR)
    return check_key(value.strip(), ENV_VAR) if value is not None else None


def bearer_token(header: bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer TOKEN`` header value (the scheme in any case)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None


class APIKeyAuth:
    """ASGI middleware: requests to paths outside ``open_paths`` need ``Authorization: Bearer key``.

    Args:
        app: the application it guards.
        key: the API key (see `check_key`).
        open_paths: paths answered without a key.
    """

    def __init__(self, app, key: str, open_paths=OPEN_PATHS):
        self.app, self.key, self.open_paths = app, check_key(key, "APIKeyAuth").encode("ascii"), frozenset(open_paths)

    def allows(self, header: bytes | None) -> bool:
        token = bearer_token(header)
        # compare_digest takes time independent of where the two differ (its length may still tell)
        return token is not None and hmac.compare_digest(token, self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization")
        if self.allows(header):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided." if bearer_token(header) is not None else
                   "Missing API key: send it in the header 'Authorization: Bearer KEY'.")
        response = JSONResponse(error_body(message, code="invalid_api_key"), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

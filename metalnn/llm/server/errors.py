"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

Every error the server sends has this body, so clients (the ``openai`` library among them) can
show the message: validation problems (400), unknown paths (404), wrong methods (405), bodies over
the size limit (413), a full queue (503) and unexpected failures (500, without internals).
"""

from __future__ import annotations

import logging
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("metalnn.llm.server")

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error response: HTTP ``status`` and the fields of the OpenAI error object."""

    def __init__(self, status: int, message: str, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


#: the parts pydantic adds to an error's location for the member of a union that was tried
#: (``str``, ``list[TextPart]``, ``NamedToolChoice``, ``function-after[...]``): types, not fields
#: (the request fields are all lower case)
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|(list|dict|set|tuple|literal|function-\w+)\[.*\]|[A-Z]\w*)$")


def _param(loc) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"`` (a union's member left out:
    ``("body", "messages", 0, "content", "str")`` -> ``"messages[0].content"``)."""
    text = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, str) and _UNION_MEMBER.match(part):
            continue
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or None


def _describe(error: dict) -> tuple[str, str | None, str]:
    """(message, param, code) for one pydantic error of a request body."""
    loc, kind = tuple(error.get("loc", ())), error.get("type", "")
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON ({detail}).", None, "invalid_json"
    param = _param(loc)
    text = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if param is None:
        if kind == "missing":
            return "The request body is empty; send a JSON object.", None, "invalid_body"
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            return ("The request body must be a JSON object (and the Content-Type application/json).", None,
                    "invalid_body")
        return f"Invalid request: {text}.", None, "unsupported_parameter"
    if kind == "missing":
        return f"Missing required parameter '{param}'.", param, "missing_parameter"
    if kind == "extra_forbidden":
        return f"Unsupported parameter '{param}'.", param, "unsupported_parameter"
    given = repr(error.get("input"))
    given = given if len(given) <= 80 else given[:77] + "..."
    return f"Invalid value for '{param}': {text} (got {given}).", param, "invalid_value"


async def on_validation_error(request: Request, exc: RequestValidationError):
    errors = exc.errors()
    message, param, code = _describe(errors[0]) if errors else ("Invalid request.", None, "invalid_value")
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more problem{'s' if len(errors) > 2 else ''} in the request.)"
    return APIError(400, message, param=param, code=code).response()


async def on_api_error(request: Request, exc: APIError):
    return exc.response()


async def on_http_error(request: Request, exc: HTTPException):
    kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
    message = {404: f"No such path: {request.method} {request.url.path}.",
               405: f"Method {request.method} is not allowed on {request.url.path}."}.get(exc.status_code,
                                                                                       str(exc.detail))
    return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=exc.headers)


async def on_unexpected_error(request: Request, exc: Exception):
    log.exception("unexpected error while answering %s %s", request.method, request.url.path)
    return JSONResponse(error_body("The server failed to answer this request.", SERVER_ERROR), status_code=500)


def install(app):
    """Register the handlers that turn every error into an OpenAI-style body."""
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)

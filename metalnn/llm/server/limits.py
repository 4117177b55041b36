"""`BodyLimit`: ASGI middleware that refuses request bodies over a size limit (HTTP 413).

Neither Starlette nor uvicorn limits body sizes. A declared ``Content-Length`` over the limit is
refused before anything is read; otherwise the body is read up to the limit (chunked uploads
included) and handed to the application whole.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from .errors import error_body


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, int(max_bytes)

    async def _refuse(self, scope, receive, send, message):
        response = JSONResponse(error_body(message, code="request_too_large"), status_code=413,
                                headers={"Connection": "close"})
        await response(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        limit = f"The request body is over the server's limit of {self.max_bytes} bytes."
        if declared is not None:
            if not declared.isdigit():
                return await self._refuse(scope, receive, send, "Invalid Content-Length header.")
            if int(declared) > self.max_bytes:
                return await self._refuse(scope, receive, send, limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, delivered = b"".join(chunks), False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later messages (a disconnect) come from the connection

        await self.app(scope, replay, send)

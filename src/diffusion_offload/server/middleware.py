"""ASGI middleware: the API key, refusal of new work while shutting down, the body-size limit."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from .errors import APIError
from .state import ServerState

__all__ = ["GuardMiddleware"]

_BODY_METHODS = ("POST", "PUT", "PATCH")


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class GuardMiddleware:
    """API key on ``/v1/``, refusal of new work while shutting down, and the body-size limit.

    The body is read here (at most ``max_body_bytes`` kept) and replayed to the app; an
    oversized body is drained (up to a cap) before the 413 so the client reads the answer.
    """

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Check the request; answer 401/413/503 or pass it on with its body replayed."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings = self.state.settings
        path = scope.get("path", "")
        method = scope.get("method", "GET")
        if settings.api_key is not None and (path == "/v1" or path.startswith("/v1/")):
            auth = _header(scope, b"authorization") or ""
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), settings.api_key.encode()
            ):
                message = (
                    "Incorrect API key provided."
                    if auth
                    else "Missing bearer token: send 'Authorization: Bearer KEY'."
                )
                await APIError(
                    401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
                ).response()(scope, receive, send)
                return
        if method not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        if self.state.shutting_down:
            await APIError(503, "The server is shutting down.", code="shutting_down").response()(
                scope, receive, send
            )
            return
        limit = settings.max_body_bytes
        declared = _header(scope, b"content-length")
        try:
            length = int(declared) if declared is not None else None
            if length is not None and length < 0:
                raise ValueError
        except ValueError:
            await APIError(
                400, f"Invalid Content-Length {declared!r}.", code="invalid_content_length"
            ).response()(scope, receive, send)
            return
        cap = max(8 * limit, 16 << 20)  # drain at most this much of an oversized body
        too_large = APIError(
            413,
            f"Request body too large: the limit is {limit} bytes (--max-body-bytes).",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        if length is not None and length > cap:
            await too_large.response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        total = 0
        over = length is not None and length > limit
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total > limit:
                over = True
            if not over:
                chunks.append(body)
            if not message.get("more_body", False) or total > cap:
                break
        if over:
            await too_large.response()(scope, receive, send)
            return
        data = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

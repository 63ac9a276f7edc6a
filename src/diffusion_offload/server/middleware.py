"""ASGI middleware: Host and Origin checks, the API key, refusal of new work while shutting
down, the body-size limit.

Cross-site protection (a web page the user visits must not reach a local server):

- ``Host``: when the server is bound to a loopback address, only the bound address,
  ``localhost`` and ``--allowed-hosts`` are accepted (a DNS-rebinding page sends its own
  host name). Bound elsewhere, ``--allowed-hosts`` (when given) is enforced.
- ``Origin``: a request that carries one (browsers do for cross-origin and for POST
  requests) must come from the server itself (``Origin`` matches ``Host``) or from
  ``--allowed-origins``; ``Origin: null`` is foreign. Without ``Origin``,
  ``Sec-Fetch-Site: cross-site`` is refused too. Clients such as curl send neither.

Refusals answer 403 with the error envelope and never reach the app.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from .errors import APIError
from .state import BaseServerState

__all__ = ["GuardMiddleware", "InternalErrorMiddleware", "key_matches"]

logger = logging.getLogger("diffusion_offload.server")

_BODY_METHODS = ("POST", "PUT", "PATCH")


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


_LOCAL_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    name = host.strip("[]").lower()
    if name in _LOCAL_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The host part of a ``Host`` header or origin netloc, lower case, IPv6 unbracketed."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def key_matches(authorization: bytes | str | None, key: str) -> bool:
    """True when an ``Authorization`` header value is ``Bearer KEY`` (compared as bytes,
    in constant time)."""
    if authorization is None:
        return False
    raw = authorization.encode("latin-1") if isinstance(authorization, str) else authorization
    scheme, _, token = raw.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode("ascii"))


def cross_site_refusal(scope: dict, settings: Any) -> str | None:
    """Why the request must be refused as cross-site (a message), or None to accept it."""
    bound = _host_name(settings.host)
    host_header = _header(scope, b"host")
    allowed = set(settings.allowed_hosts)
    enforce_host = is_loopback(bound) or bool(allowed)
    if enforce_host:
        allowed |= {bound, *_LOCAL_NAMES} if is_loopback(bound) else {bound}
        name = _host_name(host_header) if host_header else ""
        if name not in allowed:
            shown = host_header if host_header is not None else "(none)"
            return (f"Host {shown!r} is not allowed: this server answers to "
                    f"{', '.join(sorted(allowed))} (add names with --allowed-hosts).")
    origin = _header(scope, b"origin")
    if origin is not None:
        normalized = origin.strip().rstrip("/").lower()
        if normalized in settings.allowed_origins:
            return None
        parts = urlsplit(normalized)
        same = (
            host_header is not None
            and parts.scheme in ("http", "https")
            and parts.netloc == host_header.strip().lower()
        )
        if not same:
            return (f"Origin {origin!r} is not allowed: cross-origin requests are refused "
                    "(allow an origin with --allowed-origins).")
        return None
    if (_header(scope, b"sec-fetch-site") or "").strip().lower() == "cross-site":
        return ("Cross-site request refused (Sec-Fetch-Site: cross-site); allow its origin "
                "with --allowed-origins.")
    return None


class GuardMiddleware:
    """Host/Origin checks (403), API key on ``/v1/`` (401), refusal of new work while
    shutting down (503), and the body-size limit (413).

    The body is read here (at most ``max_body_bytes`` kept) and replayed to the app; an
    oversized body is drained (up to a cap) before the 413 so the client reads the answer.
    """

    def __init__(self, app: Any, state: BaseServerState) -> None:
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
        refusal = cross_site_refusal(scope, settings)
        if refusal is not None:
            await APIError(403, refusal, code="forbidden", type="permission_error").response()(
                scope, receive, send
            )
            return
        if settings.api_key is not None and (path == "/v1" or path.startswith("/v1/")):
            raw = b""
            for key, value in scope.get("headers", ()):
                if key.lower() == b"authorization":
                    raw = value
                    break
            auth = raw.decode("latin-1")
            if not key_matches(raw, settings.api_key):
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


class InternalErrorMiddleware:
    """An unexpected exception answers 500 with a generic message and a request id
    (``X-Request-ID``); the exception and its traceback go only to the server log.

    Handled here rather than by Starlette's outermost error middleware, which re-raises
    into the server (logged twice, and the connection is dropped).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Run the app; turn an exception into the generic 500 if nothing was sent yet."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            request_id = f"req_{secrets.token_hex(8)}"
            logger.error("request %s: unexpected error on %s %s", request_id,
                         scope.get("method"), scope.get("path"), exc_info=exc)
            if started:
                return
            await APIError(
                500,
                f"Internal server error (request id {request_id}); the server log has the details.",
                code="internal_error",
                headers={"X-Request-ID": request_id},
            ).response()(scope, receive, send)

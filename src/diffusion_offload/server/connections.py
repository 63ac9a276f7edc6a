"""Connection limits of ``serve``: slow and idle clients are cut off, open connections bounded.

uvicorn closes a keep-alive connection idle between two requests after
``timeout_keep_alive`` seconds (its own option, used as is), and h11 refuses request heads
over 16 KiB (400). It has no deadline for the request head or body and no bound on open
connections (its ``limit_concurrency`` answers 503 to *every* request once the bound is
reached, ``/health`` included, so idle sockets could still starve the server). The
protocol here is uvicorn's h11 protocol with three additions:

- **head deadline**: the request line and headers must be complete within
  ``timeout_headers`` seconds of the connection opening (or of the previous response
  ending): a connection that sends nothing, or drips its headers, is answered
  ``408 Request Timeout`` and closed;
- **body deadline**: the body must be complete within ``timeout_body`` seconds of its
  headers, else 408 (when the app has not started answering) and closed; the app sees
  the client disconnect;
- **connection bound**: at most ``max_connections`` open connections. A new connection
  beyond it closes the connection waiting longest for a request head (never one with a
  request in flight); when every connection has a request in flight, the new one is
  answered ``503`` and closed. So a flood of idle or slow connections never keeps a new
  client (``/health`` included) from being served, and the process never runs out of
  file descriptors (:func:`fd_headroom` sizes the bound to ``ulimit -n``).

:func:`protocol_class` builds the protocol for one server's :class:`ConnectionLimits`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = [
    "FD_RESERVE", "ConnectionLimits", "fd_headroom", "protocol_class", "raise_fd_limit",
    "resolve_max_connections",
]

FD_RESERVE = 64
"""File descriptors kept for everything but client connections (listener, logs, model files,
the event loop's own)."""


@dataclass(frozen=True)
class ConnectionLimits:
    """Deadlines (seconds, > 0) and the open-connection bound of one server.

    Attributes:
        max_connections: most open client connections (>= 1).
        timeout_keep_alive: an idle connection between requests is closed after this.
        timeout_headers: the request line and headers must arrive within this.
        timeout_body: the request body must arrive within this after its headers.
    """

    max_connections: int = 1000
    timeout_keep_alive: float = 5.0
    timeout_headers: float = 10.0
    timeout_body: float = 30.0


def _response(status: str, message: str) -> bytes:
    body = message.encode("ascii", "replace")
    head = (f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class _GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the head and body deadlines and the connection bound."""

    limits = ConnectionLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_since = time.monotonic()
        self._seen_cycle: Any = None
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._evict_one():
            transport.write(_response(
                "503 Service Unavailable",
                f"every one of the server's {self.limits.max_connections} connections "
                "(--max-connections) has a request in flight; retry shortly\n",
            ))
            transport.close()
            return
        self._arm(self.limits.timeout_headers, "request headers", "--timeout-headers")

    @property
    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _evict_one(self) -> bool:
        """Close the other connection waiting longest for a request head; False if none."""
        idle = [
            p for p in self.connections
            if p is not self and isinstance(p, _GuardedProtocol) and p._waiting_for_head
            and not p.transport.is_closing()
        ]
        if not idle:
            return False
        oldest = min(idle, key=lambda p: p._waiting_since)
        oldest._disarm()
        oldest.transport.close()
        return True

    def _arm(self, seconds: float, what: str, flag: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire, what, flag, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, what: str, flag: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete or not self.cycle.response_started:
            self.transport.write(_response(
                "408 Request Timeout", f"the {what} did not arrive within {seconds:g} s ({flag})\n"
            ))
        self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        if cycle is not self._seen_cycle:  # a new request head is in
            self._seen_cycle = cycle
            if cycle.more_body:
                self._arm(self.limits.timeout_body, "request body", "--timeout-body")
            else:
                self._disarm()
        elif not cycle.more_body:
            self._disarm()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._waiting_since = time.monotonic()
            self._arm(self.limits.timeout_headers, "request headers", "--timeout-headers")
        super().on_response_complete()  # may start a pipelined request (handle_events)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def protocol_class(limits: ConnectionLimits) -> type[H11Protocol]:
    """The uvicorn ``http`` protocol class enforcing ``limits`` (pass it as
    ``uvicorn.Config(http=...)`` together with ``timeout_keep_alive``)."""
    return type("GuardedH11Protocol", (_GuardedProtocol,), {"limits": limits})


def fd_headroom() -> int | None:
    """Client connections the open-file limit (``ulimit -n``, soft) leaves room for:
    the limit minus :data:`FD_RESERVE`, at least 1; None when the platform has no limit."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    return max(1, soft - FD_RESERVE)


def raise_fd_limit(connections: int) -> None:
    """Raise the soft open-file limit towards ``connections + FD_RESERVE`` as far as the
    hard limit allows (never lowers it)."""
    try:
        import resource
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + FD_RESERVE
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass


def resolve_max_connections(wanted: int | None, default: int = 1000) -> int:
    """The connection bound to serve with: ``wanted`` (``--max-connections``) or ``default``,
    after raising the soft open-file limit as far as the hard one allows.

    Without ``wanted``, the bound is lowered to what the open-file limit leaves room for.

    Raises:
        ValueError: ``wanted`` needs more file descriptors than ``ulimit -n`` allows (the
            message names the flag, the value and the most that fits).
    """
    raise_fd_limit(wanted or default)
    room = fd_headroom()
    if wanted is None:
        return default if room is None else min(default, room)
    if room is not None and wanted > room:
        raise ValueError(
            f"--max-connections {wanted} needs {wanted + FD_RESERVE} open files, but the "
            f"open-file limit (ulimit -n) allows {room + FD_RESERVE}; give at most "
            f"--max-connections {room}, or raise ulimit -n"
        )
    return wanted

"""Connection hygiene below the ASGI app: deadlines for a request's head and body, a cap on open
connections, and a shutdown that does not wait on uploads that stalled.

uvicorn has a keep-alive timeout for idle connections but no deadline for a request that has
started and does not finish, so a socket that sends a partial head or body stays open forever, and
enough of them exhaust the process's file descriptors. :class:`GuardedH11Protocol` is uvicorn's h11
protocol with:

* a **head deadline**, from the connection's opening (or, on a kept-alive connection, from the next
  request's first byte) until the request head is complete;
* a **body deadline**, from the complete head until the body's end; a request whose body misses it
  gets 408 and the connection closes (the app sees the client disconnect);
* a **connection cap**: a connection over it closes the oldest connection still waiting for its
  request head (a stalled or idle one), or, when every open connection is busy, is refused with 503;
* at **shutdown**, connections in the middle of an upload close at once (uvicorn would wait for their
  response until its graceful-shutdown timeout, then cancel the app with a traceback and a 500).
"""

from __future__ import annotations

import asyncio
import functools
import resource
from dataclasses import dataclass
from typing import Any, Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# File descriptors kept for everything but client connections (model files, logs, pipes, sockets).
_RESERVED_FDS = 128


def default_max_connections() -> int:
    """Three quarters of the open-file limit (``ulimit -n``) beyond a reserve, at least 16."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65_536
    return max(16, (soft - _RESERVED_FDS) * 3 // 4)


@dataclass(slots=True)
class ConnectionLimits:
    """Set by whoever starts the server (``specloop serve`` flags)."""

    header_timeout: float = 10.0  # seconds to send a request's head
    body_timeout: float = 60.0  # seconds to send its body, once the head is in
    max_connections: int | None = None  # None: default_max_connections()

    def __post_init__(self) -> None:
        if not self.header_timeout > 0 or not self.body_timeout > 0:
            raise ValueError("request timeouts must be > 0 seconds")
        if self.max_connections is None:
            self.max_connections = default_max_connections()
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")


class ConnectionGuard:
    """What the connections of one server share: the limits, and the connections still waiting for a
    request head, oldest first (the ones to close when over the cap)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.waiting: dict[GuardedH11Protocol, None] = {}  # insertion-ordered set

    def protocol_factory(self) -> Callable[..., GuardedH11Protocol]:
        """What ``uvicorn.Config(http=...)`` takes."""
        return functools.partial(GuardedH11Protocol, guard=self)


def _error_response(status: bytes, code: str, message: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = (b'{"error": {"message": "%s", "type": "%s", "param": null, "code": "%s"}}'
            % (message.encode(), b"server_error" if status.startswith(b"5") else b"invalid_request_error", code.encode()))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    return headers, body


_REFUSED_HEADERS, _REFUSED_BODY = _error_response(b"503", "too_many_connections", "Too many open connections.")
_REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in _REFUSED_HEADERS)
            + b"\r\n" + _REFUSED_BODY)
_SLOW_HEADERS, _SLOW_BODY = _error_response(b"408", "request_timeout", "The request body did not arrive in time.")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines, the cap and the shutdown described above.

    ``_phase`` follows the request on the connection: ``head`` (its head is awaited, under the head
    deadline), ``body`` (under the body deadline), ``busy`` (received; the app answers), ``idle``
    (kept alive after a response; uvicorn's keep-alive timeout applies until the next byte).
    Connections in ``head`` or ``idle`` are the ones the cap may close.
    """

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = "head"

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > (self.guard.limits.max_connections or 0):
            oldest = next(iter(self.guard.waiting), None)
            if oldest is None:  # every open connection is busy: refuse this one
                self._phase = "busy"
                transport.write(_REFUSED)
                transport.close()
                return
            self.guard.waiting.pop(oldest, None)
            oldest.transport.abort()
        self.guard.waiting[self] = None
        self._set_deadline(self.guard.limits.header_timeout, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self.guard.waiting.pop(self, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._track()

    def _track(self) -> None:
        """Move to the phase h11's view of the client says, with its deadline."""
        state = self.conn.their_state
        if state is h11.IDLE:
            if self._phase == "busy":
                self._phase = "idle"
                self.guard.waiting[self] = None
            if self._phase == "idle" and self.conn.trailing_data[0]:  # the next head has started
                self._phase = "head"
                self._set_deadline(self.guard.limits.header_timeout, self.transport.close)
        elif state is h11.SEND_BODY:
            if self._phase != "body":
                self.guard.waiting.pop(self, None)
                self._phase = "body"
                self._set_deadline(self.guard.limits.body_timeout, self._body_too_slow)
        elif self._phase != "busy":
            self.guard.waiting.pop(self, None)
            self._phase = "busy"
            self._cancel_deadline()

    def shutdown(self) -> None:
        if self._phase == "body" and self.cycle is not None and not self.cycle.response_started:
            # An upload still coming in: the app is waiting for it, so close now; it sees a disconnect.
            self.transport.close()
            return
        super().shutdown()

    def _set_deadline(self, seconds: float, on_expiry: Callable[[], None]) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(seconds, on_expiry)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _body_too_slow(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE:
            cycle.response_started = True  # the app's own response, if it tries one, goes nowhere
            response = h11.Response(status_code=408, headers=_SLOW_HEADERS, reason=b"Request Timeout")
            self.transport.write(self.conn.send(response) + self.conn.send(h11.Data(data=_SLOW_BODY))
                                 + self.conn.send(h11.EndOfMessage()))
        self.transport.close()

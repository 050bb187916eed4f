"""The Starlette app: the API-key check, error handlers, and the lifespan that starts and stops the
engine on the server's event loop.

Every route, the built-in ones included, comes from the ``specloop_register_routes`` hook (the
built-in ones are registered by :mod:`specloop.server.plugin`); what they share is
:class:`~specloop.server.state.ServerState`.
"""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from specloop.kernel.plugins import PluginManager

from .errors import APIError, AuthenticationError, ServerError
from .serving import ClientDisconnected
from .request_id import RequestIdMiddleware
from .state import ServerLimits, ServerState

logger = logging.getLogger("specloop.server")


# Paths that take a key when the server has one: everything that runs the model or the tokenizer.
# Health, metrics, version and the API description stay open.
_GUARDED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on the ``/v1`` routes, ``/tokenize`` and
    ``/detokenize``; the scheme's case does not matter (RFC 7235)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_GUARDED_PREFIXES) and scope["method"] != "OPTIONS":
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(b" "), self.expected):
                await AuthenticationError().to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.to_response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return APIError(str(exc.detail), status_code=exc.status_code).to_response()


async def _gone(request: Request, exc: Exception) -> Response:
    # The client left (or was cut off) before its request was read: there is no one to answer.
    return Response(status_code=499)


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return ServerError("Internal server error.").to_response()


def build_app(engine: Any, *, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              limits: ServerLimits | None = None, plugins: PluginManager | None = None) -> Starlette:
    """The OpenAI-compatible app for ``engine`` (an :class:`~specloop.frontend.async_engine.AsyncEngine`).

    The app owns the engine's run: its lifespan starts the engine on the server's event loop and,
    on shutdown, aborts what is in flight and shuts the engine down.

    :param served_model_name: the name(s) clients use in ``model``; default: the engine's model name.
    :param api_key: when set, ``/v1`` routes, ``/tokenize`` and ``/detokenize`` need
        ``Authorization: Bearer <api_key>``.
    :param limits: limits against abuse (body size, ``n``, prompts per request, prompt length).
    :param plugins: where routes come from; default: the engine's plugin manager.
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    if plugins is None:
        plugins = getattr(engine, "plugins", None) or PluginManager(disable=engine.config.disable_plugins)
    state = ServerState(engine, names or [engine.model_name], limits or ServerLimits(), plugins,
                        requires_api_key=bool(api_key))
    routes = [entry.load()(state) for entry in plugins.routes.entries()]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not engine.is_running:
            await engine.start()
        try:
            yield
        finally:
            await state.abort_all()
            await engine.shutdown()
            state.close()

    middleware = [Middleware(RequestIdMiddleware)]
    middleware += [Middleware(APIKeyMiddleware, api_key=api_key)] if api_key else []
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, ClientDisconnected: _gone,
                                        Exception: _unexpected})
    app.state.specloop = state
    return app


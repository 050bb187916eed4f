"""The Starlette app: state shared by the routes, the API-key check, error handlers, and the
lifespan that starts and stops the engine on the server's event loop.

Every route, the built-in ones included, comes from the ``specloop_register_routes`` hook; see
:mod:`specloop.server.routes`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from specloop.frontend.outputs import Logprob
from specloop.kernel.plugins import PluginManager
from specloop.kernel.sampling_params import SamplingParams

from .errors import APIError, AuthenticationError, BadRequest, NotFound, PayloadTooLarge, ServerError, from_value_error
from .metrics import ServerMetrics

if TYPE_CHECKING:
    from .serving import Generation

logger = logging.getLogger("specloop.server")


@dataclass(slots=True)
class ServerLimits:
    """Limits against abuse. Set by whoever builds the app (``specloop serve`` flags)."""

    max_body_bytes: int = 16 * 1024 * 1024
    max_n: int = 16
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_prompt_tokens: int | None = None  # None: max_model_len - 1
    # Every stop string is looked for after every token, on the event loop all requests share.
    max_stop_strings: int = 64

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_n", "max_prompts", "max_stop_strings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be >= 1")


class ServerState:
    """What every route needs: the engine, the served names, limits and metrics. Built once by
    :func:`build_app`; ``inflight`` and ``draining`` change as requests come and go."""

    def __init__(self, engine: Any, served_model_names: list[str], api_key: str | None, limits: ServerLimits,
                 plugins: PluginManager) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.api_key = api_key
        self.limits = limits
        self.plugins = plugins
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.config.max_model_len
        self.vocab_size: int = engine.vocab_size
        self.metrics = ServerMetrics(engine, served_model_names[0])
        self.created = int(time.time())
        self.inflight: set[Generation] = set()
        self.draining = False

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def resolve_model(self, model: str | None) -> str:
        if model is None:
            return self.model_name
        if model not in self.served_model_names:
            raise NotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return model

    def check_n(self, n: int) -> None:
        if n > self.limits.max_n:
            raise BadRequest(f"'n' must be at most {self.limits.max_n} on this server, got {n}.", param="n")

    def check_stop(self, stop: list[str]) -> None:
        if len(set(stop)) > self.limits.max_stop_strings:
            raise BadRequest(f"'stop' may hold at most {self.limits.max_stop_strings} different strings on this "
                             f"server, got {len(set(stop))}.", param="stop")

    def require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise BadRequest(f"{what} needs a tokenizer and this server runs without one; send token ids.")
        return self.tokenizer

    def encode_prompt(self, prompt: str | list[int], *, echo: bool = False) -> tuple[list[int], str | None]:
        """Token ids (checked against the vocabulary) and, when echoing, the prompt's text."""
        if isinstance(prompt, str):
            ids = self.require_tokenizer("A text prompt").encode(prompt, add_special_tokens=True)
            if not ids:
                raise BadRequest("'prompt' must not be empty.", param="prompt")
            return ids, prompt
        self.check_token_ids(prompt, "prompt")
        text = self.tokenizer.decode(prompt) if echo and self.tokenizer is not None else None
        return list(prompt), text

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"Token id {bad[0]} in '{param}' is outside the vocabulary [0, {self.vocab_size}).",
                             param=param)

    def sampling_params(self, sampling: dict[str, Any], max_tokens: int | None, prompt_ids: list[int], *,
                        prompt_param: str, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's parameters for one prompt, checked against the context window and the
        vocabulary; ``max_tokens`` defaults to what fits after the prompt."""
        n, limit = len(prompt_ids), self.max_model_len
        if n >= limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, your request has "
                             f"{n} input tokens, which leaves no room for output. Please reduce the length of "
                             "the input.", param=prompt_param, code="context_length_exceeded")
        cap = self.limits.max_prompt_tokens
        if cap is not None and n > cap:
            raise BadRequest(f"The input has {n} tokens, more than this server's limit of {cap}.",
                             param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and n + max_tokens > limit:
            raise BadRequest(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{n + max_tokens} tokens ({n} in the input, {max_tokens} in the completion). "
                             "Please reduce the length of the input or completion.",
                             param="max_tokens", code="context_length_exceeded")
        try:
            params = SamplingParams(**sampling, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                    max_tokens=max_tokens if max_tokens is not None
                                    else self.engine.default_max_tokens(n))
            params.verify_vocab(self.vocab_size)
            self.engine.validate(prompt_ids, params)
        except ValueError as e:
            raise from_value_error(e) from None
        return params

    def token_text(self, token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.token_text(token_id)

    async def abort_all(self) -> None:
        """Stop accepting generation requests and cancel every one in flight (shutdown)."""
        self.draining = True
        await asyncio.gather(*(g.cancel() for g in list(self.inflight)), return_exceptions=True)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (before reading it all when the
    client announces its length)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"The request body has {length} bytes, more than this server's limit of {limit}.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"The request body is larger than this server's limit of {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on the ``/v1`` routes (as vLLM does); health,
    metrics, version and tokenization stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await AuthenticationError().to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.to_response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return APIError(str(exc.detail), status_code=exc.status_code).to_response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return ServerError("Internal server error.").to_response()


def build_app(engine: Any, *, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              limits: ServerLimits | None = None, plugins: PluginManager | None = None) -> Starlette:
    """The OpenAI-compatible app for ``engine`` (an :class:`~specloop.frontend.async_engine.AsyncEngine`).

    The app owns the engine's run: its lifespan starts the engine on the server's event loop and,
    on shutdown, aborts what is in flight and shuts the engine down.

    :param served_model_name: the name(s) clients use in ``model``; default: the engine's model name.
    :param api_key: when set, ``/v1`` routes need ``Authorization: Bearer <api_key>``.
    :param limits: limits against abuse (body size, ``n``, prompts per request, prompt length).
    :param plugins: where routes come from; default: the engine's plugin manager.
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    if plugins is None:
        core = getattr(engine, "core", None)
        plugins = getattr(core, "plugins", None) or PluginManager(disable=engine.config.disable_plugins)
    state = ServerState(engine, names or [engine.model_name], api_key, limits or ServerLimits(), plugins)
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

    middleware = [Middleware(APIKeyMiddleware, api_key=api_key)] if api_key else []
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected})
    app.state.specloop = state
    return app


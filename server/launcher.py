"""``specloop serve``: the OpenAI-compatible server on uvicorn, one uvloop event loop for HTTP and
the engine's busy loop.

SIGINT/SIGTERM only set a flag; uvicorn's main loop notices it, and the shutdown below stops
accepting, aborts every request in flight (their streams end with ``finish_reason="abort"`` and
``[DONE]``), waits for the connections to close, shuts the engine down, and returns 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from typing import Any, Callable, Iterator

import uvicorn

from specloop.frontend.data_parallel import build_async_engine

from .app import build_app
from .connections import ConnectionGuard, ConnectionLimits
from .state import ServerLimits, ServerState

API_KEY_ENV = "SPECLOOP_API_KEY"


class _Server(uvicorn.Server):
    """uvicorn's server, with signal handling that ends in a clean exit (uvicorn re-raises the
    captured signal after shutting down) and a shutdown that aborts in-flight generations first."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def _on_signal(self) -> None:
        # A second signal while shutting down skips the graceful wait.
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self.state.abort_all()
        await super().shutdown(sockets)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    defaults = ServerLimits()
    return ServerLimits(
        max_body_bytes=getattr(args, "max_body_bytes", None) or defaults.max_body_bytes,
        max_n=getattr(args, "max_n", None) or defaults.max_n,
        max_prompts=getattr(args, "max_prompts", None) or defaults.max_prompts,
        max_prompt_tokens=getattr(args, "max_prompt_tokens", None),
        max_stop_strings=getattr(args, "max_stop_strings", None) or defaults.max_stop_strings,
        max_stop_string_length=getattr(args, "max_stop_string_length", None) or defaults.max_stop_string_length,
        max_messages=getattr(args, "max_messages", None) or defaults.max_messages,
    )


def connection_limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    defaults = ConnectionLimits()
    return ConnectionLimits(
        header_timeout=getattr(args, "request_header_timeout", None) or defaults.header_timeout,
        body_timeout=getattr(args, "request_body_timeout", None) or defaults.body_timeout,
        max_connections=getattr(args, "max_connections", None),
    )


def uvicorn_config(app: Any, connections: ConnectionLimits, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` behind :class:`~specloop.server.connections.GuardedH11Protocol`."""
    return uvicorn.Config(app, http=ConnectionGuard(connections).protocol_factory(), lifespan="on",
                          timeout_graceful_shutdown=10, **kwargs)


def served_names(args: argparse.Namespace, engine: Any) -> list[str]:
    """``--served-model-name``, else the model directory's name; the path as given is accepted too."""
    if args.served_model_name:
        return [args.served_model_name]
    names = [engine.model_name]
    if args.model_path and args.model_path not in names:
        names.append(args.model_path)
    return names


def run_serve(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    """Serve until a signal. ``args`` holds the server flags, ``engine_args`` the engine's
    :class:`~specloop.kernel.config.EngineConfig` keyword arguments."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        limits = limits_from_args(args)
        connections = connection_limits_from_args(args)
        engine = build_async_engine(args.model_path, engine_process=getattr(args, "engine_process", True),
                                    **engine_args)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        print(f"specloop serve: error: {e}", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    app = build_app(engine, served_model_name=served_names(args, engine), api_key=api_key, limits=limits)
    config = uvicorn_config(app, connections, host=args.host, port=args.port, log_level=args.log_level)
    server = _Server(config, app.state.specloop)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(server.serve())
    return 0 if server.started else 1

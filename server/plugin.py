"""Registers the built-in HTTP routes through ``specloop_register_routes``, exactly as a third-party
plugin adds its own. Factories are "module:attr" strings, so building a plugin manager imports
neither starlette nor the server; the app imports :mod:`specloop.server.routes` when it is built.
"""

from __future__ import annotations

from specloop.kernel.hookspecs import Register, hookimpl

# route name -> its factory in specloop.server.routes (``factory(state)`` returns a Starlette route)
BUILTIN_ROUTES = {
    "completions": "completions_route",
    "chat_completions": "chat_completions_route",
    "models": "models_route",
    "model": "model_route",
    "health": "health_route",
    "metrics": "metrics_route",
    "version": "version_route",
    "tokenize": "tokenize_route",
    "detokenize": "detokenize_route",
    "openapi": "openapi_route",
}


@hookimpl
def specloop_register_routes(register: Register) -> None:
    for name, factory in BUILTIN_ROUTES.items():
        register(name, f"specloop.server.routes:{factory}")

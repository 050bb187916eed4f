"""Registers the built-in tool-call parsers through ``specloop_register_tool_parsers``, as a
third-party plugin registers its own."""

from __future__ import annotations

from specloop.kernel.hookspecs import Register, hookimpl


@hookimpl
def specloop_register_tool_parsers(register: Register) -> None:
    register("hermes", "specloop.frontend.tool_parsers:HermesToolParser")

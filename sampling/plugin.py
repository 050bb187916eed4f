"""Registers the built-in structured-output backend through
``specloop_register_structured_output_backends``, as a third-party plugin registers its own (an
xgrammar backend would wrap :class:`specloop.sampling.grammar.StructuredOutputs` around its own
:class:`~specloop.sampling.grammar.GrammarBackend`)."""

from __future__ import annotations

from specloop.kernel.config import EngineConfig
from specloop.kernel.hookspecs import Register, hookimpl


def llguidance_structured_outputs(config: EngineConfig, vocab_size: int) -> object:
    from .grammar import StructuredOutputs
    from .llguidance_backend import LLGuidanceBackend

    return StructuredOutputs(LLGuidanceBackend(config.tokenizer or config.model, vocab_size), vocab_size)


@hookimpl
def specloop_register_structured_output_backends(register: Register) -> None:
    register("llguidance", llguidance_structured_outputs)

"""specloop: an LLM inference engine built as an asyncio microkernel with plugins.

The public API is exported lazily so that ``import specloop.kernel`` and ``specloop --help`` do not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "specloop.frontend.llm",
    "AsyncEngine": "specloop.frontend.async_engine",
    "RequestOutput": "specloop.frontend.request_output",
    "CompletionOutput": "specloop.frontend.request_output",
    "SamplingParams": "specloop.kernel.sampling_params",
    "StructuredOutputsParams": "specloop.sampling.structured_outputs",
    "EngineConfig": "specloop.kernel.config",
    "SpeculativeConfig": "specloop.kernel.config",
    "hookimpl": "specloop.kernel.hookspecs",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

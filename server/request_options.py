"""Request options the routes apply once the body is parsed: the model's sampling defaults, the
grammar check that turns an invalid schema into a 400, and token ids as logprob tokens."""

from __future__ import annotations

import asyncio
from typing import Any

from specloop.frontend.request_output import Logprob
from specloop.kernel.sampling_params import SamplingParams

from .errors import BadRequest
from .state import ServerState


def generation_defaults(state: ServerState, body: dict[str, Any], req: Any) -> None:
    """The model's ``generation_config.json`` sampling defaults, for the fields the body leaves out
    (vLLM's ``--generation-config auto``; ``vllm`` turns them off). ``max_tokens`` keeps its own
    default, what fits in the context."""
    for name, value in getattr(state.engine, "generation_defaults", {}).items():
        if body.get(name) is None and name in req.sampling:
            req.sampling[name] = value


async def check_grammar(state: ServerState, params: SamplingParams, param: str | None) -> None:
    """Compile the request's grammar (off the event loop, into the engine's cache) and refuse it
    with a 400 naming the field when the grammar engine cannot."""
    future = state.engine.processor.compile_grammar(params)
    if future is None:
        return
    try:
        await asyncio.wrap_future(future)
    except ValueError as e:
        raise BadRequest(f"Invalid output constraint in '{param}': {e}", param=param,
                         code="invalid_structured_output") from None


def token_id_text(token_id: int, logprob: Logprob | None) -> str:
    """``return_tokens_as_token_ids``: logprob tokens spelled ``token_id:<id>``."""
    return f"token_id:{token_id}"

"""The chat-completions consumers: the non-streaming body and the SSE chunks of a
:class:`~specloop.server.serving.Generation`, with tool calls, echo and prompt logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from . import responses
from .chat import ChatExtras, ToolStream, message
from .errors import APIError
from .serving import EngineFailure, Generation, _drain, _failure
from .state import ServerState


# --- chat completions ------------------------------------------------------------------------

@dataclass(slots=True)
class ChatContext:
    """What the chat consumers need besides the outputs. Set by the route."""

    request_id: str
    created: int
    model: str
    logprobs: int | None  # top_logprobs when logprobs were asked for
    include_usage: bool
    extras: ChatExtras = field(default_factory=ChatExtras)
    token_text: responses.TokenText | None = None  # return_tokens_as_token_ids: "token_id:<id>"

    def logprobs_of(self, state: ServerState, token_ids: list[int], entries: list[Any]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return responses.chat_logprobs(token_ids, entries or [None] * len(token_ids), self.logprobs,
                                       self.token_text or state.token_text, state.token_bytes)


async def collect_chat(state: ServerState, gen: Generation, ctx: ChatContext) -> dict[str, Any]:
    await _drain(gen)
    choices = []
    for k, c in enumerate(gen.choices[0]):
        msg, finish_reason = message("".join(c.text), c.finish_reason, ctx.extras)
        choices.append({"index": k, "message": msg, "logprobs": ctx.logprobs_of(state, c.token_ids, c.logprobs),
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    body = responses.chat_response(ctx.request_id, ctx.created, ctx.model, choices, gen.usage())
    if ctx.extras.prompt_logprobs:
        body["prompt_logprobs"] = responses.prompt_logprobs(gen.prompt_logprobs[0], state.token_text)
    return body


async def stream_chat(state: ServerState, gen: Generation, ctx: ChatContext) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]]) -> bytes:
        return responses.sse(responses.chat_chunk(ctx.request_id, ctx.created, ctx.model, choices,
                                                with_usage_field=ctx.include_usage))

    streams = [ToolStream(ctx.extras.tools) for _ in range(gen.inputs[0].params.n)]
    for k in range(len(streams)):
        yield chunk([{"index": k, "delta": {"role": "assistant", "content": ctx.extras.echo_prefix},
                      "logprobs": None, "finish_reason": None}])
    try:
        async for _, out in gen:
            for c in out.outputs:
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                stream = streams[c.index]
                logprobs = ctx.logprobs_of(state, c.token_ids, c.logprobs) if c.token_ids else None
                content, call_deltas = stream.feed(c.text)
                for call in call_deltas:
                    yield chunk([{"index": c.index, "delta": {"tool_calls": [call]}, "logprobs": None,
                                  "finish_reason": None}])
                if c.finish_reason is None:
                    if content or logprobs:
                        yield chunk([{"index": c.index, "delta": {"content": content} if content else {},
                                      "logprobs": logprobs, "finish_reason": None}])
                    continue
                rest, calls, finish_reason = stream.finish(c.finish_reason)
                content += rest
                delta: dict[str, Any] = {"content": content} if content else {}
                if calls:
                    for call in calls:
                        yield chunk([{"index": c.index, "delta": {"tool_calls": [call]}, "logprobs": None,
                                      "finish_reason": None}])
                yield chunk([{"index": c.index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": finish_reason, "stop_reason": c.stop_reason}])
        if ctx.include_usage:
            yield responses.sse(responses.chat_chunk(ctx.request_id, ctx.created, ctx.model, [], gen.usage(),
                                                   with_usage_field=True))
    except (EngineFailure, APIError) as e:
        yield responses.sse(_failure(e).to_dict())
    yield responses.SSE_DONE

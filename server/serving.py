"""Running one HTTP request through the engine and turning its outputs into OpenAI responses.

A :class:`Generation` owns the engine requests of one HTTP request (one per prompt, each with
``n`` choices) and runs each in its own task, so that the server can cancel them from outside: on a
client disconnect, on shutdown, or when another prompt of the same request fails. Cancelling the
task that consumes ``AsyncEngine.generate`` aborts the request in the engine (its KV blocks are
freed before the next step). The consumers here build the non-streaming body or the SSE chunks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from specloop.frontend.request_output import CompletionOutput, Logprob, RequestOutput
from specloop.kernel.sampling_params import SamplingParams

from . import responses
from .errors import APIError, ServerError, ServiceUnavailable, from_value_error
from .state import ServerState

logger = logging.getLogger("specloop.server")


class EngineFailure(Exception):
    """An engine request failed after the response may have started."""


@dataclass(slots=True)
class _Choice:
    """What one choice has produced so far. Updated by :class:`Generation` as deltas arrive."""

    start: float
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    first_token_time: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class PromptInput:
    """One prompt, tokenized, with its parameters. Built by the route from the request body."""

    token_ids: list[int]
    text: str | None  # the prompt text, for echo
    params: SamplingParams


class Generation:
    """The engine requests of one HTTP request, each consumed by a task the server can cancel.

    Iterating yields ``(prompt_index, RequestOutput)`` deltas in arrival order and keeps per-choice
    state (``choices``), usage, and the request metrics. A prompt cancelled from outside yields a
    final delta with ``finish_reason="abort"`` for its unfinished choices; an engine error raises
    :class:`EngineFailure`.
    """

    def __init__(self, state: ServerState, request_id: str, inputs: list[PromptInput], *, arrival: float,
                 priority: int = 0, cache_salt: str | None = None) -> None:
        """:param arrival: ``time.perf_counter()`` when the HTTP request was accepted (latencies start there)."""
        self.state = state
        self.priority = priority
        self.cache_salt = cache_salt
        self.request_id = request_id
        self.inputs = inputs
        self.choices = [[_Choice(arrival) for _ in range(p.params.n)] for p in inputs]
        self.prompt_logprobs: list[list[Any]] = [[] for _ in inputs]  # per prompt position, when asked for
        self._queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._run(i, p), name=f"{request_id}-{i}") for i, p in enumerate(inputs)]
        state.inflight.add(self)

    async def _run(self, i: int, p: PromptInput) -> None:
        try:
            async for out in self.state.engine.generate(p.token_ids, p.params, f"{self.request_id}-{i}",
                                                        priority=self.priority, delta=True,
                                                        cache_salt=self.cache_salt):
                self._queue.put_nowait((i, out, None))
        except asyncio.CancelledError:
            self._queue.put_nowait((i, None, asyncio.CancelledError()))
            raise
        except Exception as e:  # handed to the consumer, which reports it to the client
            self._queue.put_nowait((i, None, e))
        else:
            self._queue.put_nowait((i, None, None))

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self._tasks)
        while remaining:
            i, out, error = await self._queue.get()
            if out is not None:
                if out.error is not None:
                    raise EngineFailure(out.error)
                self._record(i, out)
                yield i, out
                continue
            remaining -= 1
            if isinstance(error, asyncio.CancelledError):
                aborted = self._abort_delta(i)
                if aborted.outputs:
                    self._record(i, aborted)
                    yield i, aborted
            elif isinstance(error, ValueError):
                raise from_value_error(error)
            elif error is not None:
                raise EngineFailure(f"{type(error).__name__}: {error}")
        # Every prompt has finished: the id is free before the stream's last chunk and [DONE] go out.
        self.state.inflight.discard(self)

    def _abort_delta(self, i: int) -> RequestOutput:
        unfinished = [CompletionOutput(index=k, text="", token_ids=[], finish_reason="abort")
                      for k, c in enumerate(self.choices[i]) if c.finish_reason is None]
        return RequestOutput(request_id=f"{self.request_id}-{i}", prompt=None,
                             prompt_token_ids=self.inputs[i].token_ids, outputs=unfinished, finished=True)

    def _record(self, i: int, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.prompt_logprobs:
            self.prompt_logprobs[i].extend(out.prompt_logprobs)
        for c in out.outputs:
            choice = self.choices[i][c.index]
            if c.token_ids and choice.first_token_time is None:
                choice.first_token_time = now
            choice.text.append(c.text)
            choice.token_ids.extend(c.token_ids)
            if c.logprobs:
                choice.logprobs.extend(c.logprobs)
            if c.finish_reason is not None and choice.finish_reason is None:
                choice.finish_reason = c.finish_reason
                choice.stop_reason = c.stop_reason
                self.state.metrics.observe_finished(c.finish_reason, choice.start, choice.first_token_time, now,
                                                    len(choice.token_ids))

    def usage(self, prompt_only: bool = False) -> dict[str, int]:
        prompt_tokens = sum(len(p.token_ids) for p in self.inputs)
        completion_tokens = 0 if prompt_only else sum(len(c.token_ids) for choices in self.choices for c in choices)
        return responses.usage(prompt_tokens, completion_tokens)

    async def cancel(self) -> None:
        """Abort whatever is still running (idempotent)."""
        self.state.inflight.discard(self)
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def _failure(error: Exception) -> APIError:
    if isinstance(error, APIError):
        return error
    return ServerError(str(error), code="engine_error")


# --- completions -----------------------------------------------------------------------------

@dataclass(slots=True)
class CompletionContext:
    """What the completions consumers need besides the outputs. Set by the route."""

    request_id: str
    created: int
    model: str
    echo: bool
    logprobs: int | None
    include_usage: bool
    prompt_only: bool = False  # echo with max_tokens 0: the prompt and its logprobs, no completion
    token_text: responses.TokenText | None = None  # return_tokens_as_token_ids: "token_id:<id>"
    prompt_logprobs: bool = False  # report vLLM's prompt_logprobs per choice

    def logprobs_builder(self, state: ServerState) -> responses.CompletionLogprobs:
        return responses.CompletionLogprobs(self.token_text or state.token_text, decode=state.decode_for_offsets)


def _echo_logprobs(state: ServerState, gen: Generation, i: int, builder: responses.CompletionLogprobs) -> dict:
    prompt = gen.inputs[i]
    entries = gen.prompt_logprobs[i] or [None] * len(prompt.token_ids)
    return builder.build(prompt.token_ids, entries)


async def _drain(gen: Generation) -> None:
    """Run a non-streaming generation to its end; an engine failure becomes an API error."""
    try:
        async for _ in gen:
            pass
    except EngineFailure as e:
        raise _failure(e) from None
    finally:
        await gen.cancel()


async def collect_completion(state: ServerState, gen: Generation, ctx: CompletionContext) -> dict[str, Any]:
    await _drain(gen)
    choices = []
    for i, prompt in enumerate(gen.inputs):
        for k, c in enumerate(gen.choices[i]):
            token_ids = [] if ctx.prompt_only else c.token_ids
            text = "" if ctx.prompt_only else "".join(c.text)
            logprobs = None
            if ctx.logprobs is not None:
                builder = ctx.logprobs_builder(state)
                if ctx.echo:
                    logprobs = _echo_logprobs(state, gen, i, builder)
                    part = builder.build(token_ids, c.logprobs or [None] * len(token_ids))
                    logprobs = {key: logprobs[key] + part[key] for key in logprobs}
                else:
                    logprobs = builder.build(token_ids, c.logprobs or [None] * len(token_ids))
            if ctx.echo:
                text = (prompt.text or "") + text
            choice = {"index": i * prompt.params.n + k, "text": text, "logprobs": logprobs,
                      "finish_reason": "length" if ctx.prompt_only else c.finish_reason, "stop_reason": c.stop_reason}
            if ctx.prompt_logprobs:
                choice["prompt_logprobs"] = responses.prompt_logprobs(gen.prompt_logprobs[i], state.token_text)
            choices.append(choice)
    return responses.completion_response(ctx.request_id, ctx.created, ctx.model, choices,
                                         gen.usage(ctx.prompt_only))


async def stream_completion(state: ServerState, gen: Generation, ctx: CompletionContext) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]]) -> bytes:
        return responses.sse(responses.completion_chunk(ctx.request_id, ctx.created, ctx.model, choices,
                                                      with_usage_field=ctx.include_usage))

    builders: dict[tuple[int, int], responses.CompletionLogprobs] = {}
    echoed: set[int] = set()
    try:
        async for i, out in gen:
            n = gen.inputs[i].params.n
            if ctx.echo and i not in echoed and any(c.token_ids or c.finish_reason for c in out.outputs):
                # By the first token every prompt logprob has arrived.
                echoed.add(i)
                for k in range(n):
                    builder = builders[(i, k)] = ctx.logprobs_builder(state)
                    logprobs = _echo_logprobs(state, gen, i, builder) if ctx.logprobs is not None else None
                    yield chunk([{"index": i * n + k, "text": gen.inputs[i].text or "", "logprobs": logprobs,
                                  "finish_reason": None, "stop_reason": None}])
            for c in out.outputs:
                if ctx.prompt_only:
                    if c.finish_reason:
                        yield chunk([{"index": i * n + c.index, "text": "", "logprobs": None,
                                      "finish_reason": "length", "stop_reason": None}])
                    continue
                if not (c.text or c.token_ids or c.finish_reason):
                    continue
                logprobs = None
                if ctx.logprobs is not None:
                    builder = builders.setdefault((i, c.index), ctx.logprobs_builder(state))
                    logprobs = builder.build(c.token_ids, c.logprobs or [None] * len(c.token_ids))
                yield chunk([{"index": i * n + c.index, "text": c.text, "logprobs": logprobs,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
        if ctx.include_usage:
            yield responses.sse(responses.completion_chunk(ctx.request_id, ctx.created, ctx.model, [],
                                                         gen.usage(ctx.prompt_only), with_usage_field=True))
    except (EngineFailure, APIError) as e:
        yield responses.sse(_failure(e).to_dict())
    yield responses.SSE_DONE


# --- responses that notice a client going away -----------------------------------------------

class EventStream(Response):
    """An SSE response that always listens for the client's disconnect (whatever the ASGI spec
    version) and, however it ends, closes its event source and calls ``on_close``, which cancels
    the engine requests behind it."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.create_task(pump())
        watch_task = asyncio.create_task(wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump_task, watch_task):
                task.cancel()
            await asyncio.gather(pump_task, watch_task, return_exceptions=True)
            await self.events.aclose()  # type: ignore[attr-defined]
            await self.on_close()
        if not pump_task.cancelled() and isinstance(pump_task.exception(), Exception) \
                and not isinstance(pump_task.exception(), OSError):
            logger.error("stream failed", exc_info=pump_task.exception())


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ClientDisconnected(Exception):
    """The client went away before its non-streaming response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work`` unless the client disconnects first; then cancel it (which aborts its engine
    requests) and raise :class:`ClientDisconnected`."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.create_task(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


def engine_unavailable(state: ServerState) -> ServiceUnavailable | None:
    if state.draining:
        return ServiceUnavailable("The server is shutting down.", code="shutting_down")
    if state.engine.errored is not None or not state.engine.is_running:
        return ServiceUnavailable(f"The engine is not running: {state.engine.errored!r}", code="engine_dead")
    return None

"""``AsyncEngine``: the streaming API the HTTP server is built on.

Requests are validated and tokenized in the caller's coroutine (on a worker thread when the prompt
or the stop strings are large, so no request stalls the event loop), their output queue is
registered with the core before they are enqueued (invariant 1), and each request's outputs are
detokenized in its own ``generate`` coroutine, so a slow or cancelled client never holds up the
busy loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from specloop.kernel.config import EngineConfig
from specloop.kernel.engine_core import AsyncEngineCore, EngineCore, EngineDeadError
from specloop.kernel.outputs import EngineCoreOutput, EngineCoreOutputs
from specloop.kernel.plugins import PluginManager
from specloop.kernel.request import FinishReason
from specloop.kernel.sampling_params import SamplingParams

from .input_processor import PromptType, prompt_size
from .engine_builder import build_engine, make_config
from .engine_process import EngineProcessClient
from .output_processor import EngineStats, RequestTracker
from .request_output import RequestOutput
from .tokenizer import Tokenizer

# Prompts (characters or token ids) and stop strings (characters) past which a request is prepared
# on a worker thread: below them preparing takes well under a millisecond.
_INLINE_PROMPT_SIZE = 8192
_INLINE_STOP_CHARS = 1024


class AsyncEngine:
    """An engine driven by an asyncio busy loop; many concurrent ``generate`` streams.

    :param config: the engine config; resolved in place (``max_model_len`` etc.) once the model loads.
    :param plugins: the plugin manager (default: built-ins plus entry points, minus disabled ones).
    :param step_in_thread: run each engine step on a worker thread so the event loop stays responsive.
    :param engine_process: run the engine core (scheduler, runner, busy loop) in its own process
        (plugins then come from the entry points there; ``plugins`` only supplies the routes).
    """

    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None, *,
                 step_in_thread: bool = True, engine_process: bool = False) -> None:
        client: EngineProcessClient | None = None

        def start_core(cfg: EngineConfig) -> tuple[EngineConfig, int]:
            nonlocal client
            client = EngineProcessClient(cfg)
            return client.config, client.vocab_size

        # Built on the thread that will step it: a CPU model's parallel work then stays on one
        # thread (another thread's intra-op threads would double them; steps ~3x slower).
        steps = ThreadPoolExecutor(1, "specloop-step") if step_in_thread and not engine_process else None
        try:
            built = (steps.submit(build_engine, config, plugins).result() if steps is not None
                     else build_engine(config, plugins, start_core if engine_process else None))
        except BaseException:
            if steps is not None:
                steps.shutdown(wait=False)
            raise
        self.config: EngineConfig = built.config
        self.tokenizer: Tokenizer | None = built.tokenizer
        self.model_name: str = built.model_name
        self.vocab_size: int = built.vocab_size
        self.processor = built.processor
        self.generation_defaults = built.generation_defaults
        self.plugins: PluginManager = built.plugins  # this process's (routes, tool parsers)
        self.async_core: AsyncEngineCore | EngineProcessClient = (
            client if client is not None
            else AsyncEngineCore(built.core, step_in_thread=step_in_thread, executor=steps))
        self.stats = EngineStats()
        self.async_core.on_outputs.append(self._record_step)
        # Live requests by the caller's id, and the output queue their completions share.
        self._states: dict[str, RequestTracker] = {}
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}
        self._shut_down = False

    @classmethod
    def from_engine_args(cls, model: str | None = None, *, step_in_thread: bool = True,
                         plugins: PluginManager | None = None, engine_process: bool = False,
                         **engine_args: Any) -> AsyncEngine:
        """``model`` is a local HF directory; None means the embedded default model."""
        return cls(make_config(model, engine_args), plugins, step_in_thread=step_in_thread,
                   engine_process=engine_process)

    @property
    def core(self) -> EngineCore | None:
        """The synchronous core (its plugins, scheduler and runner), for the server and tests;
        None when it runs in its own process."""
        return getattr(self.async_core, "core", None)

    @property
    def is_running(self) -> bool:
        return self.async_core.is_running and self.errored is None

    @property
    def errored(self) -> BaseException | None:
        """What stopped the engine: its busy loop's error, or its runner's ``failure`` (a
        tensor-parallel worker that died, seen at once even while the engine is idle)."""
        core = self.core
        failure = getattr(core.runner, "failure", None) if core is not None else None
        return self.async_core.errored or (EngineDeadError(failure) if failure else None)

    async def start(self) -> None:
        """Start the busy loop on the running event loop; calling it again does nothing."""
        if self._shut_down:
            raise EngineDeadError("the engine has been shut down")
        self.async_core.start()

    async def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        await self.async_core.shutdown()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` (a vLLM-like message) when the request cannot be served."""
        self.processor.validate(prompt_token_ids, params)

    def default_max_tokens(self, prompt_len: int) -> int:
        return self.processor.default_max_tokens(prompt_len)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.processor.encode(text, add_special_tokens)

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str, *,
                       priority: int = 0, delta: bool = False, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs.

        :param prompt: text, token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``.
        :param delta: each output carries only what is new per completion (text, token ids,
            logprobs); otherwise everything so far. The last output has ``finished=True``.
        :param cache_salt: mixed into the prefix-cache hash: only requests with the same salt share
            cached blocks.
        :raises ValueError: invalid input, before anything is enqueued; or the engine refused the
            request while running it (its grammar failed to compile, or its other constraints left
            no token the grammar allows).
        :raises EngineDeadError: the engine failed while serving the request.

        Cancelling the consuming task, or closing the generator early, aborts the request (all
        ``n`` completions) in the core.
        """
        grammar = self.processor.compile_grammar(params)
        if grammar is not None:
            await asyncio.wrap_future(grammar)  # an invalid schema raises ValueError here
        cache_salt = cache_salt if cache_salt is not None else self.processor.cache_salt(prompt)
        if prompt_size(prompt) > _INLINE_PROMPT_SIZE or sum(map(len, getattr(params, "stop", ()))) > _INLINE_STOP_CHARS:
            state = await asyncio.to_thread(self._prepare, prompt, params, request_id, priority, cache_salt)
        else:
            state = self._prepare(prompt, params, request_id, priority, cache_salt)
        requests = state.requests
        await self.start()
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        added: list[str] = []
        try:
            for request in requests:
                self.async_core.add_request(request, queue)
                added.append(request.request_id)
        except BaseException:
            self.async_core.abort(added)
            raise
        self._states[request_id] = state
        self._queues[request_id] = queue
        self.stats.num_requests_added += len(requests)
        try:
            while not state.finished:
                outs = [await queue.get()]
                while not queue.empty():  # merge what piled up while this client was slow
                    outs.append(queue.get_nowait())
                to_abort = state.process(outs)
                if to_abort:
                    self.async_core.abort(to_abort)
                failed = next((o for o in outs if o.error is not None), None)
                if failed is not None:  # the engine failed, or refused this request (finished as aborted)
                    raise (EngineDeadError if failed.finish_reason == FinishReason.ERROR else ValueError)(failed.error)
                out = state.delta_output() if delta else state.output()
                if out is not None:
                    yield out
        finally:
            if not state.finished:
                self.async_core.abort(state.unfinished_ids())
                state.abort()
            self._states.pop(request_id, None)
            self._queues.pop(request_id, None)
            self.stats.record_finished(state)

    def _prepare(self, prompt: PromptType, params: SamplingParams, request_id: str, priority: int,
                 cache_salt: str | None) -> RequestTracker:
        """Tokenize, validate, and build the request's core requests and its tracker (the
        detokenizers and the stop-string automaton)."""
        prompt_text, prompt_ids = self.processor.parse(prompt)
        prompt_ids = self.processor.truncate(prompt_ids, params)
        self.validate(prompt_ids, params)
        requests = self.processor.make_requests(request_id, prompt_ids, params, priority, cache_salt=cache_salt)
        return RequestTracker(request_id, prompt_text, requests, self.tokenizer)

    async def abort(self, request_id: str) -> None:
        """Abort a request (all its completions); its ``generate`` stream ends with ``finish_reason="abort"``.
        Unknown or finished ids are ignored."""
        state = self._states.get(request_id)
        if state is None:
            self.async_core.abort([request_id])
            return
        ids = state.unfinished_ids()
        self.async_core.abort(ids)  # drops the core's queues for them: later outputs are dropped
        queue = self._queues[request_id]
        for rid in ids:
            queue.put_nowait(EngineCoreOutput(req_id=rid, new_token_ids=[], finish_reason=FinishReason.ABORT))

    def _record_step(self, outputs: EngineCoreOutputs) -> None:
        self.stats.record_step(outputs.scheduler_stats)

    def get_metrics(self) -> dict[str, Any]:
        """Engine-wide counters (requests, tokens, preemptions, prefix cache, KV usage, queue
        lengths, speculative decoding)."""
        return self.stats.as_dict()

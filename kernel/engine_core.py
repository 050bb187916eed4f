"""The microkernel: one engine step, and the busy loop that drives it.

::

    run_busy_loop
      _process_input_queue    drain adds/aborts into the scheduler (await only when idle)
      _process_engine_step    schedule -> execute_model -> grammar_bitmask -> sample_tokens
                              -> update_from_output -> commit grammars
      post_step               take_draft_token_ids -> update_draft_token_ids

With asynchronous scheduling a step launches plan n+1 before it commits plan n: the scheduler counts the tokens plan n
will sample as placeholders and schedules their successors, the runner feeds those successors from the device, and the
host commits (stop checks, outputs) one step late, while the device already computes the next step. A request that
stops at step n costs at most one wasted token of step n+1, whose output the scheduler drops. A step with drafts is
committed before the next plan unless the runner reads it a step late (that plan assumes every draft accepted). While
grammar-constrained requests run, plan n is committed right after plan n+1's forward is launched, so that plan n+1's
masks see plan n's tokens; the host still works while the device computes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .config import EngineConfig
from .outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from .plugins import PluginManager
from .protocols import ModelRunner, PendingOutput, Scheduler, StructuredOutputManager
from .request import FinishReason, Request, RequestStatus

logger = logging.getLogger("specloop")


class EngineDeadError(RuntimeError):
    """The engine hit an internal error and stopped; no further requests are served."""


class EngineCore:
    """Owns the scheduler and model runner and runs one step at a time (synchronously). Components
    come from the plugin manager's registries by the names in ``config``; a test may pass a ``runner``."""

    def __init__(self, config: EngineConfig, plugins: PluginManager | None = None,
                 runner: ModelRunner | None = None) -> None:
        self.config = config
        self.plugins = plugins or PluginManager(disable=config.disable_plugins)
        self.hooks = self.plugins.hooks
        self.hooks.configure(config)
        if runner is None:
            # "auto" is whichever runner the registered runners' plugin picks for the device.
            runner = self.plugins.model_runners.create(config.model_runner or "auto", config=config,
                                                       plugins=self.plugins)
        self.runner = runner
        try:
            config.resolve(runner.model_max_len)
            num_blocks = runner.initialize()
            config.num_kv_blocks = num_blocks
            config.async_scheduling = bool(getattr(runner, "async_scheduling", False))
            self.kv_cache = self.plugins.kv_cache_policies.create(config.kv_cache_policy, config=config,
                                                                 num_blocks=num_blocks)
            self.scheduler: Scheduler = self.plugins.schedulers.create(config.scheduler, config=config,
                                                                       kv_cache=self.kv_cache)
        except BaseException:
            runner.shutdown()  # it may hold devices and worker processes
            raise
        # Launched plans not yet committed, oldest first (at most two with asynchronous scheduling).
        self.in_flight: collections.deque[tuple[SchedulerOutput, ModelRunnerOutput | PendingOutput]] = \
            collections.deque()
        self.structured_output: StructuredOutputManager = self.plugins.structured_output_backends.create(
            config.structured_outputs_backend, config=config, vocab_size=runner.vocab_size)
        self.requests: dict[str, Request] = {}  # live requests, for the lifecycle hooks
        self.hooks.startup(self)

    # --- requests -----------------------------------------------------------------------------

    def add_requests(self, requests: list[Request]) -> None:
        for request in requests:
            if request.sampling_params.structured_outputs is not None:
                self.structured_output.add_request(request)  # scheduled once its grammar compiles
            else:
                self.scheduler.add_request(request)
            self.requests[request.request_id] = request
        if requests:
            self.hooks.request_added(requests)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Abort by id; unknown or already finished ids are ignored (invariant 9: a step already
        running for them finishes, and its output for them is dropped by the scheduler)."""
        finished = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        finished += self.structured_output.remove(request_ids)  # those still waiting for their grammar
        for request in finished:
            self.requests.pop(request.request_id, None)
        if finished:
            self.hooks.request_finished(finished)
        return finished

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self.structured_output.has_pending()
                or bool(self.in_flight))

    # --- one step -----------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Schedule and launch one plan, and commit the oldest launched one: the same plan when
        synchronous, the previous one (if any) with asynchronous scheduling."""
        t0 = time.perf_counter()
        # Requests whose grammar compiled join the scheduler; those whose grammar failed finish.
        ready, failed = self.structured_output.take_ready(wait=not self.scheduler.has_unfinished_requests())
        for request in ready:
            self.scheduler.add_request(request)
        if failed:
            self.hooks.request_finished([self.requests.pop(out.req_id) for out in failed])
        sync = not self.config.async_scheduling
        if self.in_flight and (sync or not getattr(self.in_flight[-1][1], "overlaps", True)):
            return self._commit_oldest(failed, t0, t0)
        plan = self.scheduler.schedule()
        preempted = [self.requests[r] for r in plan.preempted_req_ids if r in self.requests]
        if preempted:
            self.hooks.request_preempted(preempted, plan.step_id)
        launch = not (plan.is_empty and not plan.finished_req_ids and not plan.preempted_req_ids)
        t1 = time.perf_counter()
        if launch:
            self.hooks.step_scheduled(plan)
            self.runner.execute_model(plan)
            committed = None
            if self.in_flight and self.structured_output.has_active():
                # This plan's masks need the previous plan's tokens in the matchers: commit that
                # plan now, while this one's forward runs, then fill the masks.
                committed = self._commit_oldest(failed, t0, t1)
            # Filled while the forward runs (a GPU runner returns once the forward is launched).
            grammar = self.structured_output.grammar_bitmask(plan)
            self.in_flight.append((plan, self.runner.sample_tokens(grammar)))
            if committed is not None:
                return committed
        if not self.in_flight or (launch and not sync and len(self.in_flight) < 2
                                  and getattr(self.in_flight[-1][1], "overlaps", True)):
            return EngineCoreOutputs(outputs=failed, scheduler_stats=self.scheduler.make_stats())
        return self._commit_oldest(failed, t0, t1)

    def _commit_oldest(self, failed: list[EngineCoreOutput], t0: float, t1: float) -> EngineCoreOutputs:
        done, pending = self.in_flight.popleft()
        result = pending.result() if not isinstance(pending, ModelRunnerOutput) else pending
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(done, result)
        refused = self.structured_output.commit(outputs)  # grammars advance only by committed tokens
        if refused:  # finished with the manager's error, without the step's tokens
            self.scheduler.finish_requests(list(refused), RequestStatus.FINISHED_ABORTED)
            for out in outputs.outputs:
                if out.req_id in refused:
                    out.new_token_ids, out.new_logprobs, out.finish_reason = [], None, FinishReason.ABORT
                    out.error, out.stop_reason = refused[out.req_id], None
        outputs.outputs.extend(failed)
        t3 = time.perf_counter()
        self._emit_step_events(done, result, outputs,
                               {"schedule": t1 - t0, "execute": t2 - t1, "update": t3 - t2, "total": t3 - t0})
        return outputs

    def post_step(self) -> None:
        if self.in_flight and not getattr(self.in_flight[-1][1], "overlaps", True):  # drafts wait for the commit
            return
        drafts = self.runner.take_draft_token_ids()
        if drafts is not None:
            self.scheduler.update_draft_token_ids(drafts)

    def _emit_step_events(self, plan: SchedulerOutput, result: ModelRunnerOutput, outputs: EngineCoreOutputs,
                          timings: dict[str, float]) -> None:
        spec = outputs.scheduler_stats.spec_decoding if outputs.scheduler_stats is not None else None
        if spec is not None and spec.num_drafts:
            self.hooks.drafts_verified(plan.step_id, spec.num_drafts, spec.num_draft_tokens,
                                       spec.num_accepted_tokens, list(spec.accepted_per_position))
        finished = [r for r in (self.requests.pop(o.req_id, None) for o in outputs.outputs if o.finished)
                    if r is not None]
        if finished:
            self.hooks.request_finished(finished)
        self.hooks.step_finished(plan, result, outputs, timings)

    def shutdown(self) -> None:
        self.hooks.shutdown(self)
        self.runner.shutdown()


class AsyncEngineCore:
    """Runs :class:`EngineCore` in a busy loop on the running asyncio (uvloop) event loop.

    Each request's output queue is registered before the request is enqueued (invariant 1). Steps
    run on one worker thread when ``step_in_thread`` (the default; ``executor``, one thread, if given:
    the core's builder's), so the event loop keeps serving HTTP during long steps; the scheduler is
    still only touched by one step at a time, and adds and aborts during a step are drained after it.
    """

    def __init__(self, core: EngineCore, *, step_in_thread: bool = True,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.core = core
        self._input: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}
        self._executor = executor or (ThreadPoolExecutor(1, "specloop-step") if step_in_thread else None)
        self._stopping = False
        self.errored: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self.num_steps = 0
        self.on_outputs: list[Callable[[EngineCoreOutputs], None]] = []

    # --- client side --------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run_busy_loop(), name="specloop-busy-loop")
        return self._task

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and self.errored is None

    def add_request(self, request: Request,
                    queue: asyncio.Queue[EngineCoreOutput] | None = None) -> asyncio.Queue[EngineCoreOutput]:
        """Register the request's output queue, then enqueue it. Pass ``queue`` to share one queue
        between requests (the ``n`` completions of one parent request)."""
        if self.errored is not None:
            raise EngineDeadError(f"engine is dead: {self.errored!r}")
        if request.request_id in self._queues:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if queue is None:
            queue = asyncio.Queue()
        self._queues[request.request_id] = queue  # before enqueueing (invariant 1)
        self._input.put_nowait(("add", request))
        return queue

    def abort(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self._queues.pop(rid, None)
        self._input.put_nowait(("abort", ids))

    async def shutdown(self) -> None:
        self._stopping = True
        self._input.put_nowait(("wake", None))
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.core.shutdown()

    # --- the loop -----------------------------------------------------------------------------

    async def run_busy_loop(self) -> None:
        try:
            while not self._stopping:
                await self._process_input_queue()
                if self._stopping:
                    break
                await self._process_engine_step()
        except Exception as e:  # an engine bug: fail every request loudly, stay inspectable
            logger.exception("engine step failed; the engine is now dead")
            self.errored = e
            self._fail_all(f"engine error: {e!r}")
        finally:
            if self._stopping:
                self._fail_all("engine shut down", reason=FinishReason.ABORT)

    async def _process_input_queue(self) -> None:
        if not self.core.has_unfinished_requests():
            self._handle(await self._input.get())  # idle: block, no spinning
        while not self._input.empty():
            self._handle(self._input.get_nowait())

    def _handle(self, item: tuple[str, Any]) -> None:
        kind, payload = item
        if kind == "add":
            if payload.request_id in self._queues:  # not aborted while queued
                self.core.add_requests([payload])
        elif kind == "abort":
            if self.core.abort_requests(payload) and not self.core.has_unfinished_requests():
                # No step follows while idle, so publish the stats now (nothing running, KV freed).
                self._dispatch(EngineCoreOutputs(scheduler_stats=self.core.scheduler.make_stats()))

    async def _process_engine_step(self) -> None:
        if not self.core.has_unfinished_requests():
            return
        if self._executor is not None:
            outputs = await asyncio.get_running_loop().run_in_executor(self._executor, self._step)
        else:
            outputs = self._step()
            await asyncio.sleep(0)  # let the event loop breathe between steps
        self.num_steps += 1
        self._dispatch(outputs)

    def _step(self) -> EngineCoreOutputs:
        outputs = self.core.step()
        self.core.post_step()
        return outputs

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            queue = self._queues.get(out.req_id)
            if queue is None:  # aborted meanwhile: late output is dropped (invariant 9)
                continue
            queue.put_nowait(out)
            if out.finished:
                del self._queues[out.req_id]
        for callback in self.on_outputs:
            callback(outputs)

    def _fail_all(self, message: str, reason: FinishReason = FinishReason.ERROR) -> None:
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(EngineCoreOutput(req_id=rid, new_token_ids=[], finish_reason=reason, error=message))
        self._queues.clear()

"""The busy loop: input draining, adds and aborts during a step, idling without CPU, post_step."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specloop.backends.scripted import ScriptedModelRunner, scripted_continuation
from specloop.kernel import (AsyncEngineCore, EngineConfig, EngineCore, EngineCoreOutput, EngineDeadError,
                             FinishReason, PluginManager, Request, SamplingParams, hookimpl)


def config(**kw) -> EngineConfig:
    return EngineConfig(model_runner="scripted", max_model_len=256, **kw)


def req(rid: str, n: int = 5, max_tokens: int = 8, start: int = 1) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def expected(request: Request) -> list[int]:
    return scripted_continuation(request.prompt_token_ids, request.max_tokens, 1000)


async def collect(queue: asyncio.Queue[EngineCoreOutput]) -> tuple[list[int], EngineCoreOutput]:
    tokens = []
    while True:
        out = await asyncio.wait_for(queue.get(), timeout=10)
        tokens += out.new_token_ids
        if out.finished:
            return tokens, out


class GatedRunner(ScriptedModelRunner):
    """Blocks inside ``execute_model`` until the test opens the gate, so the test can act while a
    step is running."""

    def __init__(self, cfg: EngineConfig) -> None:
        super().__init__(cfg)
        self.in_step = threading.Event()
        self.gate = threading.Event()
        self.plans = []

    def execute_model(self, plan) -> None:
        self.plans.append(plan)
        self.in_step.set()
        assert self.gate.wait(10), "test never opened the gate"
        super().execute_model(plan)


async def wait_for_event(event: threading.Event) -> None:
    for _ in range(1000):
        if event.is_set():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("event never set")


async def test_requests_stream_to_their_queues():
    engine = AsyncEngineCore(EngineCore(config()))
    engine.start()
    try:
        requests = [req(f"r{i}", n=3 + i, start=10 * i + 1) for i in range(4)]
        queues = [engine.add_request(r) for r in requests]
        results = await asyncio.gather(*(collect(q) for q in queues))
        for request, (tokens, last) in zip(requests, results):
            assert tokens == expected(request) and last.finish_reason == FinishReason.LENGTH
        assert not engine.core.has_unfinished_requests()
    finally:
        await engine.shutdown()


async def test_output_queue_is_registered_before_the_request_is_enqueued():
    engine = AsyncEngineCore(EngineCore(config()))
    queue = engine.add_request(req("a"))  # the loop is not even running yet
    assert engine._queues["a"] is queue and engine._input.qsize() == 1
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(req("a"))
    engine.start()
    tokens, _ = await collect(queue)
    assert tokens == expected(req("a"))
    await engine.shutdown()


async def test_adds_and_aborts_arriving_during_a_step():
    runner = GatedRunner(config())
    engine = AsyncEngineCore(EngineCore(config(), runner=runner))
    engine.start()
    try:
        qa = engine.add_request(req("a", max_tokens=50))
        await wait_for_event(runner.in_step)  # step 1 (a's prefill) is running now
        qb = engine.add_request(req("b", start=100))
        engine.abort(["a", "never-existed"])
        assert "a" not in engine._queues  # nothing more reaches a's consumer
        runner.gate.set()
        tokens, last = await collect(qb)
        assert tokens == expected(req("b", start=100)) and last.finish_reason == FinishReason.LENGTH
        assert qa.empty()  # a's late output from the running step was dropped (invariant 9)
        assert not engine.core.has_unfinished_requests() and engine.core.kv_cache.usage == 0.0
        assert "a" in runner.plans[1].finished_req_ids  # the runner was told to drop a
        assert all("a" not in p.num_scheduled_tokens for p in runner.plans[1:])
        assert engine.is_running
    finally:
        runner.gate.set()
        await engine.shutdown()


async def test_abort_of_an_unknown_id_is_harmless():
    engine = AsyncEngineCore(EngineCore(config()))
    engine.start()
    try:
        engine.abort("nobody")
        engine.abort(["nobody", "nobody-else"])
        tokens, _ = await collect(engine.add_request(req("a")))
        assert tokens == expected(req("a")) and engine.is_running and engine.errored is None
    finally:
        await engine.shutdown()


async def test_abort_of_a_waiting_request_reaches_the_scheduler():
    class Recorder:
        def __init__(self) -> None:
            self.finished: list[tuple[str, str]] = []

        @hookimpl
        def specloop_request_finished(self, requests):
            self.finished += [(r.request_id, r.status.name) for r in requests]

    recorder = Recorder()
    cfg = config(max_num_seqs=1)
    runner = GatedRunner(cfg)
    engine = AsyncEngineCore(EngineCore(cfg, plugins=PluginManager([recorder], load_entrypoints=False),
                                        runner=runner))
    engine.start()
    try:
        qa = engine.add_request(req("a", max_tokens=20))
        engine.add_request(req("b", start=50))
        await wait_for_event(runner.in_step)
        assert [r.request_id for r in engine.core.scheduler.waiting] == ["b"]  # max_num_seqs=1
        engine.abort("b")
        runner.gate.set()
        tokens, _ = await collect(qa)
        assert len(tokens) == 20 and not engine.core.has_unfinished_requests()
        assert recorder.finished == [("b", "FINISHED_ABORTED"), ("a", "FINISHED_LENGTH")]
        assert all("b" not in p.num_scheduled_tokens for p in runner.plans)
    finally:
        runner.gate.set()
        await engine.shutdown()


async def test_idle_engine_awaits_the_input_queue():
    core = EngineCore(config())
    calls = {"step": 0, "poll": 0}
    original_step, original_poll = core.step, core.has_unfinished_requests

    def counting_step():
        calls["step"] += 1
        return original_step()

    def counting_poll():
        calls["poll"] += 1
        return original_poll()

    core.step, core.has_unfinished_requests = counting_step, counting_poll
    engine = AsyncEngineCore(core)
    task = engine.start()
    try:
        await asyncio.sleep(0.05)
        polls_before = calls["poll"]
        await asyncio.sleep(0.2)
        assert calls["step"] == 0 and engine.num_steps == 0
        assert calls["poll"] == polls_before  # nothing spins while idle
        # The loop task is suspended in Queue.get, not sleeping and re-checking.
        chain, coro = [], task.get_coro()
        while coro is not None and hasattr(coro, "cr_code"):
            chain.append(coro.cr_code.co_name)
            coro = coro.cr_await
        assert chain[:3] == ["run_busy_loop", "_process_input_queue", "get"]
        tokens, _ = await collect(engine.add_request(req("wake")))
        assert tokens == expected(req("wake")) and calls["step"] >= 8
    finally:
        await engine.shutdown()


async def test_post_step_hands_drafts_back_and_outputs_do_not_change():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    results = {}
    for name, cfg in {"plain": config(), "spec": config(speculative_config=spec,
                                                         plugin_options={"scripted": {"draft_accuracy": 0.7}})}.items():
        engine = AsyncEngineCore(EngineCore(cfg))
        engine.start()
        try:
            requests = [req(f"r{i}", n=4 + i, max_tokens=24, start=7 * i + 1) for i in range(3)]
            results[name] = await asyncio.gather(*(collect(engine.add_request(r)) for r in requests))
            results[name + "_steps"] = engine.num_steps
        finally:
            await engine.shutdown()
    assert [t for t, _ in results["spec"]] == [t for t, _ in results["plain"]]
    assert results["spec_steps"] < results["plain_steps"]  # accepted drafts saved steps


async def test_engine_error_fails_every_request_and_refuses_new_ones():
    class Broken(ScriptedModelRunner):
        def sample_tokens(self, grammar=None):
            raise RuntimeError("device fell over")

    engine = AsyncEngineCore(EngineCore(config(), runner=Broken(config())))
    engine.start()
    try:
        tokens, last = await collect(engine.add_request(req("a")))
        assert last.finish_reason == FinishReason.ERROR and "device fell over" in last.error
        with pytest.raises(EngineDeadError):
            engine.add_request(req("b"))
    finally:
        await engine.shutdown()


async def test_shutdown_aborts_pending_requests():
    runner = GatedRunner(config())
    engine = AsyncEngineCore(EngineCore(config(), runner=runner))
    engine.start()
    queue = engine.add_request(req("a", max_tokens=100))
    await wait_for_event(runner.in_step)
    stopping = asyncio.ensure_future(engine.shutdown())
    await asyncio.sleep(0.01)
    runner.gate.set()
    await stopping
    tokens, last = await collect(queue)
    assert last.finish_reason == FinishReason.ABORT

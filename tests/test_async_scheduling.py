"""Asynchronous scheduling: the next step is planned and launched before this one's tokens are
committed. With the torch runner the step runs on a worker thread; outputs must be exactly those of
synchronous scheduling, greedy and seeded, through chunked prefill, prefix hits, preemption, stops
and aborts, and nothing may leak (the GPU runner's device-side variant is checked under the Triton
interpreter in ``runner_checks.py`` and on CUDA in ``test_gpu_backend.py``)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from scripted_policy import Alternating, OverlapCounter

from specloop import LLM, AsyncEngine, SamplingParams
from specloop.frontend.engine_builder import make_config

PROMPTS = ["def read(path):\n", "import os\nimport sys\n\n\n", "class Stack:\n    def push(self, item):",
           "for key, value in", "    return self._", "if __name__ == '__main__':\n"]
# A small KV cache (preemption), a small token budget (chunked prefill), block size 4 (prefix hits
# on the shared "    " starts).
ENGINE = dict(block_size=4, num_kv_blocks=30, max_model_len=96, max_num_batched_tokens=24, max_num_seqs=5)


def params() -> list[SamplingParams]:
    out = []
    for i in range(len(PROMPTS)):
        if i % 3 == 0:
            out.append(SamplingParams(max_tokens=40, temperature=0.0))
        elif i % 3 == 1:
            out.append(SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=7 + i))
        else:  # stops: a token stop, a stop string, EOS allowed
            out.append(SamplingParams(max_tokens=35, temperature=0.0, stop=["= item", "modules, sys"],
                                      stop_token_ids=[1018]))
    return out


def run(mode: bool) -> tuple[list[tuple], dict]:
    llm = LLM(async_scheduling=mode, **ENGINE)
    try:
        assert llm.config.async_scheduling is mode
        outs = llm.generate(PROMPTS * 2, params() * 2, use_tqdm=False)
        stats = llm.get_metrics()
        assert llm.core.scheduler.kv_cache.usage == 0.0 and not llm.core.has_unfinished_requests()
        return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs], stats
    finally:
        llm.core.shutdown()


def test_async_scheduling_changes_no_output():
    sync, sync_stats = run(False)
    overlap, async_stats = run(True)
    assert overlap == sync
    assert sync_stats["num_preemptions"] > 0 and async_stats["num_preemptions"] > 0  # the cache was tight
    assert sync_stats["prefix_cache_hits"] > 0
    assert {reason for _, _, reason in sync} >= {"length", "stop"}


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_speculation_under_async_scheduling_overlaps_the_steps_without_drafts(method):
    """With drafts in runs (a policy that turns drafting on and off), steps without drafts overlap
    the next one, steps with drafts are committed before the next plan, and greedy output equals
    synchronous scheduling without drafts, through chunked prefill, prefix hits, preemption and
    stops. EAGLE-3 skips those steps too: its cache catches up from the hidden states it recorded."""
    from specloop.frontend.model_path import default_model_dir

    greedy = [SamplingParams(max_tokens=36, temperature=0.0, stop=["= item"] if i % 2 else None)
              for i in range(len(PROMPTS))]
    plain = LLM(**ENGINE)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS * 2, greedy * 2, use_tqdm=False)]
    plain.core.shutdown()
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    else:
        spec["model"] = default_model_dir("specloop-tiny-draft" if method == "draft_model" else "specloop-tiny-eagle3")
    llm = LLM(async_scheduling=True, speculative_config=spec, **ENGINE)
    try:
        core = llm.core
        core.runner.drafter.policy = Alternating()
        overlapped = OverlapCounter(core)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, greedy * 2, use_tqdm=False)]
        metrics = llm.get_metrics()
        assert core.scheduler.kv_cache.usage == 0.0 and not core.has_unfinished_requests()
    finally:
        llm.core.shutdown()
    assert got == want
    assert metrics["spec_num_accepted_tokens"] > 0 and metrics["num_preemptions"] > 0
    assert overlapped.count > 10


def test_placeholders_are_cleared_by_commits_and_preemption():
    llm = LLM(async_scheduling=True, **ENGINE)
    try:
        core = llm.core
        for i, p in enumerate(PROMPTS):
            core.add_requests(llm.processor.make_requests(f"r{i}", llm.processor.parse(p)[1],
                                                          SamplingParams(max_tokens=20, ignore_eos=True)))
        seen_in_flight = 0
        while core.has_unfinished_requests():
            core.step()
            seen_in_flight = max(seen_in_flight, len(core.in_flight))
            for request in core.scheduler.requests.values():
                # At most one launched step is uncommitted, so at most one placeholder each.
                assert request.num_output_placeholders in (0, 1)
                assert request.num_tokens + request.num_output_placeholders >= request.num_computed_tokens
        assert seen_in_flight == 1 and not core.in_flight
    finally:
        llm.core.shutdown()


async def test_aborts_mid_stream_leave_the_others_exact():
    alone = LLM(**ENGINE)
    try:
        want = alone.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False)
    finally:
        alone.core.shutdown()
    engine = AsyncEngine(make_config(None, {**ENGINE, "async_scheduling": True}))
    await engine.start()
    try:
        async def consume(i: int, stop_after: int | None) -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate(PROMPTS[i], SamplingParams(max_tokens=40, temperature=0.0,
                                                                        ignore_eos=stop_after is not None),
                                             f"r{i}", delta=True):
                tokens += out.outputs[0].token_ids
                if stop_after is not None and len(tokens) >= stop_after:
                    break  # the consumer goes away: the request is aborted
            return tokens

        results = await asyncio.gather(consume(0, None), *(consume(i, 3 + i) for i in range(1, len(PROMPTS))))
        assert results[0] == want[0].outputs[0].token_ids
        # The busy loop takes inputs in order: by the time a request added after the aborts has
        # finished, every aborted request has released its blocks, and so has the finished one.
        async for out in engine.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0), "last"):
            pass
        assert out.outputs[0].token_ids == want[0].outputs[0].token_ids[:5]
        assert engine.core.scheduler.kv_cache.usage == 0.0
    finally:
        await engine.shutdown()


def test_structured_outputs_keep_the_overlap_and_change_no_output():
    """Constrained requests do not force synchronous steps: the previous plan is committed (its
    tokens into the matchers) while the next forward runs, then that plan's masks are filled;
    outputs equal synchronous scheduling's, through preemption."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 50}},
              "required": ["name", "n"], "additionalProperties": False}

    def constrained(i: int) -> SamplingParams:
        so = {"json": schema} if i % 2 == 0 else {"regex": "[a-z]{2,8}( [0-9]{1,3}){2}"}
        return SamplingParams(max_tokens=40, temperature=0.0 if i % 3 else 0.8, seed=11 + i, structured_outputs=so)

    prompts = PROMPTS * 2
    all_params = [constrained(i) if i % 2 == 0 else p for i, p in enumerate(params() * 2)]
    results, overlapped = {}, {}
    for mode in (False, True):
        llm = LLM(async_scheduling=mode, **ENGINE)
        try:
            core, seen = llm.core, 0
            step = core.step

            def counting_step():
                nonlocal seen
                out = step()
                seen += bool(core.in_flight) and core.structured_output.has_active()
                return out

            core.step = counting_step
            outs = llm.generate(prompts, all_params, use_tqdm=False)
            results[mode] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                             for o in outs]
            overlapped[mode] = seen
            assert llm.get_metrics()["num_preemptions"] > 0
            assert core.scheduler.kv_cache.usage == 0.0 and not core.has_unfinished_requests()
        finally:
            llm.core.shutdown()
    assert results[True] == results[False]
    assert overlapped[False] == 0 and overlapped[True] > 20
    stopped = 0
    for (_, text, reason), p in zip(results[True], all_params):
        so = p.structured_outputs
        if so is None or reason != "stop":
            continue
        stopped += 1
        if so.json is not None:
            jsonschema.validate(json.loads(text), schema)
        else:
            assert re.fullmatch(so.regex, text), text
    assert stopped >= 2


def test_aborts_between_steps_with_and_without_drafts_leak_nothing():
    """Requests aborted while a step with drafts, or an overlapped one, is in flight: the others'
    greedy output is exact and every block comes back."""
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = LLM(**ENGINE)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy, use_tqdm=False)]
    plain.core.shutdown()
    llm = LLM(async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 1}, **ENGINE)
    try:
        core = llm.core
        core.runner.drafter.policy = Alternating(on=2, off=3)
        for i, p in enumerate(PROMPTS):
            core.add_requests(llm.processor.make_requests(f"r{i}", llm.processor.parse(p)[1], greedy))
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        aborted, steps, kinds, accepted = set(), 0, set(), 0
        while core.has_unfinished_requests():
            outs = core.step()
            core.post_step()
            steps += 1
            spec = outs.scheduler_stats.spec_decoding if outs.scheduler_stats is not None else None
            accepted += spec.num_accepted_tokens if spec is not None else 0
            if core.in_flight:
                kinds.add(getattr(core.in_flight[-1][1], "overlaps", True))
            for out in outs.outputs:
                got[out.req_id] += out.new_token_ids
            if steps in (9, 14, 22):  # odd request ids, at different points of the on/off runs
                victim = f"r{2 * len(aborted) + 1}"
                core.abort_requests([victim])
                aborted.add(victim)
        assert core.scheduler.kv_cache.usage == 0.0 and not core.scheduler.requests
        assert accepted > 0 and True in kinds
    finally:
        llm.core.shutdown()
    for i, tokens in enumerate(want):
        rid = f"r{i}"
        if rid in aborted:
            assert got[rid] == list(tokens[:len(got[rid])])
        else:
            assert got[rid] == list(tokens), rid


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_proposer_that_skips_steps_drafts_as_if_called_every_step(method):
    """EAGLE-3 and MTP build their caches from every position's hidden states. After a step the
    policy drafts nothing for they are not called (``skip``), and the next proposal first feeds
    what they missed from the states the target's forward recorded: the drafts of every later
    proposal are exactly those of a run that proposed (zero drafts) after every step, with the
    catch-up cut into forwards of at most 8 rows."""
    from specloop.frontend.model_path import default_model_dir

    path = default_model_dir("specloop-tiny-mtp" if method == "mtp" else "specloop-tiny")
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        spec["model"] = default_model_dir("specloop-tiny-eagle3")
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    drafts, skipped = {}, {}
    for skips in (False, True):
        llm = LLM(path, speculative_config=spec, **ENGINE)
        try:
            drafter = llm.core.runner.drafter
            drafter.policy = Alternating()
            proposer = drafter.proposer
            proposer.catches_up = skips
            if skips:
                proposer.recorded.max_rows = 8
            seen, calls = [], []
            propose, skip = proposer.propose, proposer.skip

            def recording(inputs, propose=propose, seen=seen):
                proposal = propose(inputs)
                if drafter.policy.active:
                    seen.append(dict(zip(inputs.req_ids, map(list, proposal.draft_token_ids))))
                return proposal

            def counting(skip=skip, calls=calls):
                calls.append(1)
                skip()

            proposer.propose, proposer.skip = recording, counting
            llm.generate(PROMPTS, greedy, use_tqdm=False)
            drafts[skips], skipped[skips] = seen, len(calls)
        finally:
            llm.core.shutdown()
    assert skipped[False] == 0 and skipped[True] > 10
    assert len(drafts[True]) > 10 and drafts[True] == drafts[False]


def _thread_recorder(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[int]]:
    """Which threads load the model and run its forward (a CPU's intra-op threads are per calling
    thread: a second thread with parallel work of its own makes every step ~3x slower)."""
    import threading

    from specloop.backends import runner as runner_module

    seen: dict[str, set[int]] = {"load": set(), "forward": set()}
    load = runner_module.load_model

    def recording_load(*args, **kwargs):
        seen["load"].add(threading.get_ident())
        model, config = load(*args, **kwargs)
        model.register_forward_pre_hook(lambda *_: seen["forward"].add(threading.get_ident()))
        return model, config

    monkeypatch.setattr(runner_module, "load_model", recording_load)
    return seen


def test_a_cpu_runner_that_overlaps_keeps_its_torch_work_on_its_worker(monkeypatch):
    import threading

    seen = _thread_recorder(monkeypatch)
    llm = LLM(async_scheduling=True, **ENGINE)
    try:
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.core.shutdown()
    assert len(seen["load"]) == 1 and seen["forward"] == seen["load"]
    assert threading.get_ident() not in seen["load"]


async def test_an_async_engine_is_built_on_the_thread_that_steps_it(monkeypatch):
    import threading

    seen = _thread_recorder(monkeypatch)
    engine = AsyncEngine.from_engine_args(**ENGINE)
    try:
        outs = [o async for o in engine.generate(PROMPTS[0], SamplingParams(max_tokens=4), "a")]
        assert outs[-1].finished
    finally:
        await engine.shutdown()
    assert len(seen["load"]) == 1 and seen["forward"] == seen["load"]
    assert threading.get_ident() not in seen["load"]

"""The token-debt scheduler: budgets, chunking, drafts, preemption, priority, stops and aborts."""

from __future__ import annotations

import pytest

from specloop.kernel import (EngineConfig, EngineCore, FinishReason, ModelRunnerOutput, Request, RequestStatus,
                             SamplingParams, TokenLogprobs)
from specloop.kernel.outputs import DraftTokenIds
from specloop.plugins.kv_cache import PagedKVCache
from specloop.plugins.scheduler import FCFSScheduler, PriorityScheduler


def make(cls: type[FCFSScheduler] = FCFSScheduler, *, num_blocks: int = 1000, block_size: int = 16,
         max_model_len: int = 512, budget: int = 8192, threshold: int = 0, chunked: bool = True,
         max_num_seqs: int = 256, num_spec: int = 0, caching: bool = True) -> FCFSScheduler:
    spec = {"method": "ngram", "num_speculative_tokens": num_spec} if num_spec else None
    config = EngineConfig(block_size=block_size, max_model_len=max_model_len, max_num_batched_tokens=budget,
                          long_prefill_token_threshold=threshold, enable_chunked_prefill=chunked,
                          max_num_seqs=max_num_seqs, speculative_config=spec)
    config.resolve(None)
    return cls(config, PagedKVCache(config, num_blocks, enable_caching=caching))


def req(rid: str, n: int | list[int], *, start: int = 1000, eos: tuple[int, ...] = (), priority: int = 0,
        arrival: float | None = None, **params) -> Request:
    tokens = n if isinstance(n, list) else list(range(start, start + n))
    kw = {"arrival_time": arrival} if arrival is not None else {}
    params.setdefault("max_tokens", 100)
    return Request(rid, tokens, SamplingParams(**params), eos_token_ids=eos, priority=priority, **kw)


def step(sched: FCFSScheduler, sampled: dict[str, list[int]] | None = None, token: int = 7, logprobs=None):
    """One step with a fake runner: requests that reach their last token sample ``token`` after
    accepting all their drafts, unless ``sampled`` says otherwise."""
    plan = sched.schedule()
    ids, out = [], []
    for rid in plan.num_scheduled_tokens:
        request = sched.requests.get(rid)
        ids.append(rid)
        if sampled is not None and rid in sampled:
            out.append(sampled[rid])
        elif request is None or request.num_computed_tokens < request.num_tokens:
            out.append([])  # a partial prefill samples nothing
        else:
            out.append(plan.scheduled_spec_decode_tokens.get(rid, []) + [token])
    outputs = sched.update_from_output(plan, ModelRunnerOutput(ids, out, logprobs=logprobs))
    return plan, outputs


def test_long_prompts_are_chunked_by_threshold_then_budget():
    sched = make(budget=1024, threshold=400, max_model_len=4096)
    for i, rid in enumerate("abc"):
        sched.add_request(req(rid, 800, start=10_000 * (i + 1)))
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"a": 400, "b": 400, "c": 224}
    assert [d.req_id for d in plan.scheduled_new_reqs] == ["a", "b", "c"]
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"a": 400, "b": 400, "c": 224}
    assert [d.num_computed_tokens for d in plan.scheduled_running_reqs] == [400, 400, 224]
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1, "c": 352}
    assert plan.total_num_scheduled_tokens == 354


def test_partial_prefill_then_exactly_the_remainder_even_with_drafts_pending():
    sched = make(budget=50, num_spec=3)
    sched.add_request(r := req("r", 80))
    plan, outputs = step(sched)
    assert plan.num_scheduled_tokens == {"r": 50} and outputs.outputs == []
    sched.update_draft_token_ids(DraftTokenIds(["r"], [[1, 2, 3]]))
    assert r.spec_token_ids == []  # drafts for a request still in its prefill are ignored
    r.spec_token_ids = [1, 2, 3]  # ... and even if some are pending, a prefill chunk carries none
    plan, outputs = step(sched)
    assert plan.num_scheduled_tokens == {"r": 30} and plan.scheduled_spec_decode_tokens == {}
    assert outputs.outputs[0].new_token_ids == [7] and r.num_computed_tokens == 80
    sched.update_draft_token_ids(DraftTokenIds(["r"], [[5, 6, 8]]))
    plan, _ = step(sched, sampled={"r": [5, 9]})  # first draft accepted, the second rejected
    assert plan.num_scheduled_tokens == {"r": 4} and plan.scheduled_spec_decode_tokens == {"r": [5, 6, 8]}
    assert sched.num_lookahead_tokens == 3
    assert r.output_token_ids == [7, 5, 9] and r.num_computed_tokens == r.num_tokens - 1 == 82


def test_drafts_that_do_not_fit_the_budget_are_dropped():
    sched = make(budget=6, num_spec=3)
    for rid in "ab":
        sched.add_request(req(rid, 2, start=ord(rid) * 10))
    step(sched)
    sched.update_draft_token_ids(DraftTokenIds(["a", "b"], [[1, 2, 3], [4, 5, 6]]))
    plan, outputs = step(sched)
    assert plan.num_scheduled_tokens == {"a": 4, "b": 2}
    assert plan.scheduled_spec_decode_tokens == {"a": [1, 2, 3], "b": [4]}
    assert {o.req_id: o.new_token_ids for o in outputs.outputs} == {"a": [1, 2, 3, 7], "b": [4, 7]}
    assert sched.requests["b"].spec_token_ids == []  # cleared once scheduled
    stats = outputs.scheduler_stats
    assert (stats.spec_decoding.num_drafts, stats.spec_decoding.num_draft_tokens,
            stats.spec_decoding.num_accepted_tokens) == (2, 4, 4)
    assert stats.spec_decoding.accepted_per_position == [2, 1, 1]


def test_rejected_drafts_roll_back_num_computed_tokens():
    sched = make(num_spec=4)
    sched.add_request(r := req("r", 5))
    step(sched)
    sched.update_draft_token_ids(DraftTokenIds(["r"], [[1, 2, 3, 4]]))
    plan, outputs = step(sched, sampled={"r": [1, 2, 9]})
    assert plan.num_scheduled_tokens == {"r": 5}
    out = outputs.outputs[0]
    assert (out.num_draft_tokens, out.num_accepted_tokens, out.new_token_ids) == (4, 2, [1, 2, 9])
    assert r.num_computed_tokens == 5 + 1 + 2 and r.num_tokens == 9
    assert outputs.scheduler_stats.spec_decoding.accepted_per_position == [1, 1, 0, 0]
    assert (r.num_draft_tokens, r.num_accepted_tokens) == (4, 2)


def test_a_plan_made_before_a_verification_commits_assumes_every_draft_accepted():
    # The GPU runner reads a verification a step late: the next plan is made first, with the
    # placeholder drafts proposed on the device, and the commit rolls back what was rejected.
    sched = make(num_spec=3, block_size=4)
    sched.add_request(r := req("r", 5))
    step(sched)
    assert (r.num_tokens, r.num_computed_tokens) == (6, 5)
    sched.update_draft_token_ids(DraftTokenIds(["r"], [[1, 2, 3]]))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"r": 4} and r.num_output_placeholders == 4
    sched.update_draft_token_ids(DraftTokenIds(["r"], [[-1, -1, -1]]))  # taken before the commit
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"r": 4} and second.scheduled_spec_decode_tokens == {"r": [-1, -1, -1]}
    assert second.scheduled_running_reqs[0].num_computed_tokens == 9  # after 5 + 4, all accepted
    assert (r.num_computed_tokens, r.num_output_placeholders) == (13, 8)
    assert len(sched.kv_cache.get_block_ids("r")) * 4 >= 13 + 3  # the second step's drafts' slots too
    out = sched.update_from_output(first, ModelRunnerOutput(["r"], [[1, 9]])).outputs[0]
    assert (out.new_token_ids, out.num_accepted_tokens) == ([1, 9], 1)
    # Two rejected: the second step really ran from position 7, the next token's.
    assert (r.num_tokens, r.num_computed_tokens, r.num_output_placeholders) == (8, 11, 4)
    sched.update_from_output(second, ModelRunnerOutput(["r"], [[5]]))
    assert (r.num_tokens, r.num_computed_tokens, r.num_output_placeholders) == (9, 8, 0)
    third = sched.schedule()
    assert third.num_scheduled_tokens == {"r": 1} and third.scheduled_running_reqs[0].num_computed_tokens == 8


def test_running_requests_are_served_before_waiting_ones():
    sched = make(budget=8)
    sched.add_request(req("old", 3))
    step(sched)
    sched.add_request(req("new", 20))
    plan, _ = step(sched)
    assert list(plan.num_scheduled_tokens.items()) == [("old", 1), ("new", 7)]
    sched.add_request(req("newer", 5))
    plan, _ = step(sched)
    assert list(plan.num_scheduled_tokens.items()) == [("old", 1), ("new", 7)]  # newer waits


def test_plan_carries_new_tokens_and_new_blocks_only():
    sched = make(block_size=4)
    sched.add_request(req("r", 7))
    plan, _ = step(sched)
    (new,) = plan.scheduled_new_reqs
    assert new.block_ids == sched.kv_cache.get_block_ids("r") and len(new.block_ids) == 2
    assert new.num_computed_tokens == 0 and new.output_token_ids == []
    plan, _ = step(sched, token=8)  # position 7 still fits the second block
    (cached,) = plan.scheduled_running_reqs
    assert (cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens) == ([7], [], 7)
    plan, _ = step(sched)
    (cached,) = plan.scheduled_running_reqs
    assert cached.new_token_ids == [8] and cached.num_computed_tokens == 8
    assert cached.new_block_ids == sched.kv_cache.get_block_ids("r")[2:] and len(cached.new_block_ids) == 1


def test_preemption_frees_the_most_recent_and_resumes_with_every_token():
    sched = make(block_size=4, num_blocks=5, max_model_len=16)  # 4 usable blocks
    sched.add_request(a := req("a", 6, start=100))
    sched.add_request(b := req("b", 6, start=200))
    step(sched)
    assert sched.kv_cache.num_free_blocks == 0
    step(sched)
    step(sched)  # positions 6 and 7 still fit both second blocks
    b_outputs = list(b.output_token_ids)
    sched.add_request(req("c", 2, start=300))
    plan, outputs = step(sched)  # a needs a third block: b, the most recently admitted, is preempted
    assert plan.preempted_req_ids == {"b"} and plan.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # front of the queue; c not admitted
    assert sched.kv_cache.get_block_ids("b") == []
    stats = outputs.scheduler_stats
    assert stats.num_preemptions == 1 and stats.num_waiting_reqs == 2
    while "b" not in {d.req_id for d in plan.scheduled_resumed_reqs}:
        plan, _ = step(sched)
    (resumed,) = plan.scheduled_resumed_reqs
    assert resumed.prompt_token_ids == list(range(200, 206)) and resumed.output_token_ids == b_outputs
    assert resumed.block_ids == sched.kv_cache.get_block_ids("b")
    assert plan.num_scheduled_tokens["b"] == len(b_outputs) + 6 - resumed.num_computed_tokens
    assert a.is_finished or a.status == RequestStatus.RUNNING


def test_preemption_keeps_every_token_end_to_end():
    """Scripted outputs are identical with a pool that forces preemption and one that doesn't."""
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        config = EngineConfig(model_runner="scripted", block_size=4, num_kv_blocks=num_blocks, max_model_len=64,
                              speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                              plugin_options={"scripted": {"draft_accuracy": 0.5}})
        core = EngineCore(config)
        core.add_requests([req(f"r{i}", 5 + 3 * i, start=17 * i + 1, max_tokens=30) for i in range(6)])
        tokens: dict[str, list[int]] = {}
        preemptions = 0
        while core.has_unfinished_requests():
            outputs = core.step()
            core.post_step()
            preemptions += outputs.scheduler_stats.num_preemptions
            for out in outputs.outputs:
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        return tokens, preemptions

    small, n_small = run(num_blocks=17)
    big, n_big = run(num_blocks=200)
    assert n_small > 0 and n_big == 0
    assert small == big and len(big) == 6 and all(len(t) == 30 for t in big.values())


def test_priority_orders_waiting_by_priority_then_arrival():
    sched = make(PriorityScheduler, max_num_seqs=2)
    sched.add_request(req("low", 3, priority=5, arrival=1.0))
    sched.add_request(req("high-late", 3, priority=0, arrival=3.0))
    sched.add_request(req("high-early", 3, priority=0, arrival=2.0))
    sched.add_request(req("mid", 3, priority=1, arrival=0.5))
    assert [r.request_id for r in sched.waiting] == ["high-early", "high-late", "mid", "low"]
    plan, _ = step(sched)
    assert list(plan.num_scheduled_tokens) == ["high-early", "high-late"]


def test_priority_victim_is_lowest_priority_then_latest_arrival():
    sched = make(PriorityScheduler, block_size=4, num_blocks=5, max_model_len=16)
    sched.add_request(req("a", 4, start=100, priority=1, arrival=1.0))
    sched.add_request(req("b", 4, start=200, priority=2, arrival=2.0))
    sched.add_request(req("c", 4, start=300, priority=2, arrival=3.0))
    sched.add_request(req("d", 4, start=400, priority=0, arrival=4.0))
    step(sched)  # all four admitted, every block used
    plan, _ = step(sched)  # each needs a second block: c goes first, then b
    assert [sorted(plan.preempted_req_ids), sorted(plan.num_scheduled_tokens)] == [["b", "c"], ["a", "d"]]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_priority_victim_already_scheduled_this_step_is_taken_back():
    sched = make(PriorityScheduler, block_size=4, num_blocks=5, max_model_len=16)
    sched.add_request(x := req("x", 7, start=100, priority=3))
    step(sched)
    sched.add_request(req("y", 4, start=200, priority=0))
    step(sched)  # x: 2 blocks, y: 1 block, 1 free
    plan, _ = step(sched)  # x takes the free block, then y needs one: x is the victim
    assert plan.num_scheduled_tokens == {"y": 1} and plan.total_num_scheduled_tokens == 1
    assert plan.preempted_req_ids == {"x"} and plan.scheduled_running_reqs[0].req_id == "y"
    assert x.status == RequestStatus.PREEMPTED and x.num_computed_tokens == 0
    assert sched.kv_cache.get_block_ids("x") == []


@pytest.mark.parametrize("cls", [FCFSScheduler, PriorityScheduler])
def test_equal_requests_that_do_not_fit_together_all_finish(cls):
    """The ``n`` completions of one request share its priority and arrival time and sample tokens
    of their own. Where they do not fit together, the one preempted must be the one admitted last:
    preempting the one furthest along (the first of equals) had them preempt each other forever,
    each re-prefill (in chunks of 8) giving the others time to evict its cached blocks."""
    sched = make(cls, block_size=4, num_blocks=36, max_model_len=128, threshold=8)
    for i in range(3):
        sched.add_request(req(f"{i}_r", 62, start=10, max_tokens=57, arrival=5.0))
    steps = 0
    while sched.has_unfinished_requests() and steps < 1000:
        plan = sched.schedule()
        ids = list(plan.num_scheduled_tokens)
        done = [sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens for r in ids]
        sampled = [[7 + int(r[0])] if d else [] for r, d in zip(ids, done)]  # a token of each one's own
        sched.update_from_output(plan, ModelRunnerOutput(ids, sampled))
        steps += 1
    assert not sched.has_unfinished_requests(), [(r.request_id, r.num_preemptions) for r in sched.requests.values()]
    assert sched.kv_cache.usage == 0.0 and steps < 300, steps


@pytest.mark.parametrize("cls", [FCFSScheduler, PriorityScheduler])
def test_lone_request_that_cannot_grow_is_preempted_then_fits_again(cls):
    sched = make(cls, block_size=4, num_blocks=3, max_model_len=8)  # 2 usable blocks
    sched.add_request(req("a", 4, start=10, max_tokens=4))
    sched.add_request(req("b", 4, start=20, max_tokens=4))
    for _ in range(40):
        if not sched.has_unfinished_requests():
            break
        step(sched)
    assert not sched.has_unfinished_requests() and sched.kv_cache.usage == 0.0


def test_eos_stop_token_ignore_eos_and_min_tokens():
    sched = make()
    sched.add_request(e := req("eos", 3, eos=(2,)))
    sched.add_request(s := req("stopid", 3, start=50, stop_token_ids=[5]))
    sched.add_request(i := req("ignore", 3, start=90, eos=(2,), ignore_eos=True, max_tokens=2))
    sched.add_request(m := req("min", 3, start=130, eos=(2,), min_tokens=3))
    _, outputs = step(sched, sampled={"eos": [2], "stopid": [5], "ignore": [2], "min": [2]})
    by_id = {o.req_id: o for o in outputs.outputs}
    assert (by_id["eos"].finish_reason, by_id["eos"].stop_reason) == (FinishReason.STOP, None)
    assert (by_id["stopid"].finish_reason, by_id["stopid"].stop_reason) == (FinishReason.STOP, 5)
    assert e.status == s.status == RequestStatus.FINISHED_STOPPED
    assert not by_id["ignore"].finished and not by_id["min"].finished
    _, outputs = step(sched, sampled={"ignore": [2], "min": [2]})
    assert i.status == RequestStatus.FINISHED_LENGTH and m.status == RequestStatus.RUNNING
    _, outputs = step(sched, sampled={"min": [2]})
    assert m.status == RequestStatus.FINISHED_STOPPED and m.output_token_ids == [2, 2, 2]
    assert outputs.outputs[0].finish_reason == FinishReason.STOP
    assert not sched.has_unfinished_requests() and sched.kv_cache.usage == 0.0


def test_stop_inside_accepted_drafts_truncates_exactly_there():
    sched = make(num_spec=4)
    sched.add_request(r := req("r", 3, eos=(2,)))
    step(sched)
    sched.update_draft_token_ids(DraftTokenIds(["r"], [[4, 2, 5, 6]]))
    lp = [[TokenLogprobs(t, -0.1 * t, 1) for t in (4, 2, 5, 6, 8)]]
    _, outputs = step(sched, sampled={"r": [4, 2, 5, 6, 8]}, logprobs=lp)
    (out,) = outputs.outputs
    assert out.new_token_ids == [4, 2] and out.finish_reason == FinishReason.STOP
    assert [x.token_id for x in out.new_logprobs] == [4, 2]
    assert r.output_token_ids == [7, 4, 2]
    assert outputs.scheduler_stats.num_generation_tokens == 2  # the tokens after the stop don't count
    assert outputs.scheduler_stats.spec_decoding.num_accepted_tokens == 4  # the proposer still earned them


def test_max_tokens_inside_accepted_drafts_truncates_and_wins_over_a_later_stop():
    sched = make(num_spec=4)
    sched.add_request(r := req("r", 3, stop_token_ids=[6], max_tokens=3))
    step(sched)
    sched.update_draft_token_ids(DraftTokenIds(["r"], [[4, 5, 6, 9]]))
    _, outputs = step(sched, sampled={"r": [4, 5, 6, 9, 8]})
    (out,) = outputs.outputs
    assert out.new_token_ids == [4, 5] and out.finish_reason == FinishReason.LENGTH and out.stop_reason is None
    assert r.num_output_tokens == 3


def test_stop_in_the_same_step_as_max_tokens_reports_the_stop():
    sched = make(num_spec=4)
    sched.add_request(r := req("r", 3, stop_token_ids=[5], max_tokens=3))
    step(sched)
    sched.update_draft_token_ids(DraftTokenIds(["r"], [[4, 5, 6, 9]]))
    _, outputs = step(sched, sampled={"r": [4, 5, 6, 9, 8]})
    (out,) = outputs.outputs
    assert out.new_token_ids == [4, 5] and out.finish_reason == FinishReason.STOP and out.stop_reason == 5
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_max_model_len_ends_with_length_and_caps_drafts():
    sched = make(max_model_len=8, num_spec=4, block_size=4)
    sched.add_request(r := req("r", 5))
    step(sched)
    sched.update_draft_token_ids(DraftTokenIds(["r"], [[1, 2, 3, 4]]))
    plan, outputs = step(sched)
    assert plan.scheduled_spec_decode_tokens == {"r": [1]}  # 6 tokens + 1 draft + the bonus = 8
    assert r.num_tokens == 8 and outputs.outputs[0].finish_reason == FinishReason.LENGTH
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(req("long", 9))


def test_abort_of_waiting_and_running_requests_frees_blocks():
    sched = make(budget=16, block_size=4)
    for rid in ("run", "wait"):
        sched.add_request(req(rid, 16, start=len(rid) * 100))
    step(sched)
    assert sched.kv_cache.usage > 0 and [r.request_id for r in sched.waiting] == ["wait"]
    done = sched.finish_requests(["wait", "run", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == ["wait", "run"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in done)
    assert sched.kv_cache.usage == 0.0 and not sched.has_unfinished_requests()
    assert sched.kv_cache.get_block_ids("run") == [] and not sched.waiting and not sched.running
    plan = sched.schedule()
    assert plan.finished_req_ids == {"run", "wait"} and plan.is_empty
    assert sched.schedule().finished_req_ids == frozenset()


def test_output_of_a_request_aborted_during_the_step_is_dropped():
    sched = make()
    sched.add_request(req("a", 4))
    sched.add_request(req("b", 4, start=50))
    plan = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outputs = sched.update_from_output(plan, ModelRunnerOutput(["a", "b"], [[1], [2]]))
    assert [o.req_id for o in outputs.outputs] == ["b"]
    # The id may be reused at once; the late output must not leak into the new request.
    sched.add_request(again := req("a", 4, start=90))
    plan2 = sched.schedule()
    sched.update_from_output(plan, ModelRunnerOutput(["a"], [[1]]))
    assert again.output_token_ids == [] and plan2.num_scheduled_tokens["a"] == 4


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = make(budget=100, max_model_len=100, chunked=False, threshold=10)
    sched.add_request(req("run", 10, max_tokens=3))
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"run": 10}  # no threshold without chunking
    sched.add_request(req("big", 100, start=5000))
    seen = []
    while sched.has_unfinished_requests():
        plan, _ = step(sched)
        seen.append(dict(plan.num_scheduled_tokens))
    assert seen[:3] == [{"run": 1}, {"run": 1}, {"big": 100}]


def test_max_num_seqs_caps_running_requests():
    sched = make(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(req(rid, 3, start=ord(rid) * 10))
    plan, _ = step(sched)
    assert list(plan.num_scheduled_tokens) == ["a", "b"] and len(sched.waiting) == 1


def test_prefix_hit_skips_cached_blocks_and_recomputes_the_last_token():
    sched = make(block_size=4)
    prompt = list(range(100, 112))  # three full blocks
    sched.add_request(req("a", prompt))
    step(sched)
    sched.add_request(req("b", prompt))
    sched.add_request(req("c", prompt + [1, 2]))
    plan, outputs = step(sched)
    new = {d.req_id: d.num_computed_tokens for d in plan.scheduled_new_reqs}
    assert new == {"b": 8, "c": 12}
    assert plan.num_scheduled_tokens == {"a": 1, "b": 4, "c": 2}
    stats = outputs.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (12 + 14, 20)
    assert stats.num_prompt_tokens == 4 + 2
    assert sched.requests["b"].num_cached_tokens == 8
    assert {o.req_id: o.num_cached_tokens for o in outputs.outputs} == {"a": 0, "b": 8, "c": 12}


def test_step_stats_snapshot():
    sched = make(budget=10, block_size=4, num_blocks=11, max_model_len=40)
    sched.add_request(req("a", 6))
    sched.add_request(req("b", 8, start=50))
    _, outputs = step(sched)
    stats = outputs.scheduler_stats
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (2, 0)
    assert stats.num_prompt_tokens == 10 and stats.num_generation_tokens == 1
    assert stats.kv_cache_usage == pytest.approx(3 / 10)


def test_invalid_requests_and_configs_are_rejected():
    sched = make(max_model_len=32)
    sched.add_request(req("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("a", 3))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(req("e", []))
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests(["a"], RequestStatus.RUNNING)
    config = EngineConfig(block_size=4, max_model_len=64)
    config.resolve(None)
    with pytest.raises(ValueError, match="cannot hold one max_model_len"):
        FCFSScheduler(config, PagedKVCache(config, 8))
    with pytest.raises(ValueError, match="resolved config"):
        FCFSScheduler(EngineConfig(), PagedKVCache(config, 8))


def test_lookahead_slots_only_for_steps_that_sample():
    sched = make(block_size=4, budget=6, num_spec=3)
    sched.add_request(req("whole", 4))
    sched.add_request(req("chunked", 8, start=50))
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"whole": 4, "chunked": 2}
    assert len(sched.kv_cache.get_block_ids("whole")) == 2  # 4 tokens + 3 draft slots
    assert len(sched.kv_cache.get_block_ids("chunked")) == 1  # a partial chunk proposes nothing
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"whole": 1, "chunked": 5}
    assert len(sched.kv_cache.get_block_ids("chunked")) == 2  # 7 of 8 tokens: no sample yet
    plan, _ = step(sched)
    assert plan.num_scheduled_tokens == {"whole": 1, "chunked": 1}
    assert len(sched.kv_cache.get_block_ids("chunked")) == 3  # 8 tokens + 3 draft slots

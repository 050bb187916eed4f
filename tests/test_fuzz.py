"""Random steps against tiny KV pools, with the scheduler/KV invariants checked after every step.

The scripted runner is the oracle for the tokens: every finished request must have produced exactly
the scripted continuation of its prompt, cut by its stop rules, however often it was preempted,
chunked or sped up by drafts.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from specloop.backends.scripted import ScriptedModelRunner, scripted_next_token
from specloop.kernel import EngineConfig, Request, RequestStatus, SamplingParams
from specloop.plugins.kv_cache import PagedKVCache, make_lru, make_uncached
from specloop.plugins.scheduler import FCFSScheduler, PriorityScheduler

VOCAB = 24
EOS = 0


@dataclass
class Case:
    scheduler: type[FCFSScheduler]
    caching: bool
    num_blocks: int
    block_size: int
    max_model_len: int
    budget: int
    chunked: bool
    threshold: int
    max_num_seqs: int
    num_spec: int
    steps: int


CASES = [
    Case(FCFSScheduler, True, 8, 4, 24, 16, True, 0, 4, 0, 1400),
    Case(FCFSScheduler, True, 16, 2, 28, 12, True, 5, 6, 3, 1400),
    Case(PriorityScheduler, True, 12, 4, 40, 48, False, 0, 5, 2, 1200),
    Case(PriorityScheduler, False, 24, 4, 60, 20, True, 8, 8, 0, 1200),
    Case(FCFSScheduler, False, 10, 4, 32, 40, False, 0, 3, 4, 1200),
    Case(PriorityScheduler, True, 64, 2, 96, 32, True, 0, 16, 3, 1400),
    Case(FCFSScheduler, True, 32, 3, 60, 9, True, 4, 8, 2, 1200),
    Case(PriorityScheduler, True, 9, 2, 16, 16, True, 0, 4, 1, 1200),
]


def reference_output(request: Request, max_model_len: int) -> tuple[list[int], RequestStatus]:
    """What the scripted target generates for this request, stop rules applied."""
    p = request.sampling_params
    history, out = list(request.prompt_token_ids), []
    while True:
        t = scripted_next_token(history, VOCAB)
        history.append(t)
        out.append(t)
        if len(out) >= p.min_tokens and ((not p.ignore_eos and t == EOS) or t in p.stop_token_ids):
            return out, RequestStatus.FINISHED_STOPPED
        if len(out) >= request.max_tokens or len(history) >= max_model_len:
            return out, RequestStatus.FINISHED_LENGTH


class Fuzzer:
    def __init__(self, case: Case, seed: int) -> None:
        self.case = case
        self.rng = random.Random(seed)
        spec = {"method": "ngram", "num_speculative_tokens": case.num_spec} if case.num_spec else None
        self.config = EngineConfig(
            block_size=case.block_size, max_model_len=case.max_model_len, max_num_batched_tokens=case.budget,
            enable_chunked_prefill=case.chunked, long_prefill_token_threshold=case.threshold,
            max_num_seqs=case.max_num_seqs, num_kv_blocks=case.num_blocks, speculative_config=spec,
            plugin_options={"scripted": {"vocab_size": VOCAB, "draft_accuracy": 0.6}}, seed=seed)
        self.config.resolve(None)
        make = make_lru if case.caching else make_uncached
        self.kv: PagedKVCache = make(self.config, case.num_blocks)
        self.sched = case.scheduler(self.config, self.kv)
        self.runner = ScriptedModelRunner(self.config)
        self.prefixes = [[self.rng.randrange(1, VOCAB) for _ in range(case.max_model_len)] for _ in range(3)]
        self.all_requests: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.violations: list[str] = []
        self.preemptions = 0
        self.prefix_hits = 0
        self.drafts_accepted = 0
        self.next_id = 0
        self.num_steps = 0
        self.slots: dict[tuple[int, int], tuple[str | None, tuple[int, ...]]] = {}

    def new_request(self) -> Request:
        rng, case = self.rng, self.case
        length = rng.randint(1, case.max_model_len - 1)
        shared = rng.randint(0, length) if rng.random() < 0.6 else 0
        prompt = self.prefixes[rng.randrange(3)][:shared] + [rng.randrange(1, VOCAB) for _ in range(length - shared)]
        max_tokens = rng.randint(1, 12)
        params = SamplingParams(max_tokens=max_tokens, min_tokens=rng.choice([0, 0, 0, min(3, max_tokens)]),
                                ignore_eos=rng.random() < 0.1,
                                stop_token_ids=[rng.randrange(1, VOCAB)] if rng.random() < 0.3 else [])
        rid = f"r{self.next_id}"
        self.next_id += 1
        return Request(rid, prompt, params, eos_token_ids=(EOS,), priority=rng.randint(0, 3),
                       arrival_time=float(self.next_id), cache_salt=rng.choice([None, None, None, "s"]))

    def step(self) -> None:
        rng, sched = self.rng, self.sched
        self.num_steps += 1
        busy = (self.num_steps // 200) % 2 == 0  # alternate bursts and lulls so queues fill and drain
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2] if busy else [0] * 12 + [1])):
            request = self.new_request()
            self.all_requests[request.request_id] = request
            sched.add_request(request)
        if rng.random() < 0.08:
            live = list(sched.requests)
            ids = rng.sample(live, min(len(live), rng.randint(1, 2))) + ["no-such-request"]
            for r in sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED):
                self.aborted.add(r.request_id)
        plan = sched.schedule()
        self.preemptions += len(plan.preempted_req_ids)
        self.prefix_hits += sum(d.num_computed_tokens for d in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs))
        self.check_plan(plan)
        self.check_state(plan)
        self.runner.execute_model(plan)
        result = self.runner.sample_tokens()
        if rng.random() < 0.03 and sched.running:  # an abort that lands while the step runs
            victim = rng.choice(sched.running).request_id
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            self.aborted.add(victim)
        outputs = sched.update_from_output(plan, result)
        for out in outputs.outputs:
            if out.req_id in self.aborted:
                self.violations.append(f"output for aborted request {out.req_id}")
        self.drafts_accepted += outputs.scheduler_stats.spec_decoding.num_accepted_tokens
        drafts = self.runner.take_draft_token_ids()
        if drafts is not None:
            sched.update_draft_token_ids(drafts)
        self.check_state()

    def check_plan(self, plan) -> None:
        v = self.violations
        if plan.total_num_scheduled_tokens > self.case.budget:
            v.append(f"step {plan.step_id}: {plan.total_num_scheduled_tokens} tokens > budget {self.case.budget}")
        if len(self.sched.running) > self.case.max_num_seqs:
            v.append(f"step {plan.step_id}: {len(self.sched.running)} running > max_num_seqs")
        for rid, n in plan.num_scheduled_tokens.items():
            request = self.sched.requests[rid]
            table = self.kv.req_to_blocks.get(rid, [])
            # Invariant 2: in the plan only with its slots allocated (computed was advanced by n).
            if len(table) * self.case.block_size < request.num_computed_tokens:
                v.append(f"step {plan.step_id}: {rid} scheduled beyond its blocks")
            if n <= 0:
                v.append(f"step {plan.step_id}: {rid} scheduled {n} tokens")
        for data in plan.scheduled_running_reqs:
            if data.num_computed_tokens > self.sched.requests[data.req_id].num_tokens:
                v.append(f"step {plan.step_id}: {data.req_id} starts past its known tokens")
        self.check_and_write_kv(plan)
        for rid, drafts in plan.scheduled_spec_decode_tokens.items():
            request = self.sched.requests[rid]
            start = request.num_computed_tokens - plan.num_scheduled_tokens[rid]
            if start != request.num_tokens - 1:
                v.append(f"step {plan.step_id}: drafts for {rid} inside a prefill chunk")
            if request.num_tokens + len(drafts) >= self.case.max_model_len:
                v.append(f"step {plan.step_id}: drafts for {rid} would pass max_model_len")

    def check_and_write_kv(self, plan) -> None:
        """A toy KV store: each slot holds what a model would write there, the whole prefix up to
        that position (and the cache salt). Every position a request relies on must hold its own
        prefix, which is what makes a prefix hit, eviction or draft rollback wrong or right."""
        bs = self.case.block_size
        data_by_id = {d.req_id: d for d in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs,
                                             *plan.scheduled_running_reqs)}
        for rid in plan.num_scheduled_tokens:  # plan order: a hit may rely on KV written earlier in it
            data = data_by_id[rid]
            request = self.sched.requests[data.req_id]
            table = self.kv.get_block_ids(data.req_id)
            tokens = request.all_token_ids + plan.scheduled_spec_decode_tokens.get(data.req_id, [])
            start, end = data.num_computed_tokens, data.num_computed_tokens + plan.num_scheduled_tokens[data.req_id]
            for pos in range(start):
                if self.slots.get((table[pos // bs], pos % bs)) != (request.cache_salt, tuple(tokens[:pos + 1])):
                    self.violations.append(f"step {plan.step_id}: {data.req_id} relies on wrong KV at {pos}")
                    break
            for pos in range(start, end):
                self.slots[table[pos // bs], pos % bs] = (request.cache_salt, tuple(tokens[:pos + 1]))

    def check_state(self, plan=None) -> None:
        """``plan``: checking between schedule and commit, where drafts are optimistically computed."""
        v, sched, kv, pool = self.violations, self.sched, self.kv, self.kv.pool
        holders: Counter[int] = Counter()
        for rid, table in kv.req_to_blocks.items():
            if rid not in sched.requests or sched.requests[rid].status != RequestStatus.RUNNING:
                v.append(f"blocks held by {rid}, which is not running")
            holders.update(table)
        free_ids = pool.free_queue.block_ids()
        if len(set(free_ids)) != len(free_ids) or 0 in free_ids:
            v.append("free queue has duplicates or the null block")
        used = [b for b in range(1, pool.num_blocks) if pool.ref_cnts[b] > 0]
        if len(free_ids) + len(used) != pool.num_usable_blocks or pool.num_free_blocks != len(free_ids):
            v.append(f"free {len(free_ids)} + used {len(used)} != {pool.num_usable_blocks}")
        for block in range(1, pool.num_blocks):
            ref_cnt, block_hash = pool.ref_cnts[block], pool.block_hash(block)
            if ref_cnt < 0:
                v.append(f"block {block} ref count {ref_cnt}")
            if ref_cnt != holders[block]:
                v.append(f"block {block} ref count {ref_cnt} but held by {holders[block]}")
            if (ref_cnt == 0) != (block in pool.free_queue):
                v.append(f"block {block} free-queue membership disagrees with ref count")
            if block_hash is not None and pool.cached.get(block_hash) != block:
                v.append(f"block {block} hash not in the cache map")
        if not self.case.caching and pool.cached:
            v.append("a non-caching policy cached blocks")
        for rid, table in kv.req_to_blocks.items():
            request = sched.requests.get(rid)
            if request is None:
                continue
            for i, block in enumerate(table):
                shared, block_hash = holders[block] > 1, pool.block_hash(block)
                full = (i + 1) * self.case.block_size <= request.num_tokens
                if shared and (block_hash is None or not full):
                    v.append(f"block {block} shared but not a hashed full block of {rid}")
                # Drafts never hashed: a cached block of the request is exactly its committed content.
                if block_hash is not None and (i >= len(request.block_hashes)
                                               or request.block_hashes[i] != block_hash):
                    v.append(f"block {block} of {rid} cached under a hash of other content")
        running, waiting = sched.running, list(sched.waiting)
        if len({id(r) for r in running + waiting}) != len(running) + len(waiting):
            v.append("a request is in two queues (or twice in one)")
        if {r.request_id for r in running + waiting} != set(sched.requests):
            v.append("queues and the request table disagree")
        for request in running:
            if request.status != RequestStatus.RUNNING:
                v.append(f"{request.request_id} in running with status {request.status.name}")
            drafts = len(plan.scheduled_spec_decode_tokens.get(request.request_id, ())) if plan else 0
            if request.num_computed_tokens > request.num_tokens + drafts:
                v.append(f"{request.request_id} computed {request.num_computed_tokens} > {request.num_tokens}")
        for request in waiting:
            if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED) or request.num_computed_tokens:
                v.append(f"{request.request_id} waiting as {request.status.name} with computed tokens")

    def drain(self) -> None:
        """Stop arrivals and run until everything finished."""
        for _ in range(10_000):
            if not self.sched.has_unfinished_requests():
                break
            plan = self.sched.schedule()
            self.preemptions += len(plan.preempted_req_ids)
            self.check_plan(plan)
            self.runner.execute_model(plan)
            self.sched.update_from_output(plan, self.runner.sample_tokens())
            drafts = self.runner.take_draft_token_ids()
            if drafts is not None:
                self.sched.update_draft_token_ids(drafts)
            self.check_state()
        v, pool = self.violations, self.kv.pool
        if self.sched.requests or self.sched.running or self.sched.waiting or self.kv.req_to_blocks:
            v.append("requests left after draining")
        if pool.num_free_blocks != pool.num_usable_blocks:
            v.append(f"{pool.num_usable_blocks - pool.num_free_blocks} blocks still in use after draining")
        for rid, request in self.all_requests.items():
            expected, status = reference_output(request, self.case.max_model_len)
            if rid in self.aborted:
                if request.status != RequestStatus.FINISHED_ABORTED or expected[:request.num_output_tokens] != \
                        request.output_token_ids:
                    v.append(f"aborted {rid}: output is not a prefix of the scripted continuation")
            elif request.output_token_ids != expected or request.status != status:
                v.append(f"{rid}: got {request.output_token_ids} {request.status.name}, "
                         f"expected {expected} {status.name}")


def test_fuzz_scheduler_and_kv_invariants(capsys):
    total_steps = total_preemptions = total_requests = 0
    violations: list[str] = []
    for seed, case in enumerate(CASES):
        fuzzer = Fuzzer(case, seed)
        for _ in range(case.steps):
            fuzzer.step()
        total_steps += case.steps
        fuzzer.drain()
        total_preemptions += fuzzer.preemptions
        total_requests += len(fuzzer.all_requests)
        violations += [f"case {seed}: {m}" for m in fuzzer.violations]
        assert fuzzer.preemptions > 0 or case.num_blocks >= 32, f"case {seed} never preempted: too gentle"
        assert fuzzer.prefix_hits > 0 or not case.caching, f"case {seed} never hit the prefix cache"
        assert fuzzer.drafts_accepted > 0 or not case.num_spec, f"case {seed} never accepted a draft"
    with capsys.disabled():
        print(f"\nfuzz: {total_steps} steps, {total_requests} requests, {total_preemptions} preemptions, "
              f"{len(violations)} violations")
    assert total_steps >= 10_000
    assert not violations, "\n".join(violations[:20])


@pytest.mark.parametrize("scheduler", [FCFSScheduler, PriorityScheduler])
def test_fuzz_checker_catches_a_leak(scheduler):
    """The invariant checker itself must be able to fail: leak one reference and look."""
    fuzzer = Fuzzer(Case(scheduler, True, 16, 4, 32, 16, True, 0, 4, 0, 0), seed=1)
    for _ in range(50):
        fuzzer.step()
        if fuzzer.kv.req_to_blocks:
            break
    table = next(iter(fuzzer.kv.req_to_blocks.values()))
    fuzzer.kv.pool.ref_cnts[table[0]] += 1
    fuzzer.check_state()
    assert any("ref count" in m for m in fuzzer.violations)

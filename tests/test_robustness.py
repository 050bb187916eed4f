"""Robustness under hostile input and churn: every bad HTTP body is a 4xx in OpenAI's shape, and an
engine under random parameters, cancellations, aborts and preemption serves every surviving request
exactly as it would alone, finishes each request once and leaks no KV block.

Both parts run a tiny Qwen3 with peaked logits (``hf_models``) and a byte-level BPE tokenizer in
one directory, so greedy comparisons across batch compositions do not hinge on float rounding.
Loops are bounded and seeded; the batch compositions still vary with thread timing, which is the
point: the oracles (solo runs, block ledgers) must hold whatever the interleaving.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import math
import os
import random
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator

import hf_models
import httpx
import pytest
import torch
from server_fixtures import ServerThread, make_engine, scrape
from tokenizer_helpers import build_tokenizer

from specloop.sampling.sampler import SamplingMetadata, SamplingRow, probabilities, process_logits, sample
from specloop.cli import build_parser
from specloop.frontend.async_engine import AsyncEngine
from specloop.frontend.detokenizer import IncrementalDetokenizer
from specloop.frontend.llm import LLM
from specloop.frontend.tokenizer import ChatTemplateError, Tokenizer
from specloop.kernel.config import EngineConfig
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.plugins import PluginManager
from specloop.kernel.sampling_params import SamplingParams
from specloop.server.app import build_app
from specloop.server.launcher import limits_from_args


@functools.cache
def model_dir() -> str:
    """A tokenizer and a peaked random Qwen3 over exactly its vocabulary, in one directory."""
    root = tempfile.mkdtemp(prefix="specloop-robust-")
    atexit.register(shutil.rmtree, root, True)
    tok_dir = build_tokenizer(os.path.join(root, "tok"), vocab_size=400)
    with open(os.path.join(tok_dir, "tokenizer.json")) as f:
        vocab = len(json.load(f)["model"]["vocab"])
    model = hf_models.build("qwen3_tied", root, overrides={"vocab_size": vocab})
    for name in os.listdir(tok_dir):
        os.replace(os.path.join(tok_dir, name), os.path.join(model.path, name))
    return model.path


# --- block ledger -------------------------------------------------------------------------------

def ledger_violations(core: Any) -> list[str]:
    """What is wrong with the scheduler's queues and the KV block ledger right now."""
    sched, kv = core.scheduler, core.kv_cache
    pool = kv.pool
    problems = []
    holders: Counter[int] = Counter()
    for rid, table in kv.req_to_blocks.items():
        if rid not in sched.requests:
            problems.append(f"{rid} holds blocks but is not a live request")
        holders.update(table)
    for block in range(1, pool.num_blocks):
        ref_cnt = pool.ref_cnts[block]
        if ref_cnt != holders[block]:
            problems.append(f"block {block}: ref_cnt {ref_cnt}, held by {holders[block]}")
        if (ref_cnt == 0) != (block in pool.free_queue):
            problems.append(f"block {block}: ref_cnt {ref_cnt} but in free queue: {block in pool.free_queue}")
        if holders[block] > 1 and pool.block_hash(block) is None:
            problems.append(f"block {block} is shared but not a cached full block")
    if pool.ref_cnts[pool.null_block] != 0 or holders[0]:
        problems.append("the null block was handed out")
    running, waiting = set(map(id, sched.running)), set(map(id, sched.waiting))
    if running & waiting:
        problems.append("a request is both running and waiting")
    if running | waiting != set(map(id, sched.requests.values())):
        problems.append("live requests and queues disagree")
    for request in sched.running:
        if request.request_id not in kv.req_to_blocks:
            problems.append(f"running {request.request_id} has no block table")
        if request.num_computed_tokens > request.num_tokens_with_spec:
            problems.append(f"{request.request_id} computed past its tokens")
    for request in sched.waiting:
        if request.request_id in kv.req_to_blocks:
            problems.append(f"waiting {request.request_id} still holds blocks")
    return problems


class Watcher:
    """Counts lifecycle events per core request (by object: ids may be reused once free) and
    checks the ledger after every step."""

    def __init__(self) -> None:
        self.core: Any = None
        self.requests: list[Any] = []  # keeps every request alive, so id() stays unique
        self.added: Counter[int] = Counter()
        self.finished: Counter[int] = Counter()
        self.preemptions = 0
        self.draft_tokens = 0
        self.steps = 0
        self.violations: list[str] = []

    @hookimpl
    def specloop_startup(self, engine: Any) -> None:
        self.core = engine

    @hookimpl
    def specloop_request_added(self, requests: list[Any]) -> None:
        self.requests.extend(requests)
        self.added.update(map(id, requests))

    @hookimpl
    def specloop_request_finished(self, requests: list[Any]) -> None:
        self.finished.update(map(id, requests))

    @hookimpl
    def specloop_request_preempted(self, requests: list[Any]) -> None:
        self.preemptions += len(requests)

    @hookimpl
    def specloop_drafts_verified(self, num_draft_tokens: int) -> None:
        self.draft_tokens += num_draft_tokens

    @hookimpl
    def specloop_step_finished(self, plan: Any) -> None:
        self.steps += 1
        if len(self.violations) < 20:
            self.violations.extend(f"step {plan.step_id}: {v}" for v in ledger_violations(self.core))


def assert_idle_and_clean(engine: AsyncEngine) -> None:
    core = engine.core
    assert not core.scheduler.requests and not core.scheduler.running and not core.scheduler.waiting
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks - 1, "KV blocks leaked"
    assert not core.kv_cache.req_to_blocks
    assert not any(core.kv_cache.pool.ref_cnts)
    assert ledger_violations(core) == []
    assert not engine.async_core._queues and not engine._states and not core.requests


async def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.core.has_unfinished_requests() or not engine.async_core._input.empty():
        assert loop.time() < deadline, "the engine did not go idle"
        await asyncio.sleep(0.01)


# --- engine fuzz --------------------------------------------------------------------------------

STOP_WORDS = ["the", "o", "\n", " a", "ing", "😀", "zz"]


@dataclass
class Job:
    rid: str
    prompt: list[int]
    params: SamplingParams
    # "finish", "cancel" (task cancelled), "close" (generator closed), "abort" (engine.abort) or
    # "duplicate" (reuses an earlier job's id: refused while that one is live)
    fate: str
    after: int  # outputs seen (or milliseconds waited, for "cancel") before the fate strikes
    priority: int = 0
    outputs: list[Any] = field(default_factory=list)
    cancelled: bool = False  # its task was cancelled before it ended
    aborted: bool = False  # engine.abort() was called for its id from outside its stream
    refused: bool = False  # a duplicate id refused with ValueError


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    # None: up to max_model_len, where KV allocation and drafts are capped.
    kw: dict[str, Any] = {"max_tokens": rng.choice([rng.randint(1, 20), None]), "n": rng.choice([1, 1, 1, 2, 3])}
    if rng.random() < 0.5:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = rng.choice([0.5, 0.8, 1.3])
        kw["top_k"] = rng.choice([0, 1, 5, 50])
        kw["top_p"] = rng.choice([1.0, 0.9, 0.3])
        kw["min_p"] = rng.choice([0.0, 0.1])
        if rng.random() < 0.7:
            kw["seed"] = rng.randint(-2**63, 2**63 - 1)
    if rng.random() < 0.3:
        kw["stop"] = rng.sample(STOP_WORDS, rng.randint(1, 3))
        kw["include_stop_str_in_output"] = rng.random() < 0.5
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.3:
        kw["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.choice([0.7, 1.3, 2.0])
        kw["frequency_penalty"] = rng.choice([0.0, 1.0, -0.5])
        kw["presence_penalty"] = rng.choice([0.0, 0.8])
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"] or 20)
    if rng.random() < 0.15:
        kw["prompt_logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(vocab): rng.choice([-100.0, 5.0, 100.0])}
    kw["ignore_eos"] = rng.random() < 0.5
    return SamplingParams(**kw)


def make_jobs(rng: random.Random, count: int, vocab: int) -> list[Job]:
    shared = [rng.randrange(5, vocab) for _ in range(24)]  # a common prefix for the prefix cache
    jobs = []
    for i in range(count):
        head = shared[:rng.choice([0, 4, 8, 12, 24])]
        prompt = head + [rng.randrange(5, vocab) for _ in range(rng.randint(1, 16))]
        fate = rng.choices(["finish", "cancel", "close", "abort", "duplicate"], weights=[6, 2, 1, 1, 1])[0]
        after = rng.randint(0, 80) if fate == "cancel" else rng.randint(1, 6)
        rid = jobs[rng.randrange(i)].rid if fate == "duplicate" and i else f"job{i}"
        jobs.append(Job(rid, prompt, random_params(rng, vocab), fate, after, rng.randint(-2, 2)))
    return jobs


def completions(outputs: list[Any]) -> dict[int, tuple[list[int], str, str | None]]:
    """Per completion index: the concatenated delta token ids and text, and the finish reason."""
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    for out in outputs:
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert reasons.get(c.index) is None, f"completion {c.index} finished twice"
                reasons[c.index] = c.finish_reason
    return {i: (tokens[i], texts.get(i, ""), reasons.get(i)) for i in tokens}


async def run_job(engine: AsyncEngine, job: Job) -> None:
    stream = engine.generate(job.prompt, job.params, job.rid, delta=True, priority=job.priority)
    try:
        async for out in stream:
            job.outputs.append(out)
            if len(job.outputs) == job.after:
                if job.fate == "close":
                    break
                if job.fate == "abort":
                    await engine.abort(job.rid)
    except ValueError as e:
        if not (job.fate == "duplicate" and "already in use" in str(e) and not job.outputs):
            raise
        job.refused = True
    finally:
        await stream.aclose()


async def cancel_later(task: asyncio.Task[None], job: Job) -> None:
    await asyncio.sleep(job.after / 1000)
    if not task.done():
        task.cancel()
        job.cancelled = True


def fuzz_engine(**overrides: Any) -> tuple[AsyncEngine, Watcher]:
    """An engine whose KV cache holds about one and a half max-length sequences, so concurrent
    requests preempt each other all the time."""
    watcher = Watcher()
    kwargs: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=24,
                                  max_num_batched_tokens=48, seed=7)
    config = EngineConfig(model=model_dir(), **{**kwargs, **overrides})
    return AsyncEngine(config, PluginManager([watcher], load_entrypoints=False)), watcher


FUZZ_SEED = 1234
FUZZ_CASES = {
    "fcfs": {},
    # Drafts ride on decodes and are rolled back on rejection and preemption; sampled tokens then
    # depend on which drafts a step verified, so only greedy requests must match their solo runs.
    "priority+ngram": {"scheduler": "priority",
                       "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "small-chunks+no-prefix-cache": {"max_num_batched_tokens": 16, "max_num_seqs": 6, "enable_prefix_caching": False},
}


@pytest.mark.parametrize("case", list(FUZZ_CASES))
async def test_engine_fuzz_with_cancellations_aborts_and_preemption(case: str) -> None:
    rng = random.Random(FUZZ_SEED)
    engine, watcher = fuzz_engine(**FUZZ_CASES[case])
    spec = engine.config.num_lookahead_tokens > 0
    try:
        jobs = make_jobs(rng, 80, engine.vocab_size)
        tasks = []
        for i, job in enumerate(jobs):
            task = asyncio.create_task(run_job(engine, job))
            tasks.append(task)
            if job.fate == "cancel":
                tasks.append(asyncio.create_task(cancel_later(task, job)))
            if rng.random() < 0.05:
                await engine.abort("nobody")
            elif rng.random() < 0.05:  # any request started so far, finished or not
                rid = jobs[rng.randrange(i + 1)].rid
                for other in jobs[:i + 1]:
                    other.aborted |= other.rid == rid
                await engine.abort(rid)
            await asyncio.sleep(rng.choice([0, 0, 0.001, 0.005]))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
        assert errors == []
        await wait_idle(engine)

        assert watcher.violations == []
        assert watcher.preemptions > 0, "the fuzz should have forced preemption"
        assert (watcher.draft_tokens > 0) == spec
        assert watcher.added and set(watcher.added) == set(watcher.finished)
        assert max(watcher.added.values()) == 1 and max(watcher.finished.values()) == 1
        assert_idle_and_clean(engine)

        assert any(job.refused for job in jobs)
        survivors = []
        for job in jobs:
            if job.cancelled or job.refused:
                continue
            finished = [o for o in job.outputs if o.finished]
            if job.fate == "close" and len(job.outputs) == job.after and not job.outputs[-1].finished:
                assert finished == []
                continue
            assert len(finished) == 1 and job.outputs[-1].finished, job.rid
            got = completions(job.outputs)
            assert sorted(got) == list(range(job.params.n)), job.rid
            reasons = {reason for _, _, reason in got.values()}
            if job.fate == "abort" or job.aborted:
                assert reasons <= {"abort", "stop", "length"}
            else:
                assert reasons <= {"stop", "length"}, (job.rid, reasons)
                if job.params.prompt_logprobs is not None:
                    entries = [e for out in job.outputs for e in out.prompt_logprobs or ()]
                    assert len(entries) == len(job.prompt) and entries[0] is None, job.rid
                if job.params.greedy or not spec:
                    survivors.append((job, got))
        assert len(survivors) >= 10
        print(f"{case}: {watcher.steps} steps, {watcher.preemptions} preemptions, {watcher.draft_tokens} drafts "
              f"verified, {len(survivors)} requests compared with solo runs")

        # Every surviving request again, alone: same tokens, text and finish reasons.
        for job, got in survivors:
            alone = [out async for out in engine.generate(job.prompt, job.params, job.rid, delta=True,
                                                          priority=job.priority)]
            assert completions(alone) == got, job.rid
        await wait_idle(engine)
        assert_idle_and_clean(engine)
    finally:
        await engine.shutdown()


# --- regressions the fuzzers found ---------------------------------------------------------------

def test_seeds_at_the_ends_of_int64_with_speculative_decoding() -> None:
    """A seed of 2**64 - 1 once overflowed the proposer's int64 seed array and killed the engine;
    then it was taken as its low 64 bits (silently negative). Seeds are int64s: the extremes work
    with n > 1 (whose children's seeds run past them) and drafting on, and anything beyond is refused."""
    llm = LLM(model_dir(), device="cpu", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=40,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = {"prompt_token_ids": [9, 10, 11, 9, 10, 11, 9, 10]}
    for seed in (2**63 - 1, -2**63):
        out = llm.generate(prompt, SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, n=2, seed=seed),
                           use_tqdm=False)[0]
        assert [len(c.token_ids) for c in out.outputs] == [12, 12]
    assert llm.core.kv_cache.num_free_blocks == llm.core.kv_cache.num_blocks - 1
    for seed in (2**63, 2**64 - 1, -2**63 - 1, 2**70, True):
        with pytest.raises(ValueError, match=r"^seed must be an integer in \[-2\*\*63, 2\*\*63 - 1\]"):
            SamplingParams(seed=seed)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e39, min_tokens=4),  # 1e39 is inf in float32
    SamplingParams(temperature=1e-5, repetition_penalty=1e-40),  # 0 in float32: seen logits overflow
    SamplingParams(temperature=1.0, repetition_penalty=1e-38, min_tokens=4, top_p=0.5, min_p=0.1),
], ids=["temperature", "tiny-penalty-cold", "tiny-penalty"])
def test_extreme_sampling_parameters_give_a_distribution(params: SamplingParams) -> None:
    """Valid but extreme parameters once made the distribution NaN, which samples token 0."""
    vocab = 64
    logits = torch.linspace(-4.0, 4.0, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(0))]
    prompt, banned = [1, 2, 3], [5, 6]
    row = SamplingRow(params, seed=3, position=4, prompt_token_ids=prompt, output_token_ids=[], stop_token_ids=banned)
    meta = SamplingMetadata.build([row], vocab, torch.device("cpu"))
    probs = probabilities(process_logits(logits[None], meta), meta)[0]
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5
    assert float(probs[banned].sum()) == 0.0
    if params.repetition_penalty < 1:
        # The prompt's only token with a positive logit is boosted past every other token.
        (boosted,) = [t for t in prompt if logits[t] > 0]
        assert float(probs[boosted]) == 1.0
    else:
        allowed = probs[[t for t in range(vocab) if t not in banned]]
        assert float(allowed.max() - allowed.min()) < 1e-6  # infinitely hot: uniform over what is allowed
    assert int(sample(logits[None], meta)) not in banned


def test_more_logprobs_than_the_vocabulary(tmp_path: Any) -> None:
    """Asking for 20 alternatives from a 12-token vocabulary once failed inside the step (topk out of
    range); now every position reports the whole vocabulary."""
    model = hf_models.build("qwen3_tied", str(tmp_path), overrides={"vocab_size": 12})
    llm = LLM(model.path, device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=4, num_kv_blocks=32,
              max_model_len=32)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=20, prompt_logprobs=20)
    (out,) = llm.generate({"prompt_token_ids": [1, 5, 7]}, params, use_tqdm=False)
    positions = out.outputs[0].logprobs + out.prompt_logprobs[1:]
    assert len(positions) == 3 + 2 and out.prompt_logprobs[0] is None
    for entries in positions:
        assert sorted(entries) == list(range(12))
        assert abs(sum(math.exp(lp.logprob) for lp in entries.values()) - 1) < 1e-4


def test_a_failing_chat_template_is_a_value_error() -> None:
    """A template can raise any Python error (1/0, "a" + 1); it reached the client as a 500."""
    tokenizer = Tokenizer(model_dir())
    for template in ("{{ 1/0 }}", "{{ messages[0]['content'] + 1 }}", "{{ messages[5] + 1 }}"):
        with pytest.raises(ChatTemplateError, match="chat template failed to render"):
            tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template)


NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@pytest.mark.parametrize("name,value", [(n, v) for n in NUMBERS for v in (None, "0.5", [0.5], True, 1 + 2j)]
                         + [(n, v) for n in ("stop", "stop_token_ids") for v in (7, 1.5, True)], ids=repr)
def test_wrong_types_are_value_errors_naming_the_field(name: str, value: Any) -> None:
    """A wrong type once escaped as a TypeError from a comparison ("'>=' not supported ...")."""
    with pytest.raises(ValueError, match=f"^{name} "):
        SamplingParams(**{name: value})


async def test_a_bad_request_id_or_priority_fails_only_its_own_call() -> None:
    """A non-string id (hashed by the runner) or a non-integer priority (compared by the priority
    queue) once failed inside the step and killed the engine with every request in it."""
    engine = make_engine(model_dir(), num_kv_blocks=24, scheduler="priority")
    try:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        other = asyncio.create_task(anext(engine.generate([5, 6, 7], params, "other", delta=False)))
        await other  # running
        for request_id, priority in ((5, 0), (None, 0), (("a",), 0), ("p", "high"), ("p", None), ("p", 1.5)):
            with pytest.raises(ValueError, match="request_id must be a string|priority must be an integer"):
                await anext(engine.generate([8, 9], params, request_id, priority=priority))
        final = [out async for out in engine.generate([5, 6, 7], params, "again")][-1]
        assert engine.is_running and final.outputs[0].finish_reason == "length"
        assert len(final.outputs[0].token_ids) == 12
    finally:
        await engine.shutdown()


def test_duplicate_stops_are_checked_once() -> None:
    params = SamplingParams(stop=["a", "b"] * 50_000, stop_token_ids=[7, 3] * 50_000)
    assert params.stop == ["a", "b"] and params.stop_token_ids == [7, 3]


def test_held_back_text_matches_its_definition() -> None:
    """Released text stops right before the longest tail that could still grow into a stop string
    (checked against the definition after every token)."""
    tokenizer = Tokenizer(model_dir())
    ids = tokenizer.encode("the other theme: ab aab abab, then 😀 and the end", add_special_tokens=False)
    stops = ["theta", "them!", "aaab", "abac", "😀😀", "nd?", "e"]
    rng = random.Random(5)
    for _ in range(30):
        chosen = rng.sample(stops, rng.randint(1, 3))
        detok = IncrementalDetokenizer(tokenizer, [0], SamplingParams(stop=chosen, max_tokens=100))
        for token in ids:
            if detok.update([token]) is not None:
                break
            text = detok.output_text
            held = max((k for s in chosen for k in range(1, min(len(s) - 1, len(text)) + 1)
                        if text.endswith(s[:k])), default=0)
            assert detok.text == text[:len(text) - held], (chosen, text)


# --- HTTP fuzz ----------------------------------------------------------------------------------

MODEL = "tiny"
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
HTTP_SEED = 1
NUM_FUZZ_BODIES = 400

# Greedy requests whose answers must not change whatever else the server is going through.
VALID: list[tuple[str, dict[str, Any]]] = [
    (C, {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
    (C, {"prompt": [40, 41, 42, 43, 44], "max_tokens": 8, "temperature": 0, "n": 2, "ignore_eos": True}),
    (C, {"prompt": ["Hello world", "你好"], "max_tokens": 6, "temperature": 0, "logprobs": 2, "stream": True}),
    (C, {"prompt": "Numbers 0123", "max_tokens": 16, "temperature": 0, "stop": ["e", "\n"], "echo": True}),
    (C, {"prompt": "A paged KV cache", "max_tokens": 10, "temperature": 0, "repetition_penalty": 1.5,
         "min_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0}),
    (CHAT, {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "😀 ok"}],
            "max_completion_tokens": 9, "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 3}),
]

WEIRD: list[Any] = [None, True, False, 0, -1, 1, 2, 17, 255, 256, 2**31, 2**63 - 1, -2**63, 2**64 - 1, 1e308,
                    -1e308, 1.5, -0.0, 1e-300, 1e39, "", "x", "1", "ünï😀\u202e", "\x00", "a" * 3000, [], [1],
                    ["a"], [[1]], [None], [1.5], {}, {"a": {"b": [{"c": None}]}}, {"1": 2}]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "best_of", "temperature",
          "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop",
          "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "logprobs", "top_logprobs", "echo", "stream",
          "stream_options", "include_stop_str_in_output", "skip_special_tokens", "user", "priority", "suffix",
          "add_generation_prompt", "chat_template_kwargs", "no_such_field"]
# JSON that Python's json module would never write, spliced in as raw text.
LITERALS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "123456789012345678901234567890", "-0", "0x10",
            "01", ".5", "tru", "[1,]", "{\"a\":}", "\"\\ud800\""]


def weird_value(rng: random.Random, name: str, vocab: int) -> Any:
    """A value for field ``name``: often one shaped for that field, otherwise anything."""
    if rng.random() < 0.5:
        if name == "logit_bias":
            keys = ["-1", "0", str(vocab - 1), str(vocab), "1e3", " 5", "٣", "007", "99999999999999999999", "x", ""]
            return {rng.choice(keys): rng.choice([-100, 100, 101, 0.5, "x", None, 1e308]) for _ in range(rng.randint(0, 4))}
        if name == "stop":
            return [rng.choice(["a", "\n", "😀", "the", " ", "x" * 40]) for _ in range(rng.choice([1, 4, 300, 3000]))]
        if name == "prompt":
            return rng.choice([[rng.randint(-3, vocab + 3) for _ in range(rng.randint(0, 12))], [[7] * 3] * 3,
                               "Hello 😀 世界", ["a", "b"], [5] * 255, [5] * 254, [[1], []], "\ud83d"])
        if name == "messages":
            return [{"role": rng.choice(["user", "system", "assistant", "tool", "developer", None, 5]),
                     "content": rng.choice(["hi", "", None, 5, [{"type": "text", "text": "yo"}], [{"type": "x"}],
                                            "😀" * 50])} for _ in range(rng.randint(0, 3))]
        if name == "chat_template_kwargs":
            return rng.choice([{"chat_template": "{{ 1/0 }}"}, {"chat_template": "{{ messages[9] + 1 }}"},
                               {"chat_template": 5}, {"tools": 5}, {"documents": "x"}, {"continue_final_message": 1},
                               {"add_generation_prompt": "x"}, {"messages": 1}, {"bos_token": [1]}, {"x": "y"}])
        if name == "stream_options":
            return rng.choice([{"include_usage": True}, {"include_usage": 1}, {}, {"x": 1}])
        if name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            return rng.choice([0, 0.5, 2, 1e-45, 1e-38, 3.5e38, 1e39, 1e300, -1e-9])
        if name in ("n", "best_of", "max_tokens", "min_tokens", "top_k", "logprobs", "top_logprobs", "seed"):
            return rng.choice([0, 1, 2, 16, 17, 20, 21, 255, 2**63 - 1, 2**64 - 1, -2**63])
    return rng.choice(WEIRD)


def extreme_value(rng: random.Random, name: str, vocab: int) -> Any:
    """A value at the edge of what field ``name`` accepts (None when the field has no such edge)."""
    choices: dict[str, list[Any]] = {
        "temperature": [0, 1e-6, 1e-5, 2, 100, 1e38, 1e300], "top_p": [1e-300, 1e-9, 1],
        "top_k": [-1, 1, vocab, 2**63 - 1], "min_p": [0.999, 1], "seed": [0, -2**63, 2**63 - 1],
        "presence_penalty": [-2, 2], "frequency_penalty": [-2, 2], "repetition_penalty": [1e-300, 1e-38, 2],
        "n": [2, 16], "stop": [["\n"], ["😀", " "], ["e", "a" * 1000] + [f"s{i}" for i in range(62)]],
        "stop_token_ids": [[0, 1, 2, 3, 4], list(range(vocab - 64, vocab))], "ignore_eos": [True],
        "min_tokens": [1, 8], "logit_bias": [{"0": 100}, {str(vocab - 1): -100}, {str(t): 100 for t in range(50)}],
        "logprobs": [0, 20], "echo": [True], "stream": [True], "include_stop_str_in_output": [True],
        "skip_special_tokens": [False], "spaces_between_special_tokens": [False], "priority": [-2**63, 2**63 - 1],
        "user": ["😀" * 1000], "prompt": [[0], [vocab - 1] * 200, "😀", ["a"] * 8, [[1, 2]] * 3],
        "messages": [[{"role": "assistant", "content": None}], [{"role": "user", "content": ""}]],
        "chat_template_kwargs": [{"enable_thinking": True}, {"bos_token": ""}],
    }
    return rng.choice(choices[name]) if name in choices else None


def fuzz_body(rng: random.Random, vocab: int) -> tuple[str, bytes]:
    """A mutated valid body. Half the time every mutation stays within the accepted ranges (the
    engine must serve it), otherwise anything goes (the server must refuse it cleanly)."""
    path = rng.choice([C, CHAT])
    body: dict[str, Any] = dict(rng.choice([b for p, b in VALID if p == path]))
    body["max_tokens"] = rng.randint(1, 8)
    body.pop("max_completion_tokens", None)
    edgy = rng.random() < 0.5
    for _ in range(rng.randint(1, 4)):
        name = rng.choice(FIELDS)
        if edgy:
            value = extreme_value(rng, name, vocab)
            if value is not None and (name, path) not in (("echo", CHAT), ("logprobs", CHAT), ("prompt", CHAT),
                                                          ("messages", C), ("chat_template_kwargs", C)):
                body[name] = value
        elif rng.random() < 0.15:
            body.pop(name, None)
        else:
            body[name] = weird_value(rng, name, vocab)
    text = json.dumps(body)
    if not edgy and rng.random() < 0.1:
        name = rng.choice(list(body))
        text = text.replace(f"{json.dumps(name)}: {json.dumps(body[name])}", f"{json.dumps(name)}: {rng.choice(LITERALS)}", 1)
    if not edgy and rng.random() < 0.05:
        text = text[:rng.randrange(len(text) + 1)]
    return path, text.encode()


def assert_openai_error(r: httpx.Response) -> None:
    assert r.headers["content-type"].startswith("application/json"), r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"


def sse_events(raw: str) -> list[str]:
    return [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]


def logprob_pairs(path: str, logprobs: dict[str, Any]) -> list[tuple[str, float | None]]:
    if path == CHAT:
        return [(item["token"], item["logprob"]) for item in logprobs["content"]]
    return list(zip(logprobs["tokens"], logprobs["token_logprobs"]))


def answer(path: str, r: httpx.Response) -> dict[str, Any]:
    """What a valid request returned, without ids and timestamps: per choice its text, finish
    reason and (token, logprob) pairs (streamed chunks joined), and the usage."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    pairs: dict[int, list[tuple[str, float | None]]] = {}
    if r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks
        for chunk in chunks:
            for c in chunk["choices"]:
                piece = (c["delta"].get("content") or "") if path == CHAT else c["text"]
                texts[c["index"]] = texts.get(c["index"], "") + piece
                if c.get("finish_reason"):
                    reasons[c["index"]] = c["finish_reason"]
                if c.get("logprobs"):
                    pairs.setdefault(c["index"], []).extend(logprob_pairs(path, c["logprobs"]))
        usage = [c["usage"] for c in chunks if c.get("usage")]
    else:
        data = r.json()
        for c in data["choices"]:
            texts[c["index"]] = c["message"]["content"] if path == CHAT else c["text"]
            reasons[c["index"]] = c["finish_reason"]
            if c.get("logprobs"):
                pairs[c["index"]] = logprob_pairs(path, c["logprobs"])
        usage = [data["usage"]]
    return {"texts": texts, "reasons": reasons, "usage": usage, "pairs": pairs}


def assert_same_answer(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Equal text, reasons, usage and logprob tokens; logprob values equal up to float noise from
    different batch compositions."""
    assert {k: v for k, v in got.items() if k != "pairs"} == {k: v for k, v in want.items() if k != "pairs"}
    assert got["pairs"].keys() == want["pairs"].keys()
    for index, pairs in got["pairs"].items():
        assert [t for t, _ in pairs] == [t for t, _ in want["pairs"][index]]
        for (_, a), (_, b) in zip(pairs, want["pairs"][index]):
            assert (a is None and b is None) or abs(a - b) < 1e-3


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    # Drafting on: the fuzz's sampling parameters then also reach the proposer and the rejection sampler.
    engine = make_engine(model_dir(), num_kv_blocks=24,
                         speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with ServerThread(build_app(engine, served_model_name=MODEL)) as srv:
        yield srv


async def test_http_fuzz_is_4xx_or_2xx_and_harms_no_one(server: ServerThread) -> None:
    engine = server.app.state.specloop.engine
    rng = random.Random(HTTP_SEED)
    statuses: Counter[int] = Counter()
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        expected = []
        for path, body in VALID:  # one at a time: the answers with nothing else going on
            r = await client.post(path, json=body)
            assert r.status_code == 200, r.text
            expected.append(answer(path, r))

        gate = asyncio.Semaphore(8)

        async def fuzz(path: str, content: bytes, hang_up: int | None, patience: float | None) -> None:
            async with gate:
                if patience is not None:  # a client that gives up at any point, even while sending
                    try:
                        r = await asyncio.wait_for(client.post(path, content=content), patience)
                    except asyncio.TimeoutError:
                        return
                    statuses[r.status_code] += 1
                    assert r.status_code < 500, (content[:300], r.text[:300])
                    return
                async with client.stream("POST", path, content=content,
                                         headers={"content-type": "application/json"}) as r:
                    statuses[r.status_code] += 1
                    assert r.status_code < 500, (content[:300], (await r.aread())[:300])
                    if r.status_code >= 400:
                        await r.aread()
                        assert_openai_error(r)
                    elif hang_up is not None:
                        # Leaves after reading hang_up chunks: a stream is aborted, a collected answer dropped.
                        left = hang_up
                        async for _ in r.aiter_raw():
                            left -= 1
                            if left <= 0:
                                break
                    else:
                        raw = (await r.aread()).decode()
                        if r.headers["content-type"].startswith("text/event-stream"):
                            events = sse_events(raw)
                            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
                            assert all("error" not in json.loads(e) for e in events[:-1]), raw[:500]
                        else:
                            assert "choices" in json.loads(raw)

        async def valid(i: int) -> None:
            path, body = VALID[i]
            async with gate:
                r = await client.post(path, json=body)
            assert r.status_code == 200, r.text
            assert_same_answer(answer(path, r), expected[i])

        work = []
        for k in range(NUM_FUZZ_BODIES):
            path, content = fuzz_body(rng, engine.vocab_size)
            work.append(fuzz(path, content, hang_up=rng.choice([1, 3]) if rng.random() < 0.15 else None,
                             patience=rng.choice([0.001, 0.01, 0.05]) if rng.random() < 0.1 else None))
            if k % 10 == 0:
                work.append(valid(rng.randrange(len(VALID))))
        await asyncio.gather(*work)

        print(statuses)
        assert statuses[200] >= 100 and sum(n for s, n in statuses.items() if 400 <= s < 500) >= 100, statuses
        # Nothing left behind: no request, no block, and /metrics agrees.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while engine.core.has_unfinished_requests() or not engine.async_core._input.empty():
            assert loop.time() < deadline, "the engine did not go idle"
            await asyncio.sleep(0.02)
        assert_idle_and_clean(engine)
        assert not server.app.state.specloop.inflight
        metrics = scrape(server.url)
        assert metrics["specloop:num_requests_running"] == 0 and metrics["specloop:num_requests_waiting"] == 0
        assert metrics["specloop:kv_cache_usage_perc"] == 0
        assert (await client.get("/health")).status_code == 200
        for i, (path, body) in enumerate(VALID):
            r = await client.post(path, json=body)
            assert_same_answer(answer(path, r), expected[i])


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"chat_template_kwargs": {"chat_template": "{{ 1/0 }}"}}, "chat_template_kwargs"),
    (CHAT, {"chat_template_kwargs": {"add_generation_prompt": False, "tools": []}}, "chat_template_kwargs"),
    (C, {"stop": [f"s{i}" for i in range(65)]}, "stop"),
    (CHAT, {"stop": [f"s{i}" for i in range(65)]}, "stop"),
], ids=["template", "template-args", "stops", "chat-stops"])
def test_requests_that_were_500s_or_stalls(server: ServerThread, path: str, body: dict[str, Any],
                                                     param: str) -> None:
    """The server's chat template once ran with a client's ``chat_template`` (a 500 when it raised);
    every stop string costs a search per token on the shared event loop, so their number is capped."""
    base = {"prompt": "Hello", "max_tokens": 2} if path == C else {"messages": USER, "max_tokens": 2}
    r = httpx.post(server.url + path, json={**base, **body})
    assert r.status_code == 400
    assert_openai_error(r)
    assert r.json()["error"]["param"] == param
    # What stays allowed: the same stop string many times, and template variables of the template's own.
    ok = {**base, "stop": ["Hello"] * 1000, **({"chat_template_kwargs": {"enable_thinking": False}} if path == CHAT else {})}
    assert httpx.post(server.url + path, json=ok).status_code == 200


def test_max_stop_strings_flag() -> None:
    parser = build_parser()
    assert limits_from_args(parser.parse_args(["serve", "--max-stop-strings", "3"])).max_stop_strings == 3
    assert limits_from_args(parser.parse_args(["serve"])).max_stop_strings == 64

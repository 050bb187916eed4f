"""Data parallelism: replicas behind one endpoint, routed by prefix affinity, then queue depth."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx
import pytest
from server_fixtures import ServerThread, engine_config, scrape, tiny_model_dir

from specloop.cli import build_parser, engine_kwargs
from specloop.frontend.async_engine import AsyncEngine
from specloop.frontend.data_parallel import DataParallelEngine, Router, block_hashes, build_async_engine
from specloop.frontend.llm import LLM
from specloop.kernel.sampling_params import SamplingParams
from specloop.server.app import build_app

C = "/v1/completions"


def test_block_hashes_name_whole_prefixes() -> None:
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2 and block_hashes(list(range(8)), 4) == a
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != a[1]  # same block, other prefix


def test_router_prefers_the_replica_holding_the_prefix_until_it_is_too_busy() -> None:
    router = Router(3, block_size=4, capacity_blocks=100, max_imbalance=2)
    shared = block_hashes(list(range(16)), 4)
    assert router.choose(shared) == 0  # nothing cached anywhere: the least busy, lowest index
    router.started(0, shared)
    router.finished(0)
    longer = block_hashes(list(range(16)) + [99] * 4, 4)
    assert router.choose(longer) == 0  # affinity beats the idle replicas that never served it
    for _ in range(3):
        router.started(0, [])
    assert router.choose(longer) == 1  # 3 more in flight than the idle ones: balance instead
    assert router.choose(longer, alive=[True, False, True]) == 2


def test_router_balances_by_queue_depth_and_forgets_old_prefixes() -> None:
    router = Router(2, block_size=2, capacity_blocks=2)
    picks = []
    for i in range(4):
        replica = router.choose([])
        router.started(replica, [])
        picks.append(replica)
    assert sorted(picks) == [0, 0, 1, 1] and router.in_flight == [2, 2]
    router.finished(1)
    assert router.choose([]) == 1
    router.started(0, block_hashes([1, 2, 3, 4, 5, 6], 2))  # three blocks, room for two
    assert router.prefix_blocks(0, block_hashes([1, 2], 2)) == 0
    with pytest.raises(Exception, match="no data-parallel replica"):
        router.choose([], alive=[False, False])


@pytest.fixture(scope="module")
def dp_server() -> Any:
    engine = DataParallelEngine.from_engine_args(tiny_model_dir(), **_engine_args(), data_parallel_size=2)
    with ServerThread(build_app(engine, served_model_name="tiny")) as srv:
        yield srv, engine


def _engine_args() -> dict[str, Any]:
    config = engine_config(tiny_model_dir())
    return {k: getattr(config, k) for k in ("max_model_len", "num_kv_blocks", "block_size", "device", "dtype")}


def _complete(url: str, prompt: list[int], max_tokens: int = 6) -> dict[str, Any]:
    r = httpx.post(url + C, json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                  "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_two_replicas_behind_one_endpoint(dp_server: Any) -> None:
    srv, engine = dp_server
    prompts = [[5 + i, 17, 40 + 3 * i, 8, 99] for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = [c["text"] for c in pool.map(lambda p: _complete(srv.url, p), prompts)]
    assert min(engine.router.routed) >= 2  # both replicas served
    assert engine.router.in_flight == [0, 0]
    single = LLM(tiny_model_dir(), **_engine_args())
    expected = [o.outputs[0].text for o in single.generate(
        prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)]
    assert texts == expected
    metrics = scrape(srv.url)
    assert metrics["specloop:prompt_tokens_total"] >= 8 * 5
    assert httpx.get(srv.url + "/health").status_code == 200
    # Tool calls are read by this process's parser (the replicas' cores are not the server's).
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "auto",
        "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_a_shared_prefix_goes_back_to_its_replica(dp_server: Any) -> None:
    srv, engine = dp_server
    prefix = [200 + (i * 37) % 150 for i in range(48)]  # three 16-token blocks
    before = list(engine.router.routed)
    _complete(srv.url, prefix + [1, 2])
    first = next(r for r in range(2) if engine.router.routed[r] > before[r])
    _complete(srv.url, [7, 7, 7] * 12)  # elsewhere, by queue depth
    hits = engine.replicas[first].get_metrics()["prefix_cache_hits"]
    for tail in ([3, 4], [5, 6, 7]):
        _complete(srv.url, prefix + tail)
    assert engine.router.routed[first] - before[first] == 3
    assert engine.replicas[first].get_metrics()["prefix_cache_hits"] - hits >= 2 * 48


def test_serve_flag_builds_replicas_and_rejects_replicas_of_several_ranks() -> None:
    args = build_parser().parse_args(["serve", tiny_model_dir(), "--data-parallel-size", "2",
                                      "--tensor-parallel-size", "2", "--device", "cpu"])
    assert args.data_parallel_size == 2 and args.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="one process per replica"):
        build_async_engine(args.model_path, **engine_kwargs(args))
    assert isinstance(build_async_engine(tiny_model_dir(), **_engine_args()), AsyncEngine)
    with pytest.raises(ValueError, match="several engines behind a router"):
        AsyncEngine(engine_config(tiny_model_dir(), data_parallel_size=2))

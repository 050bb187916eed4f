"""The server under load: many concurrent streams, clients that go away, and ``specloop serve``
stopped by a signal."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest
from server_fixtures import ServerThread, free_port, make_engine, scrape, serve_argv, tiny_model_dir, wait_until

from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.plugins import PluginManager
from specloop.server.app import build_app

MODEL = "tiny"
C = "/v1/completions"


class Pace:
    """Makes every step take at least ``seconds`` (a slower model), so that long requests are still
    running when the test looks at them."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    @hookimpl
    def specloop_step_finished(self, timings: dict[str, float]) -> None:
        time.sleep(max(0.0, self.seconds - timings["total"]))


@pytest.fixture(scope="module")
def server() -> Any:
    engine = make_engine(tiny_model_dir(), plugins=PluginManager([Pace(0.01)]))
    with ServerThread(build_app(engine, served_model_name=MODEL)) as srv:
        yield srv


async def read_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] async for line in response.aiter_lines() if line.startswith("data: ")]


def idle(url: str) -> bool:
    m = scrape(url)
    return (m["specloop:num_requests_running"] == 0 and m["specloop:num_requests_waiting"] == 0
            and m["specloop:kv_cache_usage_perc"] == 0)


async def test_64_concurrent_streams_have_exact_counts(server: ServerThread) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> None:
        max_tokens = 4 + i % 13
        body = {"model": MODEL, "prompt": [7 + i % 50, 11, 13 + i % 7], "max_tokens": max_tokens, "stream": True,
                "logprobs": 0, "ignore_eos": True, "temperature": 0.8, "seed": i,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", C, json=body) as r:
            assert r.status_code == 200
            events = await read_events(r)
        assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"])
        usage = chunks[-1]["usage"]
        assert tokens == usage["completion_tokens"] == max_tokens
        assert usage["prompt_tokens"] == 3
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and
                c["choices"][0]["finish_reason"]] == ["length"]

    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as client:
        await asyncio.gather(*(one(client, i) for i in range(64)))
    assert wait_until(lambda: idle(server.url), timeout=2)


async def test_dropped_streams_are_aborted_and_free_their_blocks(server: ServerThread) -> None:
    n = 16
    aborts_before = scrape(server.url).get("specloop:request_success_total{finished_reason=abort}", 0)
    holding = asyncio.Event()
    got_chunks = 0

    async def drop_after_a_few(client: httpx.AsyncClient, i: int) -> None:
        nonlocal got_chunks
        body = {"prompt": [5 + i, 9, 14], "stream": True, "ignore_eos": True, "temperature": 0.0}
        async with client.stream("POST", C, json=body) as r:
            # Read three events, then stop reading but keep the connection open (breaking out of
            # aiter_lines would close it at once).
            lines = r.aiter_lines()
            events: list[str] = []
            while len(events) < 3:
                line = await anext(lines)
                if line.startswith("data: "):
                    events.append(line)
            assert "data: [DONE]" not in events
            got_chunks += 1
            await holding.wait()
        # Leaving the block closes the connection mid-stream.

    async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                 limits=httpx.Limits(max_connections=100)) as client:
        tasks = [asyncio.create_task(drop_after_a_few(client, i)) for i in range(n)]
        assert await asyncio.to_thread(wait_until, lambda: got_chunks == n, 30)
        busy = scrape(server.url)
        assert busy["specloop:num_requests_running"] + busy["specloop:num_requests_waiting"] == n
        assert busy["specloop:kv_cache_usage_perc"] > 0
        # The engine yields between steps: health answers while the batch generates.
        t0 = time.perf_counter()
        assert httpx.get(server.url + "/health").status_code == 200
        assert time.perf_counter() - t0 < 1.0
        holding.set()
        await asyncio.gather(*tasks)

    assert await asyncio.to_thread(wait_until, lambda: idle(server.url), 2.0)
    after = scrape(server.url)
    assert after["specloop:request_success_total{finished_reason=abort}"] - aborts_before == n
    r = httpx.post(server.url + C, json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


async def test_dropped_streams_free_their_blocks_with_the_engine_in_its_own_process() -> None:
    """As above with ``specloop serve``'s default process split: a client that goes away mid-stream
    has its request aborted in the engine process and every block freed. Without the pacing plugin
    (plugin objects do not cross into that process) a request may finish between the client's last
    read and its disconnect, so each one ends as an abort or at its length, most as aborts, and
    the engine stops generating for them (its own token count)."""
    n = 8
    engine = make_engine(tiny_model_dir(), engine_process=True)
    with ServerThread(build_app(engine, served_model_name=MODEL)) as srv:
        def finished(reason: str) -> float:
            return scrape(srv.url).get(f"specloop:request_success_total{{finished_reason={reason}}}", 0)

        before = finished("abort"), finished("length"), scrape(srv.url)["specloop:generation_tokens_total"]

        async def drop_after_two(client: httpx.AsyncClient, i: int) -> None:
            body = {"prompt": [5 + i, 9, 14], "stream": True, "ignore_eos": True, "temperature": 0.0}
            async with client.stream("POST", C, json=body) as r:
                assert r.status_code == 200
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                    if len(events) == 2:
                        break  # closes the connection mid-stream
                assert "data: [DONE]" not in events

        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            await asyncio.gather(*(drop_after_two(client, i) for i in range(n)))
        assert await asyncio.to_thread(wait_until, lambda: idle(srv.url), 10.0)
        aborted, at_length = finished("abort") - before[0], finished("length") - before[1]
        generated = scrape(srv.url)["specloop:generation_tokens_total"] - before[2]
        assert aborted + at_length == n and aborted >= n // 2
        # The aborts reached the engine process: each request stopped a few tokens after its
        # client left, not at its length (253 tokens each; ~5 each when measured).
        assert generated <= n * 64


async def test_a_request_id_in_flight_is_refused_before_any_stream_starts(server: ServerThread) -> None:
    """A client's ``request_id`` names one request at a time: a second one with it, while the
    first streams, is a 400 naming the field (not a 200 whose stream carries the error); once the
    first has finished the id is free again."""
    first = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 40, "ignore_eos": True, "stream": True,
             "request_id": "mine"}
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", server.url + C, json=first) as running:
            assert running.status_code == 200
            lines = running.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass
            for stream in (True, False):
                r = await client.post(server.url + C, json={**first, "max_tokens": 2, "stream": stream})
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "request_id" and "'mine'" in r.json()["error"]["message"]
            rest = [line async for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        r = await client.post(server.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "request_id": "mine"})
        assert r.status_code == 200 and r.json()["id"] == "mine"


def test_non_streaming_client_that_gives_up_is_aborted(server: ServerThread) -> None:
    aborts_before = scrape(server.url).get("specloop:request_success_total{finished_reason=abort}", 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + C, json={"prompt": [3, 4, 5], "ignore_eos": True, "temperature": 0.0}, timeout=0.3)
    assert wait_until(lambda: idle(server.url), timeout=2)
    after = scrape(server.url)
    assert after["specloop:request_success_total{finished_reason=abort}"] - aborts_before == 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_exits_cleanly_on_signal(sig: int) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "specloop", *serve_argv(tiny_model_dir(), port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        def healthy() -> bool:
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(healthy, timeout=60, interval=0.1), proc.stdout.read().decode() if proc.poll() else ""
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": [3, 4, 5], "stream": True, "ignore_eos": True}
            with httpx.stream("POST", url + C, json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(30)
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 0
        reader.join(10)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])["choices"][0]
        assert last["finish_reason"] == "abort"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_dead_engine_process_gives_503s_and_a_clean_exit() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "specloop", *serve_argv(tiny_model_dir(), port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        def health() -> int:
            try:
                return httpx.get(url + "/health", timeout=1).status_code
            except httpx.TransportError:
                return 0

        assert wait_until(lambda: health() == 200, timeout=60, interval=0.1)
        body = {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0.0}
        assert httpx.post(url + C, json=body, timeout=30).status_code == 200
        # The engine core runs in a child process (`specloop serve` starts one by default).
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(p) for p in f.read().split()]
        (engine_pid,) = [p for p in children if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
        os.kill(engine_pid, signal.SIGKILL)
        assert wait_until(lambda: health() == 503, timeout=10, interval=0.05)
        r = httpx.post(url + C, json=body, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_closes_stalled_uploads_at_once() -> None:
    """Ten clients stuck mid-body once held SIGTERM for uvicorn's whole graceful timeout (10.6 s),
    then each was cancelled with a traceback and logged as a 500. Now their connections close at
    once: a clean, quiet, prompt exit."""
    import socket

    port = free_port()
    argv = [*serve_argv(tiny_model_dir(), port)[:-2], "--log-level", "info"]
    proc = subprocess.Popen([sys.executable, "-m", "specloop", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ})
    socks = []
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        assert wait_until(healthy, timeout=60, interval=0.1)
        head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 1000\r\n\r\n{\"prompt\": ")
        for _ in range(10):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.sendall(head)
            socks.append(sock)
        # Once /health answers after the heads were sent, the server has read them.
        assert healthy()
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        elapsed = time.monotonic() - start
        log = proc.stdout.read().decode()
        assert elapsed < 5, (elapsed, log)
        assert "Traceback" not in log and '" 500' not in log and "ERROR" not in log, log
        for sock in socks:
            assert sock.recv(1) == b""
    finally:
        for sock in socks:
            sock.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_steps_outputs_cross_the_process_boundary_whole() -> None:
    """The engine process sends a step's per-request outputs as plain tuples: every field of every
    output arrives, in order."""
    import pickle

    from specloop.frontend.engine_process import _pack, _unpack
    from specloop.kernel.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats, TokenLogprobs
    from specloop.kernel.request import FinishReason

    lp = TokenLogprobs(7, -0.5, 2, [3, 7], [-0.1, -0.5])
    outs = EngineCoreOutputs([EngineCoreOutput("a", [7, 8], [lp, lp], [None, lp], FinishReason.STOP, "\n", 16, 3, 2, None),
                              EngineCoreOutput("b", [], error="boom", finish_reason=FinishReason.ERROR)],
                             SchedulerStats(num_running_reqs=2))
    got = _unpack(pickle.loads(pickle.dumps(_pack(outs))))
    assert got == outs and got.outputs[0].finished and got.scheduler_stats.num_running_reqs == 2

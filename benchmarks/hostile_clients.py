"""How long one hostile client can stall everyone else on `specloop serve`.

Starts the server on loopback (the embedded default model, CPU) in its own process, with a
1024-file limit so that stalled sockets meet the connection cap, and keeps two probes running
against it: a `/health` prober (one keep-alive connection, a request every 2 ms; its worst
latency is the server's worst event-loop stall, plus a loopback round trip) and a normal stream
(completions of 200 tokens, one after another; its worst gap between chunks, against the gaps
measured before any hostile request). Then, one at a time:

* a 14 MB completions body (`"x = 1\\n" * 2.3M`)
* 400,000 chat messages
* 64 stop strings of 20,000 characters with n=16 (served: the server runs with
  `--max-stop-string-length 20000`, so the matching itself is measured)
* 600 sockets that send half a request head and stall (held 3 s; a normal request is sent meanwhile)
* a 14 MB `/tokenize` body and a 14 MB `/detokenize` body

and prints, per scenario, the answer, the worst `/health` latency and the stream's worst gap.

    python benchmarks/hostile_clients.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import socket
import subprocess
import sys
import time
from typing import Any, Awaitable, Callable

import httpx
import orjson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Probes:
    """The /health prober and the normal stream; ``window()`` resets their worst figures."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst_health = 0.0
        self.worst_gap = 0.0
        self.gaps: list[float] = []
        self.tokens = 0
        self.stop = False

    def window(self) -> None:
        self.worst_health = self.worst_gap = 0.0
        self.tokens = 0

    async def health(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            while not self.stop:
                start = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                self.worst_health = max(self.worst_health, time.perf_counter() - start)
                await asyncio.sleep(0.002)

    async def stream(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "temperature": 0}
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            while not self.stop:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    last = None
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        now = time.perf_counter()
                        if last is not None:
                            self.gaps.append(now - last)
                            self.worst_gap = max(self.worst_gap, now - last)
                        last = now
                        self.tokens += 1


async def post(url: str, path: str, content: bytes) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        r = await client.post(path, content=content, headers={"content-type": "application/json"})
        reason = r.json()["error"]["message"][:60] if r.status_code >= 400 else f"{len(r.content)} bytes"
        return f"{r.status_code} in {time.perf_counter() - start:.2f} s ({reason})"


async def stalled_sockets(url: str, port: int, count: int, hold: float) -> str:
    writers = []
    for _ in range(count):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            continue
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-")
        writers.append(writer)
    await asyncio.sleep(hold / 2)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    await asyncio.sleep(hold / 2)
    for writer in writers:
        writer.close()
    return f"{len(writers)} opened; a normal request meanwhile: {r.status_code}"


async def main(args: argparse.Namespace) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "specloop", "serve", "--port", str(port), "--device", "cpu", "--log-level",
           "warning", "--max-stop-string-length", "20000"]

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.server_files, args.server_files))

    server = subprocess.Popen(cmd, preexec_fn=limit_files, cwd=ROOT)
    try:
        async with httpx.AsyncClient(base_url=url) as client:
            for _ in range(600):
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        print(f"specloop {commit}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; server: "
              f"{' '.join(cmd[2:])}, ulimit -n {args.server_files}")
        bodies: dict[str, tuple[str, bytes]] = {
            "14 MB completions body": ("/v1/completions", orjson.dumps({"prompt": "x = 1\n" * 2_330_000,
                                                                         "max_tokens": 1})),
            "400,000 chat messages": ("/v1/chat/completions", orjson.dumps(
                {"messages": [{"role": "user", "content": "hi"}] * 400_000})),
            "64 x 20,000-char stop strings, n=16": ("/v1/completions", orjson.dumps(
                {"prompt": "Once upon a time", "n": 16, "max_tokens": 64, "ignore_eos": True,
                 "stop": [f"{i:02d}" + "ab" * 9999 for i in range(64)]})),
            "14 MB /tokenize body": ("/tokenize", orjson.dumps({"prompt": "x = 1\n" * 2_330_000})),
            "14 MB /detokenize body": ("/detokenize", orjson.dumps({"tokens": [5] * 7_000_000})),
        }
        probes = Probes(url)
        tasks = [asyncio.create_task(probes.health()), asyncio.create_task(probes.stream())]
        await asyncio.sleep(args.settle)
        probes.window()
        await asyncio.sleep(args.settle)
        base_gaps = sorted(probes.gaps)
        print(f"baseline ({args.settle:.0f} s, no hostile client): worst /health {probes.worst_health * 1000:.1f} ms, "
              f"stream gap p50 {base_gaps[len(base_gaps) // 2] * 1000:.1f} ms, worst {probes.worst_gap * 1000:.1f} ms")
        print(f"{'scenario':<38} {'worst /health':>13} {'worst stream gap':>16}  answer")
        scenarios: list[tuple[str, Callable[[], Awaitable[str]]]] = [
            (name, lambda p=path, b=body: post(url, p, b)) for name, (path, body) in list(bodies.items())[:3]]
        scenarios.append(("600 stalled sockets", lambda: stalled_sockets(url, port, 600, 3.0)))
        scenarios += [(name, lambda p=path, b=body: post(url, p, b)) for name, (path, body) in list(bodies.items())[3:]]
        for name, run in scenarios:
            await asyncio.sleep(0.5)
            probes.window()
            answer = await run()
            await asyncio.sleep(0.2)
            print(f"{name:<38} {probes.worst_health * 1000:>10.1f} ms {probes.worst_gap * 1000:>13.1f} ms  {answer}",
                  flush=True)
        probes.stop = True
        await asyncio.wait(tasks, timeout=60)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-files", type=int, default=1024, help="the server's open-file limit")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of baseline")
    asyncio.run(main(parser.parse_args()))

"""Serving benchmark: a bounded async load generator against ``specloop serve``
on loopback.

Poisson arrivals at each request rate (``inf``: all at once), random token-id prompts of
``--input-len`` tokens, ``--output-len`` output tokens each (``ignore_eos``), streamed. Every rate gets
prompts of its own (so no run is served from an earlier run's prefix cache), after a warm-up pass
that compiles/initialises kernels for the shapes the runs will see. Reports TTFT,
TPOT ((latency - TTFT) / (output_len - 1)), ITL (gaps between streamed chunks), end-to-end latency
(mean, p50, p99), request and token throughput; with ``--offline``, also offline ``LLM.generate``
throughput on the same prompts in the same run and the serving/offline ratio at rate ``inf``.

    python benchmarks/serving.py --model /path/to/model --rates 1,4,16,inf --num-prompts 200

``--model scripted`` serves the ``scripted`` model runner (no model, no GPU; a 1000-token
vocabulary): what is left is the host's share, the server, the engine-process hop, output
processing and the engine loop, against the same engine offline.

    python benchmarks/serving.py --model scripted --rates inf --num-prompts 256 --input-len 128 --offline
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import git_commit  # noqa: E402


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def device_name(device: str) -> str:
    try:
        import torch

        if device != "cpu" and torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


SCRIPTED = ["--model-runner", "scripted", "--skip-tokenizer-init"]

try:  # the load generator's event loop: uvloop where it is installed
    from uvloop import run as run_loop
except ImportError:
    run_loop = asyncio.run


def vocab_size(model: str) -> int:
    if model == "scripted":
        return 1000  # the scripted runner's default vocabulary
    with open(os.path.join(model, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


async def one_request(host: str, port: int, model: str, prompt: list[int], output_len: int) -> Result:
    """One streamed completion over its own connection, read with asyncio streams: the status line,
    the headers, then the chunked body's server-sent events, each timed as it arrives. (A
    general-purpose client's per-event cost would make the load generator, not the server, the
    bottleneck at tens of thousands of tokens a second.)"""
    body = orjson.dumps({"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                         "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}})
    start = time.perf_counter()
    ttft, last, itl, tokens = 0.0, start, [], 0
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        headers = head.lower()
        if b"transfer-encoding: chunked" not in headers:
            length = b"0"
            if b"content-length:" in headers:
                length = headers.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]
            payload = await reader.readexactly(int(length))
            return Result(False, error=f"HTTP {status}: {payload[:200]!r}")
        if status != 200:
            return Result(False, error=f"HTTP {status}")
        pending = b""
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";", 1)[0], 16)
            if size == 0:
                break
            pending += (await reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                chunk = orjson.loads(event[6:])
                if "error" in chunk:
                    return Result(False, error=chunk["error"]["message"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if not chunk["choices"]:
                    continue
                now = time.perf_counter()
                if ttft == 0.0:
                    ttft = now - start
                else:
                    itl.append(now - last)
                last = now
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        return Result(False, error=repr(e))
    finally:
        if writer is not None:
            writer.close()
    return Result(True, ttft, time.perf_counter() - start, tokens, itl)


async def run_rate(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float,
                   max_concurrency: int, seed: int) -> tuple[list[Result], float]:
    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(max_concurrency)
    address = httpx.URL(url)

    async def bounded(prompt: list[int]) -> Result:
        async with limit:
            return await one_request(address.host, address.port, model, prompt, output_len)

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(bounded(prompt)))
        if rate != float("inf"):
            await asyncio.sleep(rng.exponential(1.0 / rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(results: list[Result], duration: float, input_len: int) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    if not ok:
        return {"completed": 0, "failed": len(results)}
    ttft = np.array([r.ttft for r in ok]) * 1000
    tpot = np.array([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]) * 1000
    itl = np.array([x for r in ok for x in r.itl] or [0.0]) * 1000
    e2e = np.array([r.latency for r in ok]) * 1000
    out_tokens = sum(r.output_tokens for r in ok)
    stats: dict[str, float] = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
                               "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
                               "total_token_throughput": (out_tokens + input_len * len(ok)) / duration}
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2e_ms", e2e)):
        if len(values):
            stats[f"mean_{name}"] = float(values.mean())
            stats[f"p50_{name}"] = float(np.percentile(values, 50))
            stats[f"p99_{name}"] = float(np.percentile(values, 99))
    return stats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, engine_args: list[str]) -> subprocess.Popen[bytes]:
    model_args = SCRIPTED if model == "scripted" else [model]
    cmd = [sys.executable, "-m", "specloop", "serve", *model_args, "--port", str(port), "--served-model-name",
           "bench", "--log-level", "warning", *engine_args]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"specloop serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("specloop serve did not become healthy")


def offline_throughput(model: str, engine_args: list[str], warmup: list[list[int]], prompts: list[list[int]],
                       output_len: int) -> float:
    from specloop import LLM, SamplingParams
    from specloop.cli import build_parser, engine_kwargs
    from specloop.frontend.engine_builder import freeze_heap

    model_args = SCRIPTED if model == "scripted" else [model]
    kwargs = engine_kwargs(build_parser().parse_args(["serve", *model_args, *engine_args]))
    llm = LLM(None if model == "scripted" else model, **kwargs)
    freeze_heap()  # as the engine process does
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    llm.generate(warmup, params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="local Hugging Face model directory, or 'scripted' (no model)")
    ap.add_argument("--url", default=None, help="an already running server (default: start one on loopback)")
    ap.add_argument("--engine-args", default="", help='flags for specloop serve / LLM, e.g. "--dtype bfloat16"')
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rates", default="1,4,16,inf", help="comma-separated requests/s; inf = all at once")
    ap.add_argument("--max-concurrency", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=None, help="warm-up prompts sent at once (default: --num-prompts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offline", action="store_true", help="also measure offline LLM throughput (same prompts)")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()

    engine_args = shlex.split(args.engine_args)
    rates = [float(r) for r in args.rates.split(",")]
    device = engine_args[engine_args.index("--device") + 1] if "--device" in engine_args else "auto"
    config = {"benchmark": "serving", "git_commit": git_commit(), "device": device_name(device), "model": args.model,
              "engine_args": args.engine_args, "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "rates": args.rates, "max_concurrency": args.max_concurrency,
              "seed": args.seed, "python": platform.python_version()}
    print(json.dumps(config, indent=1), flush=True)

    vocab = vocab_size(args.model)
    warmup = make_prompts(args.warmup or args.num_prompts, args.input_len, vocab, args.seed)
    prompt_sets = [make_prompts(args.num_prompts, args.input_len, vocab, args.seed + 1 + i) for i in range(len(rates))]
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        proc = start_server(args.model, port, engine_args)
        url = f"http://127.0.0.1:{port}"
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    report: dict[str, Any] = {"config": config, "rates": {}}
    try:
        run_loop(run_rate(url, model, warmup, args.output_len, float("inf"), args.max_concurrency, args.seed))
        for rate, prompts in zip(rates, prompt_sets):
            results, duration = run_loop(run_rate(url, model, prompts, args.output_len, rate,
                                                     args.max_concurrency, args.seed))
            stats = summarize(results, duration, args.input_len)
            report["rates"][str(rate)] = stats
            print(f"\nrate={rate} req/s")
            for key, value in stats.items():
                print(f"  {key:<24} {value:.2f}" if isinstance(value, float) else f"  {key:<24} {value}")
            errors = {r.error for r in results if not r.ok}
            if errors:
                print(f"  errors: {sorted(errors)[:3]}")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    if args.offline:
        at_inf = prompt_sets[rates.index(float("inf"))] if float("inf") in rates else prompt_sets[-1]
        offline = offline_throughput(args.model, engine_args, warmup, at_inf, args.output_len)
        report["offline_output_throughput"] = offline
        print(f"\noffline output throughput  {offline:.2f} tok/s")
        inf = report["rates"].get("inf", {}).get("output_throughput")
        if inf:
            report["serving_inf_over_offline"] = inf / offline
            print(f"serving (rate inf) / offline  {inf / offline:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the server tests share: a tiny model directory, engines on it, and the real server (uvicorn)
running on a free loopback port in a background thread with its own event loop."""

from __future__ import annotations

import asyncio
import atexit
import functools
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from tokenizer_helpers import build_tokenizer

from specloop.frontend.async_engine import AsyncEngine
from specloop.kernel.config import EngineConfig
from specloop.kernel.plugins import PluginManager
from specloop.server.connections import ConnectionLimits
from specloop.server.launcher import uvicorn_config

MAX_MODEL_LEN = 256
VOCAB_SIZE = 400


def build_tiny_model(path: str) -> str:
    """A byte-level BPE tokenizer trained in-process, plus a randomly initialised two-layer Qwen3
    saved by transformers (safetensors), in one Hugging Face directory."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    build_tokenizer(path, vocab_size=VOCAB_SIZE)
    with open(os.path.join(path, "tokenizer.json")) as f:
        vocab_size = len(json.load(f)["model"]["vocab"])
    eos = 1  # "<|eos|>", the second special token
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=eos, torch_dtype="float32")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


@functools.cache
def tiny_model_dir() -> str:
    """Built once per test process (every server test module shares it)."""
    path = tempfile.mkdtemp(prefix="specloop-tiny-qwen3-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return build_tiny_model(path)


def engine_config(model_dir: str, **overrides: Any) -> EngineConfig:
    kwargs: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 512, "block_size": 16,
                              "device": "cpu", "dtype": "float32"}
    kwargs.update(overrides)
    return EngineConfig(model=model_dir, **kwargs)


def serve_argv(model_dir: str, port: int) -> list[str]:
    """``specloop serve`` on the tiny model (what a user would type)."""
    argv = ["serve", model_dir, "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--device", "cpu",
            "--log-level", "warning"]
    return argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_engine(model_dir: str, plugins: PluginManager | None = None, engine_process: bool = False,
                **overrides: Any) -> AsyncEngine:
    return AsyncEngine(engine_config(model_dir, **overrides), plugins, engine_process=engine_process)


class ServerThread:
    """``uvicorn`` serving ``app`` on 127.0.0.1 (a free port) from a thread with its own uvloop loop,
    behind the server's connection guard (``connections``: its limits); the app's lifespan starts and
    stops the engine on that loop."""

    def __init__(self, app: Any, connections: ConnectionLimits | None = None) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(app, connections or ConnectionLimits(), log_level="warning")
        config.timeout_graceful_shutdown = 5
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="test-server", daemon=True)
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        import uvloop

        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve(sockets=[self.sock])

        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(serve())
        except BaseException as e:  # surfaced by __enter__ / the tests
            self.error = e

    def lag(self) -> LoopLag:
        """Watches the server's event loop: ``with server.lag() as lag: ...`` then ``lag.worst``."""
        assert self.loop is not None
        return LoopLag(self.loop)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if self.error is not None or not self.thread.is_alive():
                raise RuntimeError(f"server failed to start: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


class LoopLag:
    """The longest stall of an event loop while the ``with`` block runs: a task on that loop wakes
    every millisecond and records the longest gap between its wake-ups (the loop could run nothing
    else meanwhile either). A measurement only: nothing waits on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.worst = 0.0
        self._stop = threading.Event()
        self._started = threading.Event()
        self._future: Any = None

    async def _watch(self) -> None:
        self._started.set()
        last = time.perf_counter()
        while not self._stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.worst = max(self.worst, now - last)
            last = now

    def __enter__(self) -> LoopLag:
        self._future = asyncio.run_coroutine_threadsafe(self._watch(), self.loop)
        assert self._started.wait(30), "the server's loop did not run the watcher"
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._future.result(timeout=30)


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` parsed by prometheus-client's text parser: sample name (+ labels but model_name)
    -> value."""
    text = httpx.get(f"{url}/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def wait_until(predicate: Any, timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()

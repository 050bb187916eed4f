"""The engine core in its own process, and the client the API process talks to it through.

The API process keeps the event loop, HTTP, tokenization, detokenization and output processing;
the engine process runs the busy loop (scheduler, runner, the GPU) with a whole interpreter to
itself, so neither stalls the other on Python's lock. They exchange one message per batch of adds
or aborts and one per engine step (every request's outputs of that step together) over ZeroMQ
sockets in a private temporary directory:

    API -> engine   ("add", [Request, ...]) | ("abort", [request id, ...]) | ("shutdown", None)
    engine -> API   ("ready", (resolved EngineConfig, vocab size)) | ("outputs", (output rows, stats))
                    | ("error", message)

Messages are pickled kernel dataclasses, a step's per-request outputs as plain tuples (pickling
slotted dataclasses one by one costs about ten times more, ~0.4 ms a step at 200 requests): both
ends run the same code, and the sockets are reachable only through the owner's temporary
directory. ``EngineProcessClient`` has the interface of
:class:`specloop.kernel.engine_core.AsyncEngineCore`, so ``AsyncEngine`` uses either.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import multiprocessing
import operator
import os
import pickle
import shutil
import signal
import tempfile
import threading
from typing import Any, Callable

import zmq

from specloop.kernel.config import EngineConfig
from specloop.kernel.engine_core import EngineCore, EngineDeadError
from specloop.kernel.outputs import EngineCoreOutput, EngineCoreOutputs
from specloop.kernel.plugins import PluginManager
from specloop.kernel.request import FinishReason, Request

from .engine_builder import freeze_heap

logger = logging.getLogger("specloop")

# How often an idle engine process checks that the API process is still there, in ms.
PARENT_CHECK_MS = 1000


def _send(sock: zmq.Socket, kind: str, payload: Any) -> bool:
    """Queue one message; False when nobody is connected at the other end (it went away). The
    sockets queue without limit (``SNDHWM`` 0), so only a missing peer can make a send wait."""
    try:
        sock.send(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL), flags=zmq.NOBLOCK, copy=False)
        return True
    except zmq.Again:
        return False


_OUTPUT_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(EngineCoreOutput)))


def _pack(out: EngineCoreOutputs) -> tuple[list[tuple], Any]:
    return list(map(_OUTPUT_FIELDS, out.outputs)), out.scheduler_stats


def _unpack(payload: tuple[list[tuple], Any]) -> EngineCoreOutputs:
    rows, stats = payload
    return EngineCoreOutputs([EngineCoreOutput(*row) for row in rows], stats)


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def run_engine_core(config: EngineConfig, inputs: str, outputs: str) -> None:
    """The engine process: build the core, say ready, then loop: drain inputs (blocking only when
    idle), step, send the step's outputs."""
    # Ctrl-C reaches the whole process group; the API process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    pull = _socket(ctx, zmq.PULL)
    pull.connect(inputs)
    push = _socket(ctx, zmq.PUSH)
    push.connect(outputs)
    parent = os.getppid()
    try:
        core = EngineCore(config, PluginManager(disable=config.disable_plugins))
    except Exception as e:  # a bad model directory, device or config: the API process reports it
        _send(push, "error", f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e))
        push.close(linger=2000)
        return
    freeze_heap()  # this process holds one engine for its whole life
    _send(push, "ready", (config, core.runner.vocab_size))
    try:
        while True:
            idle = not core.has_unfinished_requests()
            if idle and not pull.poll(PARENT_CHECK_MS):
                if os.getppid() != parent:
                    break  # the API process is gone
                failure = getattr(core.runner, "failure", None)  # e.g. a tensor-parallel worker died
                if failure:
                    _send(push, "error", str(failure))
                    break
                continue
            stop = False
            while pull.poll(0):
                kind, payload = pickle.loads(pull.recv())
                if kind == "add":
                    core.add_requests(payload)
                elif kind == "abort":
                    if core.abort_requests(payload) and not core.has_unfinished_requests():
                        _send(push, "outputs", ([], core.scheduler.make_stats()))
                elif kind == "shutdown":
                    stop = True
            if stop:
                break
            if core.has_unfinished_requests():
                out = core.step()
                core.post_step()
                if not _send(push, "outputs", _pack(out)):
                    break  # the API process is gone
    except Exception as e:
        logger.exception("engine step failed; the engine is now dead")
        _send(push, "error", f"engine error: {e!r}")
    finally:
        core.shutdown()
        push.close(linger=2000)
        pull.close(linger=0)
        ctx.term()


class EngineProcessClient:
    """The API process's side: starts the engine process, sends it requests and aborts, and hands
    each step's outputs to the requests' queues (registered before the request is sent). A thread
    receives the outputs (one blocking read per step, off the event loop) and passes them to the
    loop."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = 600.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="specloop-ipc-")
        os.chmod(self._dir, 0o700)
        inputs, outputs = f"ipc://{self._dir}/inputs", f"ipc://{self._dir}/outputs"
        self._ctx = zmq.Context()
        self._push = _socket(self._ctx, zmq.PUSH)
        self._push.bind(inputs)
        self._pull = _socket(self._ctx, zmq.PULL)
        self._pull.bind(outputs)
        mp = multiprocessing.get_context("spawn")
        # Not a daemon: it may start processes of its own (tensor-parallel workers). It exits on a
        # shutdown message, when this process goes away, or at this interpreter's exit (below).
        self.process = mp.Process(target=run_engine_core, args=(config, inputs, outputs), name="specloop-engine")
        self.process.start()
        atexit.register(self._stop_at_exit)
        self.config, self.vocab_size = self._wait_ready(startup_timeout_s)
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.errored: BaseException | None = None
        self.num_steps = 0
        self.on_outputs: list[Callable[[EngineCoreOutputs], None]] = []

    def _wait_ready(self, timeout_s: float) -> tuple[EngineConfig, int]:
        waited = 0.0
        while not self._pull.poll(500):
            waited += 0.5
            if not self.process.is_alive() or waited >= timeout_s:
                self._close()
                raise RuntimeError(f"the engine process exited during start-up (exit code {self.process.exitcode})"
                                   if not self.process.is_alive() else "the engine process did not start in time")
        kind, payload = pickle.loads(self._pull.recv())
        if kind != "ready":
            self.process.join(5)
            self._close()
            raise ValueError(payload)
        return payload

    # --- the AsyncEngineCore interface ----------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._receive, name="specloop-engine-outputs", daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.errored is None

    def add_request(self, request: Request,
                    queue: asyncio.Queue[EngineCoreOutput] | None = None) -> asyncio.Queue[EngineCoreOutput]:
        if self.errored is not None:
            raise EngineDeadError(f"engine is dead: {self.errored!r}")
        if request.request_id in self._queues:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        queue = queue if queue is not None else asyncio.Queue()
        self._queues[request.request_id] = queue  # before the request leaves this process
        if not _send(self._push, "add", [request]):
            self._die("the engine process is not reading its input")
            raise EngineDeadError("the engine process is not reading its input")
        return queue

    def abort(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self._queues.pop(rid, None)
        if self.errored is None and ids:
            _send(self._push, "abort", ids)

    async def shutdown(self) -> None:
        self._stopping = True
        if self.process.is_alive():
            _send(self._push, "shutdown", None)  # not delivered if it stopped reading: then the join times out
            await asyncio.get_running_loop().run_in_executor(None, self.process.join, 30 if self.errored is None else 5)
            if self.process.is_alive():
                self.process.kill()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)
        self._fail_all("engine shut down", FinishReason.ABORT)
        self._close()

    def _stop_at_exit(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()

    # --- outputs ----------------------------------------------------------------------------------

    def _receive(self) -> None:
        """On the receiving thread: hand each message to the event loop, in order."""
        assert self._loop is not None
        while not self._stopping:
            if not self._pull.poll(PARENT_CHECK_MS):
                if not self.process.is_alive() and not self._stopping:
                    message = f"the engine process exited (exit code {self.process.exitcode})"
                    self._loop.call_soon_threadsafe(self._die, message)
                    return
                continue
            kind, payload = pickle.loads(self._pull.recv())
            if kind == "error":
                self._loop.call_soon_threadsafe(self._die, payload)
                return
            self._loop.call_soon_threadsafe(self._dispatch, _unpack(payload))

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        self.num_steps += 1
        for out in outputs.outputs:
            queue = self._queues.get(out.req_id)
            if queue is None:  # aborted meanwhile: late output is dropped
                continue
            queue.put_nowait(out)
            if out.finished:
                del self._queues[out.req_id]
        for callback in self.on_outputs:
            callback(outputs)

    def _die(self, message: str) -> None:
        logger.error("engine failed: %s", message)
        self.errored = EngineDeadError(message)
        self._fail_all(message)

    def _fail_all(self, message: str, reason: FinishReason = FinishReason.ERROR) -> None:
        for rid, queue in list(self._queues.items()):
            queue.put_nowait(EngineCoreOutput(req_id=rid, new_token_ids=[], finish_reason=reason, error=message))
        self._queues.clear()

    def _close(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

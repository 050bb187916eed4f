"""Tensor parallelism across processes: one scheduler, N ranks running the same ``ModelRunner`` on
their shards of the model (``tensor_parallel_size``).

Rank 0 is the engine's model runner, in the engine's process (:class:`TensorParallelRunner`); the
other ranks are workers, spawned by it (``torch.multiprocessing``, spawn) or started by torchrun
next to it (:func:`run_torchrun_worker`). They join one torch.distributed group (NCCL on CUDA,
gloo on CPU) plus a gloo group for host objects. Then::

    rank 0 (engine)                                  ranks 1..N-1 (workers)
    ("build", config, platform)      --broadcast-->  load the shard, build the same runner
    ("initialize", resolved config)  --broadcast-->  size the KV cache (the ranks agree on the minimum)
    each step ("step", plan)         --broadcast-->  the same step on their shard:
      execute_model(plan)                              execute_model(plan)  (an all-reduce per block)
      sample_tokens(): sample, broadcast the tokens    sample_tokens(): adopt rank 0's tokens
      take_draft_token_ids() -> the scheduler          take_draft_token_ids(): dropped
    ("shutdown",)                    --broadcast-->  exit

One message per step: the plan, pickled, over the gloo group. Rank 0 samples and broadcasts the
tokens (``shared_tokens.py``), so every rank's request state and proposer see the same tokens
(invariant 8); drafts reach the other ranks in the next plan, as the scheduler recorded them. A
proposer runs on every rank, since a sharded draft model (or the target's head) needs every
rank's shard; its inputs are identical on every rank and it draws with counter-based noise over
all-gathered logits, so its forward passes stay in lockstep.

The kernel knows none of this: ``"torch"`` and ``"gpu"`` runners are built through
:func:`launch_model_runner`, which returns the plain ``ModelRunner`` at size 1 and this runner
otherwise, and a scheduler or proposer plugin never learns how many ranks there are.

A worker that dies (spawned mode) is seen at once by a monitor thread: the engine's next (or
current) step raises instead of waiting, the surviving workers are terminated, and ``failure``
says which rank died; a dead peer also makes every gloo collective fail at once.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing.connection
import os
import signal
import threading
import time
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specloop.kernel.config import EngineConfig
from specloop.kernel.outputs import DraftTokenIds, ModelRunnerOutput, SchedulerOutput
from specloop.kernel.plugins import PluginManager
from specloop.models.loader import resolve_device
from specloop.models.ops import Ops
from specloop.models.parallel import (TensorParallel, abort_tensor_parallel, destroy_tensor_parallel,
                                      init_tensor_parallel)

from .parts import RunnerParts
from .runner import ModelRunner, Platform, TorchPlatform
from .sampling_stage import SamplingStage
from .shared_tokens import BroadcastSampledTokens, ReceiveSampledTokens

logger = logging.getLogger("specloop")

JOIN_TIMEOUT_S = 10.0


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died or its collective failed; the engine cannot continue."""


def launch_model_runner(config: EngineConfig, plugins: PluginManager, platform: Platform
                        ) -> ModelRunner | TensorParallelRunner:
    """The runner for ``config``: one process, or rank 0 of ``tensor_parallel_size`` ranks."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, plugins, platform)
    return TensorParallelRunner(config, plugins, platform)


def torch_model_runner(config: EngineConfig, plugins: PluginManager) -> ModelRunner | TensorParallelRunner:
    """The ``"torch"`` runner: the reference parts, any torch device."""
    return launch_model_runner(config, plugins, TorchPlatform())


class TensorParallelPlatform:
    """A platform's parts for one rank: the same, but rank 0's sampling stage broadcasts its tokens
    and the other ranks' adopt them."""

    def __init__(self, inner: Platform, tp: TensorParallel) -> None:
        self.inner = inner
        self.tp = tp
        self.default_attention_backend = inner.default_attention_backend

    def ops(self, config: EngineConfig) -> Ops:
        return self.inner.ops(config)

    def parts(self, runner: ModelRunner) -> RunnerParts:
        parts = self.inner.parts(runner)
        if self.tp.rank == 0:
            parts.sampler = BroadcastSampledTokens(parts.sampler, self.tp)
        else:
            parts.sampler = ReceiveSampledTokens(SamplingStage(runner.model, runner.vocab_size, runner.device),
                                                 self.tp)
        return parts

    def kv_allocated(self, runner: ModelRunner) -> None:
        self.inner.kv_allocated(runner)


# --- where the ranks come from --------------------------------------------------------------------

def torchrun_rank() -> int | None:
    """This process's global rank when torchrun (or another launcher setting its variables)
    started it, else None."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return int(env.get("RANK", "0"))
    return None


def rank_device(device: str, index: int) -> str:
    """The device of the rank on local GPU ``index`` (CPU ranks all use the CPU)."""
    resolved = resolve_device(device)
    return "cpu" if resolved.type == "cpu" else f"{resolved.type}:{index}"


def _check_world(config: EngineConfig) -> int:
    size = int(os.environ["WORLD_SIZE"])
    if size != config.tensor_parallel_size:
        raise ValueError(f"torchrun started {size} processes but tensor_parallel_size is "
                         f"{config.tensor_parallel_size}; they must match")
    return size


class TensorParallelRunner:
    """Rank 0 of a tensor-parallel group: implements :class:`specloop.kernel.protocols.ModelRunner`
    by sending each call to the other ranks and running it on its own shard (``local``)."""

    def __init__(self, config: EngineConfig, plugins: PluginManager, platform: Platform) -> None:
        if config.async_scheduling:
            raise ValueError("async_scheduling is not supported with tensor_parallel_size > 1 (the ranks step in "
                             "lockstep, each plan committed before the next); leave it unset or turn it off")
        size = config.tensor_parallel_size
        self.failure: str | None = None
        self._closing = False
        self._broken = False  # a step failed half-way: the workers are not listening for messages
        self.workers: list[Any] = []
        device = resolve_device(config.device)
        if torchrun_rank() is not None:
            if torchrun_rank() != 0:
                raise RuntimeError("torchrun rank > 0 runs run_torchrun_worker(), not an engine")
            self.tp = init_tensor_parallel(0, _check_world(config), device)
        else:
            self.tp = self._spawn(config, size, device)
            threading.Thread(target=self._monitor, name="specloop-tp-monitor", daemon=True).start()
        atexit.register(self.shutdown)
        try:
            self._send("build", config, platform)
            self.local = ModelRunner(config, plugins, TensorParallelPlatform(platform, self.tp), tp=self.tp)
        except BaseException:
            self.shutdown()
            raise
        self.config = config
        self.vocab_size = self.local.vocab_size
        self.model_max_len = self.local.model_max_len

    def _spawn(self, config: EngineConfig, size: int, device: torch.device) -> TensorParallel:
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        base = device.index or 0
        ctx = mp.get_context("spawn")
        for rank in range(1, size):
            worker_device = rank_device(config.device, base + rank)
            p = ctx.Process(target=_spawned_worker, args=(rank, size, store.port, worker_device),
                            name=f"specloop-tp{rank}", daemon=True)
            p.start()
            self.workers.append(p)
        keys = [f"joined/{r}" for r in range(1, size)]
        try:
            while not store.check(keys):  # a worker that dies while starting fails the engine here
                for rank, p in enumerate(self.workers, start=1):
                    if not p.is_alive():
                        raise WorkerFailedError(f"tensor-parallel worker rank {rank} exited with code "
                                                f"{p.exitcode} while starting")
                time.sleep(0.02)
            return init_tensor_parallel(0, size, device, store)
        except BaseException:
            self._stop_workers(grace=0.0)
            raise

    def _monitor(self) -> None:
        ranks = {p.sentinel: (rank, p) for rank, p in enumerate(self.workers, start=1)}
        ready = multiprocessing.connection.wait(list(ranks))
        if self._closing:
            return
        rank, p = ranks[ready[0]]
        p.join(1.0)
        self.failure = f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        logger.error("%s; the engine cannot continue", self.failure)
        self._stop_workers(grace=0.0)
        abort_tensor_parallel(self.tp)  # a step waiting on the dead rank returns now

    def _stop_workers(self, grace: float) -> None:
        """Wait ``grace`` seconds for the workers to exit, then terminate (and at last kill) them."""
        deadline = time.monotonic() + grace
        for p in self.workers:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.workers:
            if p.is_alive():
                p.terminate()
        for p in self.workers:
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(1.0)

    # --- the kernel's ModelRunner ------------------------------------------------------------------

    def _send(self, *message: Any) -> None:
        if self.failure is not None:
            raise WorkerFailedError(self.failure)
        self.tp.broadcast_object(message)

    def _failed(self, error: Exception) -> NoReturn:
        """A call raised. When a worker died (a dead peer fails rank 0's collective at once, and
        the monitor names it a moment later), say which; otherwise re-raise as it was."""
        deadline = time.monotonic() + 1.0
        while self.failure is None and self.workers and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.failure is None:
            raise error
        raise WorkerFailedError(self.failure) from error

    def initialize(self) -> int:
        try:
            self._send("initialize", self.config)
            return self.local.initialize()
        except RuntimeError as e:
            self._failed(e)

    def execute_model(self, plan: SchedulerOutput) -> None:
        try:
            self._send("step", plan)
            self.local.execute_model(plan)
        except RuntimeError as e:
            self._broken = True
            self._failed(e)
        except BaseException:
            self._broken = True  # the workers may wait in a collective rank 0 never joins
            raise

    def sample_tokens(self, grammar: Any = None) -> ModelRunnerOutput:
        """``grammar`` masks rank 0's sampling; the other ranks adopt its tokens."""
        try:
            return self.local.sample_tokens(grammar)
        except RuntimeError as e:
            self._broken = True
            self._failed(e)
        except BaseException:
            self._broken = True
            raise

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        return self.local.take_draft_token_ids()

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        if self.failure is None and not self._broken and all(p.is_alive() for p in self.workers):
            try:
                self.tp.broadcast_object(("shutdown",))
                self.tp.farewell()
            except (dist.DistBackendError, RuntimeError):
                pass
        if hasattr(self, "local"):
            self.local.shutdown()
        self._stop_workers(grace=JOIN_TIMEOUT_S)
        destroy_tensor_parallel(self.tp)


# --- the other ranks --------------------------------------------------------------------------------

def _spawned_worker(rank: int, size: int, port: int, device: str) -> None:
    _exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle; it then stops us
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False)
    store.set(f"joined/{rank}", "1")
    tp = init_tensor_parallel(rank, size, torch.device(device), store)
    raise SystemExit(serve_worker(tp, device))


def run_torchrun_worker(config: EngineConfig) -> int:
    """A rank > 0 started by torchrun (any node): join the group and serve rank 0 until it shuts
    down. ``config`` (from the same command line as rank 0's) only picks the device; everything
    else comes from rank 0."""
    _exit_with_parent()
    device = rank_device(config.device, int(os.environ.get("LOCAL_RANK", "0")))
    tp = init_tensor_parallel(int(os.environ["RANK"]), _check_world(config), torch.device(device))
    return serve_worker(tp, device)


def serve_worker(tp: TensorParallel, device: str) -> int:
    """A worker's loop: rank 0's messages, one by one, until ``shutdown``. Returns the exit code."""
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s specloop-tp{tp.rank}: %(message)s")
    runner: ModelRunner | None = None
    try:
        kind, *args = tp.broadcast_object()
        if kind == "shutdown":  # rank 0 failed before it could build anything
            tp.farewell()
            return 0
        config, platform = args  # "build" comes first
        config.device = device
        runner = ModelRunner(config, PluginManager(disable=config.disable_plugins),
                             TensorParallelPlatform(platform, tp), tp=tp)
        while True:
            kind, *args = tp.broadcast_object()
            if kind == "step":
                runner.execute_model(args[0])
                runner.sample_tokens()
                runner.take_draft_token_ids()
            elif kind == "initialize":  # rank 0's config, resolved by its engine; the device stays ours
                for f in dataclasses.fields(EngineConfig):
                    if f.name != "device":
                        setattr(runner.config, f.name, getattr(args[0], f.name))
                runner.initialize()
            elif kind == "shutdown":
                runner.shutdown()
                runner = None
                tp.farewell()
                return 0
    except Exception:
        logger.exception("tensor-parallel rank %d failed", tp.rank)
        return 1
    finally:
        if runner is not None:
            runner.shutdown()
        destroy_tensor_parallel(tp)


def _exit_with_parent() -> None:
    """Exit when the process that started this one goes away (a worker must never outlive its
    engine, whatever killed it)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="specloop-parent-watch", daemon=True).start()


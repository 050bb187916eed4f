"""Data parallelism: ``data_parallel_size`` engine replicas behind the interface of one
:class:`AsyncEngine`, so one HTTP endpoint serves them all.

Each replica is a whole engine (its own scheduler, KV cache and model runner, possibly tensor
parallel), with its busy loop on the shared event loop and its steps on its own thread. A request
goes to one replica, chosen by :class:`Router`:

1. the replica that already holds the longest run of the prompt's leading full KV blocks, keyed as
   the prefix cache keys them (a chained hash of each ``block_size`` tokens), unless it has more
   than ``max_imbalance`` requests in flight beyond the least busy replica;
2. otherwise the least busy replica: fewest requests in flight (waiting + running), as counted by
   the router itself.

The router's view of a replica's prefix cache is the prompts it sent there (the most recent ones,
up to the replica's KV blocks); the replica may have evicted some since, which only costs a miss.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from typing import Any, AsyncIterator, Sequence

from specloop.kernel.config import EngineConfig
from specloop.kernel.engine_core import EngineDeadError
from specloop.kernel.plugins import PluginManager
from specloop.kernel.sampling_params import SamplingParams
from specloop.models.loader import resolve_device

from .async_engine import AsyncEngine
from .input_processor import PromptType
from .engine_builder import make_config
from .request_output import RequestOutput


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block of ``token_ids``, each covering the whole prefix up to its block's
    end (so equal hashes mean equal prefixes)."""
    hashes, parent = [], 0
    for end in range(block_size, len(token_ids) + 1, block_size):
        parent = hash((parent, tuple(token_ids[end - block_size:end])))
        hashes.append(parent)
    return hashes


class Router:
    """Picks a replica per request: prefix affinity first, queue depth second. Event-loop only."""

    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int, max_imbalance: int = 4) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.max_imbalance = max_imbalance
        self.in_flight = [0] * num_replicas
        self.routed = [0] * num_replicas  # requests sent to each replica, ever
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]

    def prefix_blocks(self, replica: int, hashes: Sequence[int]) -> int:
        """Leading blocks of the prompt the replica is believed to hold."""
        cached, n = self._cached[replica], 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n

    def choose(self, hashes: Sequence[int], alive: Sequence[bool] | None = None) -> int:
        candidates = [r for r in range(len(self.in_flight)) if alive is None or alive[r]]
        if not candidates:
            raise EngineDeadError("no data-parallel replica is running")
        least = min(candidates, key=lambda r: (self.in_flight[r], self.routed[r]))
        best = max(candidates, key=lambda r: (self.prefix_blocks(r, hashes), -self.in_flight[r]))
        if self.prefix_blocks(best, hashes) and self.in_flight[best] - self.in_flight[least] <= self.max_imbalance:
            return best
        return least

    def started(self, replica: int, hashes: Sequence[int]) -> None:
        self.in_flight[replica] += 1
        self.routed[replica] += 1
        cached = self._cached[replica]
        for h in hashes:
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.capacity_blocks:
            cached.popitem(last=False)

    def finished(self, replica: int) -> None:
        self.in_flight[replica] -= 1


class DataParallelEngine:
    """``replicas`` behind what the server needs of an :class:`AsyncEngine`."""

    def __init__(self, replicas: Sequence[AsyncEngine], max_imbalance: int = 4) -> None:
        if not replicas:
            raise ValueError("a data-parallel engine needs at least one replica")
        self.replicas = list(replicas)
        first = self.replicas[0]
        self.config: EngineConfig = first.config
        self.tokenizer = first.tokenizer
        self.model_name = first.model_name
        self.vocab_size = first.vocab_size
        self.processor = first.processor  # every replica parses, checks and tokenizes alike
        self.generation_defaults = first.generation_defaults
        self.plugins = first.plugins
        self.router = Router(len(self.replicas), first.config.block_size,
                             min(r.config.num_kv_blocks or 0 for r in self.replicas), max_imbalance)
        self._owner: dict[str, int] = {}

    @classmethod
    def from_engine_args(cls, model: str | None = None, *, step_in_thread: bool = True,
                         engine_process: bool = False, **engine_args: Any) -> DataParallelEngine:
        """``data_parallel_size`` replicas of the engine ``AsyncEngine.from_engine_args`` would build;
        on CUDA replica ``r`` uses devices ``r * tensor_parallel_size`` onwards."""
        base = make_config(model, engine_args)
        if base.data_parallel_size > 1 and base.tensor_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 with tensor_parallel_size > 1 needs one process per replica, "
                             "which specloop does not run yet; start one server per replica instead")
        replicas: list[AsyncEngine] = []
        try:
            for r in range(base.data_parallel_size):
                config = dataclasses.replace(base, data_parallel_size=1, plugin_options=dict(base.plugin_options),
                                             device=replica_device(base.device, r * base.tensor_parallel_size))
                replicas.append(AsyncEngine(config, PluginManager(disable=config.disable_plugins),
                                            step_in_thread=step_in_thread, engine_process=engine_process))
        except BaseException:
            for replica in replicas:
                if replica.core is not None:
                    replica.core.shutdown()
                else:
                    replica.async_core.process.kill()
            raise
        return cls(replicas)

    # --- what the server reads -------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def errored(self) -> BaseException | None:
        """The first replica's error: one dead replica makes the whole engine report dead, as a
        process-level health check expects."""
        return next((r.errored for r in self.replicas if r.errored is not None), None)

    async def start(self) -> None:
        for replica in self.replicas:
            await replica.start()

    async def shutdown(self) -> None:
        await asyncio.gather(*(r.shutdown() for r in self.replicas))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.replicas[0].validate(prompt_token_ids, params)

    def default_max_tokens(self, prompt_len: int) -> int:
        return self.replicas[0].default_max_tokens(prompt_len)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.replicas[0].encode(text, add_special_tokens)

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str, *,
                       priority: int = 0, delta: bool = False, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """:meth:`AsyncEngine.generate` on the replica the router picks."""
        text, ids = self.replicas[0].processor.parse(prompt)
        hashes = block_hashes(ids, self.router.block_size)
        replica = self.router.choose(hashes, [r.errored is None for r in self.replicas])
        self.router.started(replica, hashes)
        self._owner[request_id] = replica
        try:
            async for out in self.replicas[replica].generate({"prompt": text, "prompt_token_ids": ids}, params,
                                                             request_id, priority=priority, delta=delta,
                                                             cache_salt=cache_salt):
                yield out
        finally:
            self.router.finished(replica)
            self._owner.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None:
            await self.replicas[replica].abort(request_id)

    def get_metrics(self) -> dict[str, Any]:
        """The replicas' counters summed (KV-cache usage averaged), plus each replica's in-flight
        and routed request counts."""
        merged: dict[str, Any] = {}
        for replica in self.replicas:
            for key, value in replica.get_metrics().items():
                merged[key] = _add(merged.get(key), value)
        n = len(self.replicas)
        for key in ("kv_cache_usage", "prefix_cache_hit_rate", "spec_acceptance_rate", "spec_mean_acceptance_length"):
            if key in merged:
                merged[key] /= n
        merged["data_parallel_in_flight"] = list(self.router.in_flight)
        merged["data_parallel_routed"] = list(self.router.routed)
        return merged


def _add(total: Any, value: Any) -> Any:
    if total is None:
        return value.copy() if isinstance(value, (dict, list)) else value
    if isinstance(value, dict):
        return {k: total.get(k, 0) + value.get(k, 0) for k in total.keys() | value.keys()}
    if isinstance(value, list):
        longer, shorter = (total, value) if len(total) >= len(value) else (value, total)
        return [a + (shorter[i] if i < len(shorter) else 0) for i, a in enumerate(longer)]
    return total + value


def replica_device(device: str, first_index: int) -> str:
    """Replica devices: on CUDA each replica starts at its own device index; CPUs are shared."""
    resolved = resolve_device(device)
    if resolved.type == "cpu":
        return device
    return f"{resolved.type}:{(resolved.index or 0) + first_index}"


def build_async_engine(model: str | None = None, *, engine_process: bool = False, **engine_args: Any
                       ) -> AsyncEngine | DataParallelEngine:
    """What ``specloop serve`` runs: one engine, or ``data_parallel_size`` replicas behind a router,
    each engine core in a process of its own with ``engine_process``."""
    if int(engine_args.get("data_parallel_size") or 1) > 1:
        return DataParallelEngine.from_engine_args(model, engine_process=engine_process, **engine_args)
    return AsyncEngine.from_engine_args(model, engine_process=engine_process, **engine_args)

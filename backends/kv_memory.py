"""How many KV blocks an engine gets.

``num_kv_blocks`` if given; else ``kv_cache_memory`` bytes; else on CUDA what
``gpu_memory_utilization`` (0.9 unless given) of the device leaves after this engine's own memory
(weights, a draft model, persistent buffers and the peak of a profiled largest step, counted from
what the process held before the engine was built) and what other processes hold, and never more
than is free less twice the largest step's transient memory (room for the graphs captured after
the cache); else on a CPU what ``gpu_memory_utilization`` of the machine's memory leaves after
what is in use (``MemAvailable`` less the fraction not given), or 512 MiB when it is not given;
on a CPU capped at what ``max_num_seqs`` full-length sequences need. One block's
bytes count the target's layers plus those of a proposer that keeps its own cache, so a draft
model's KV comes out of the same budget.
"""

from __future__ import annotations

import gc
import os
from typing import Callable

import torch

from specloop.kernel.config import EngineConfig

CPU_KV_CACHE_BYTES = 512 << 20
GPU_MEMORY_UTILIZATION = 0.9  # when the config gives none


def allocated(device: torch.device) -> int:
    """Bytes this process's allocator holds on ``device`` now (0 off CUDA), garbage collected first:
    an engine dropped in a reference cycle (a proposer's graphs hold their closures) is not held,
    and counted here it would make the next engine's own memory look that much smaller (its budget
    then takes what its proposer's graphs need after the cache is allocated)."""
    if device.type != "cuda":
        return 0
    gc.collect()
    return torch.cuda.memory_allocated(device)


def num_kv_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int, block_size: int,
                  profile: Callable[[], None], baseline: int = 0) -> int:
    """``profile()`` runs the largest step once (CUDA only); ``baseline``: :func:`allocated` before
    the engine loaded anything (an earlier engine in the same process is not this one's)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if config.kv_cache_memory:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        budget = _cuda_budget(config, device, profile, baseline)
    else:
        blocks_per_seq = -(-(config.max_model_len or 2048) // block_size)
        wanted = CPU_KV_CACHE_BYTES if config.gpu_memory_utilization is None else _host_budget(config.gpu_memory_utilization)
        budget = min(wanted, bytes_per_block * (config.max_num_seqs * blocks_per_seq + 1))
    blocks = int(budget // bytes_per_block)
    if blocks < 1:
        raise ValueError(f"the KV-cache budget ({budget} bytes) is smaller than one block "
                         f"({bytes_per_block} bytes); raise kv_cache_memory or gpu_memory_utilization")
    return blocks


def _cuda_budget(config: EngineConfig, device: torch.device, profile: Callable[[], None], baseline: int) -> int:
    gc.collect()  # an engine dropped in a reference cycle: its memory back before anything is measured
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    own_peak = peak - baseline
    # The profile's transient memory (and an earlier engine's, freed) back to the device: cached,
    # it would count as room but come in pieces that one layer's cache may not fit in.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # Memory this process's allocator does not own belongs to other processes or the CUDA context.
    others = total - free - torch.cuda.memory_reserved(device)
    # Free on the device, less what the largest step needs beyond what stays allocated, twice: once
    # for the steps, once for what is allocated after the cache (the CUDA graphs' pools, a proposer's
    # graphs). The first bound leaves room for those too, but it counts an earlier engine of this
    # process as room, and then this one is what binds.
    transient = peak - torch.cuda.memory_allocated(device)
    available = free - 2 * transient
    fraction = config.gpu_memory_utilization or GPU_MEMORY_UTILIZATION
    return int(min(total * fraction - others - own_peak, available))


def _host_budget(fraction: float) -> int:
    """Bytes of the machine's memory a CPU engine's cache may take: what is available less the
    share ``fraction`` leaves to the rest."""
    total, available = host_memory()
    return int(available - total * (1.0 - fraction))


def host_memory() -> tuple[int, int]:
    """The machine's memory and what of it is available, in bytes (``/proc/meminfo``, within the
    process's cgroup limit where one is set; without ``/proc/meminfo``, all of it counts as
    available)."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
        total, available = info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError, ValueError):
        total = available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # a container's limit (cgroup v2): what it may use, less what it uses
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            total, available = min(total, int(limit)), min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return total, available

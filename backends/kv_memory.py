"""How many KV blocks an engine gets.

``num_kv_blocks`` if given; else ``kv_cache_memory`` bytes; else on CUDA what
``gpu_memory_utilization`` of the device leaves after everything else this process and others
hold (weights, a draft model, persistent buffers) and the peak of a profiled largest step; else a
CPU default of 512 MiB, capped at what ``max_num_seqs`` full-length sequences need. One block's
bytes count the target's layers plus those of a proposer that keeps its own cache, so a draft
model's KV comes out of the same budget.
"""

from __future__ import annotations

from typing import Callable

import torch

from specloop.kernel.config import EngineConfig

CPU_KV_CACHE_BYTES = 512 << 20


def num_kv_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int, block_size: int,
                  profile: Callable[[], None]) -> int:
    """``profile()`` runs the largest step once (CUDA only)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if config.kv_cache_memory:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        budget = _cuda_budget(config, device, profile)
    else:
        blocks_per_seq = -(-(config.max_model_len or 2048) // block_size)
        budget = min(CPU_KV_CACHE_BYTES, bytes_per_block * (config.max_num_seqs * blocks_per_seq + 1))
    blocks = int(budget // bytes_per_block)
    if blocks < 1:
        raise ValueError(f"the KV-cache budget ({budget} bytes) is smaller than one block "
                         f"({bytes_per_block} bytes); raise kv_cache_memory or gpu_memory_utilization")
    return blocks


def _cuda_budget(config: EngineConfig, device: torch.device, profile: Callable[[], None]) -> int:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    # Memory this process's allocator does not own belongs to other processes or the CUDA context.
    others = total - free - torch.cuda.memory_reserved(device)
    peak = torch.cuda.max_memory_allocated(device)
    return int(total * config.gpu_memory_utilization - others - peak)

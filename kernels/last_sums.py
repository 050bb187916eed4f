"""Work split across programs, summed by the last of them to finish, not by a second kernel.

A few-rows projection split along its inputs, flash-decoding split along the keys, and the
one-token MoE's down projection spread over groups of a token's experts leave
partial results that a second, tiny kernel used to combine: at batch 1 that is a launch (and a
dependency) per split op, a few microseconds each in a step of a few hundred. Instead each program
stores its part, then counts its arrival with an atomic (:func:`arrive`); the program that arrives
last reads every part, in the same fixed order as the second kernel did, and writes the result, so
the sum is the same from run to run whichever program finishes last.

The count releases the program's stores (every thread's, behind a barrier) and the last program
acquires them; it reads the parts past L1 (``.cg``). Counts live in one zeroed buffer per device,
each zeroed again by the program that finished it, so the buffer is zero between launches and
kernels that run one after another share it. Off by default (the GPU runner's ``last_sums``
option) until measured faster on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_COUNTS = 1 << 16  # arrival counts a launch may use (column blocks; sequences x KV heads)
_ENABLED = False
_COUNTS: dict[torch.device, torch.Tensor] = {}


def set_enabled(on: bool, device: torch.device | None = None) -> None:
    """Sum split work by its last program; ``device``: allocate its counts now, before any CUDA
    graph is captured (a buffer allocated during a capture would belong to the graph's pool)."""
    global _ENABLED
    _ENABLED = bool(on)
    if on and device is not None:
        counts(device)


def enabled() -> bool:
    return _ENABLED


def counts(device: torch.device) -> torch.Tensor:
    """The device's arrival counts (int32, zero between launches)."""
    if device not in _COUNTS:
        _COUNTS[device] = torch.zeros(MAX_COUNTS, dtype=torch.int32, device=device)
    return _COUNTS[device]


@triton.jit
def arrive(count_ptr, index, total: tl.constexpr):
    """Count this program's arrival at ``index`` once all its threads' stores are issued; whether
    it is the last of ``total`` (then every part is visible to it, and the count is zero again)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + index, 1, sem="acq_rel", scope="gpu")
    last = arrived == total - 1
    if last:
        tl.store(count_ptr + index, 0)
    return last

"""Programmatic dependent launch: a decode step's kernels overlap their neighbours.

At batch 1 a decoder layer is a handful of kernels that each read a few MB of weights, and each
spends microseconds starting and draining that no bytes flow in. On Hopper and later a kernel
launched with ``launch_pdl`` may start while the kernel before it on the stream still runs: its
programs begin as soon as every program of that kernel has called ``gdc_launch_dependents``, do
whatever does not depend on it (here: ask L2 for their share of the weights), then block in
``gdc_wait`` until it has finished and its writes are visible. So the next projection's weights
stream in while attention or the previous projection finishes, and launch gaps close.

The rule every kernel taking part follows (:func:`wait_previous`, first in its body, before it
reads or writes any activation, cache or buffer another kernel touches): only weights are read
before the wait. Each program calls ``gdc_launch_dependents`` right after its wait, so at most one
more kernel starts early, never one whose predecessor has not started yet. A kernel launched without
the flag (a torch op) starts after its predecessor as always.

Kernels take a ``PDL`` constexpr and are launched with ``**launch_options(device)``; the GPU runner's
``pdl`` option sets :func:`set_enabled` (by default where it pays: a device of compute capability
9.0 or more and a model whose every projection fits :func:`prefetch_budget`;
``backends.gpu.platform.pdl_pays``). The interpreter and older devices run without it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton 3.3 on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: never enabled
    gdc_launch_dependents = gdc_wait = None

_ENABLED = False
LINE_BYTES = 128  # an L2 prefetch asks for one cache line


def set_enabled(on: bool) -> None:
    """Launch the kernels that take part with programmatic dependent launch (where supported)."""
    global _ENABLED
    _ENABLED = bool(on)


def supported(device: torch.device) -> bool:
    """Compute capability 9.0 or more, a Triton with grid dependency control, not the interpreter."""
    return (device.type == "cuda" and gdc_wait is not None and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0))


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def enabled(device: torch.device) -> bool:
    return _ENABLED and supported(device)


def prefetch_budget(device: torch.device) -> int:
    """The most bytes of weights a kernel asks L2 for before its wait: a third of L2. The kernel
    before it streams its own weights through L2 meanwhile, and a prefetch larger than what L2
    keeps for it is evicted before use and read twice (a projection of an 8B model is 33-235 MB)."""
    return _l2_bytes(device.index if device.index is not None else torch.cuda.current_device()) // 3


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or 50 << 20)  # H100/H200's


def launch_options(device: torch.device) -> dict[str, bool]:
    """The keyword arguments of a launch: the kernel's ``PDL`` constexpr, and the launch flag."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Wait for the kernel before this one to finish (its writes visible), then let the next one
    start its own prologue. A no-op without ``PDL``."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at ``ptrs`` (valid addresses, any shape; one request an element, so
    give one pointer a ``LINE_BYTES`` line). Nothing is read into registers."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)

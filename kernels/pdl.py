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

import contextlib
import functools
import os
from typing import Iterator, Sequence

import torch
import triton
import triton.language as tl

try:  # Triton 3.3 on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: never enabled
    gdc_launch_dependents = gdc_wait = None

_ENABLED = False
LINE_BYTES = 128  # an L2 prefetch asks for one cache line
LINE_BYTES_C: tl.constexpr = tl.constexpr(LINE_BYTES)
AHEAD_REGIONS = 2  # the most weights (or parts of one) a kernel asks L2 for ahead of the next ones
# A step's weights in launch order while recording (:func:`recording`); each weight's regions ahead
# while a plan is set (:func:`planned`), keyed by its address.
_RECORD: list[torch.Tensor] | None = None
_AHEAD: dict[int, tuple[tuple[torch.Tensor, int], ...]] = {}


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


def ahead_plan(sizes: Sequence[int], budget: int, regions: int = AHEAD_REGIONS) -> list[list[tuple[int, int, int]]]:
    """What each of a step's weight-reading kernels asks L2 for once its own loads are out: for the
    weights' sizes in launch order (bytes), each launch's ``(weight, first byte, bytes)`` regions.

    Launch ``i`` covers the bytes of the weights after it, from where the launches before it stopped
    up to ``budget`` bytes past the start of the next weight, in at most ``regions`` pieces. So
    while the kernels without weights run (attention, rotary), the memory keeps streaming the
    projections after them, and each projection finds its weights in L2. A weight larger than
    ``budget`` ends the window: it would evict what was fetched before it is used."""
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    plan: list[list[tuple[int, int, int]]] = []
    cursor = 0
    for i in range(len(sizes)):
        pieces: list[tuple[int, int, int]] = []
        if i + 1 < len(sizes):
            lo, hi = max(cursor, starts[i + 1]), starts[i + 1] + budget
            j = i + 1
            while j < len(sizes) and starts[j] < hi and len(pieces) < regions:
                if sizes[j] > budget:  # too large to keep: the window ends here
                    break
                a, b = max(lo, starts[j]), min(hi, starts[j + 1])
                if b > a:
                    pieces.append((j, a - starts[j], b - a))
                    cursor = b
                j += 1
        plan.append(pieces)
    return plan


@contextlib.contextmanager
def recording() -> Iterator[list[torch.Tensor]]:
    """Collect the weights that the kernels taking part read, in launch order, while inside."""
    global _RECORD
    _RECORD = weights = []
    try:
        yield weights
    finally:
        _RECORD = None


def record(weight: torch.Tensor) -> None:
    if _RECORD is not None:
        _RECORD.append(weight)


@contextlib.contextmanager
def planned(weights: Sequence[torch.Tensor], budget: int) -> Iterator[None]:
    """While inside (a CUDA graph capture), each kernel reading one of ``weights`` (a step's, in
    launch order, from :func:`recording`) asks L2 for its :func:`ahead_plan` regions after its own
    loads. A graph keeps the addresses; the plan is dropped on exit, so no later launch reaches for
    memory the engine may have given back."""
    first: dict[int, int] = {}
    for i, w in enumerate(weights):
        first.setdefault(w.data_ptr(), i)
    order = [weights[i] for i in sorted(first.values())]
    plan = ahead_plan([w.numel() * w.element_size() for w in order], budget)
    _AHEAD.clear()
    for w, pieces in zip(order, plan):
        if pieces:
            _AHEAD[w.data_ptr()] = tuple(
                (order[j].reshape(-1).view(torch.uint8)[start:start + size], -(-size // LINE_BYTES))
                for j, start, size in pieces)
    try:
        yield
    finally:
        _AHEAD.clear()


def ahead_of(weight: torch.Tensor) -> tuple[tuple[torch.Tensor, int], ...]:
    """The planned regions (byte views, L2 lines) a kernel reading ``weight`` asks for ahead."""
    return _AHEAD.get(weight.data_ptr(), ()) if _AHEAD else ()


@triton.jit
def prefetch_ahead(a0_ptr, a0_lines, a1_ptr, a1_lines, AHEAD: tl.constexpr):
    """This program's share of two byte regions (``a0_lines`` and ``a1_lines`` L2 lines from
    ``a0_ptr`` and ``a1_ptr``, uint8 pointers) asked of L2: the programs of the grid take every
    line in turn, ``AHEAD`` each at most."""
    if AHEAD > 0:
        nprog = tl.num_programs(0) * tl.num_programs(1)
        pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        lines = (pid + tl.arange(0, AHEAD) * nprog).to(tl.int64)
        in0 = lines < a0_lines
        in1 = (lines >= a0_lines) & (lines < a0_lines + a1_lines)
        offs0 = tl.where(in0, lines * LINE_BYTES_C, 0)
        offs1 = tl.where(in1, (lines - a0_lines) * LINE_BYTES_C, 0)
        prefetch_l2(tl.where(in1, a1_ptr + offs1, a0_ptr + offs0))

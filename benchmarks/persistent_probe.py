"""Would one persistent kernel a decode step beat a kernel a projection at batch 1?

A batch-1 decode step of a small model is ~110 launches of projections that each read 4-13 MB;
each costs ~3.3 us whatever it reads (see docs/benchmarks.md), so qwen3-0.6b's step stays near
twice its bandwidth time. The alternative is one kernel whose programs stay resident and meet at
a grid-wide barrier (an atomic counter) between the steps of the chain, asking L2 for their next
weights while they wait. This probe times that structure on a decoder's projection chain, without
attention: for each layer ``qkv = Wqkv rms(x)``, ``h = x + Wo qkv[:q]``, ``act = silu(g) * u`` for
``[g | u] = Wgu rms(h)``, ``x = h + Wd act``; four barriers a layer. Beside it in the same run: the
same chain through the engine's few-rows kernels (norm and activation fused, one launch a
projection) in one CUDA graph, the bandwidth time of the weights, and the barriers alone.

    python benchmarks/persistent_probe.py --shapes qwen3-0.6b,llama3-8b --out out/bench

Checks its own result against float64 torch (a broken barrier, or activations read through an SM's
L1 after another SM rewrote them, reads stale values: the activations are read past L1) and the
counter's final value (one arrival a program a barrier). On the H200 the few-rows kernels won
(docs/benchmarks.md, session of 2026-12-05): a program walked its rows in short loops and kept one
or two tiles in flight.

A second layout ("held"): each program owns one block of rows of every projection and holds its
whole tile in registers, loaded in one go; the next projection's tile is requested right after the
program arrives at a barrier, so its weights stream in while the program waits for the others
(weights do not depend on the barrier, only activations do), and after the barrier only the
activations remain to be read. Only where every tile fits a program's registers (qwen3-0.6b's at
one program an SM; not llama3-8b's). On an H100 it beat the short loops but not the few-rows
kernels (qwen3-0.6b: 681.6 us against 854-957 and 621.8; docs/benchmarks.md, session of
2026-12-05, fifth), and a whole decode step built that way ran 790 tok/s against 978: a block is
requested only once the step before it is done, so its stream from HBM hides behind the wait
alone. Its variant "L2 a step ahead" also asks L2 for each block a step before it loads it into
registers, so that HBM streams behind a whole step and the registers fill from L2. A layout
whose programs the device cannot hold at once would hang at its first barrier: each is compiled
first and skipped if its registers, threads or shared memory do not fit. ``--device cpu`` under
``TRITON_INTERPRET=1`` checks both layouts at a tiny shape with one program (the interpreter runs
programs one after another).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, measure_bandwidth, report, save  # noqa: E402

SHAPES = {  # hidden, q size, kv size, intermediate, layers
    "qwen3-0.6b": (1024, 2048, 1024, 3072, 28),
    "llama3-8b": (4096, 4096, 1024, 14336, 32),
    "tiny": (64, 64, 32, 128, 2),  # the CPU check (every size a multiple of the chain kernel's blocks)
}
HELD_ELEMENTS = 128  # the most elements of one tile a thread holds (two live at once: 256 bf16, 128 registers)


@triton.jit
def grid_sync(counter_ptr, target):
    """Arrive at a grid-wide barrier (this program's stores ordered before), then wait until
    ``target`` arrivals have been counted."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    while tl.load(counter_ptr, volatile=True) < target:
        pass
    tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def ask_l2(w_ptr, pid, G, N, K, BN: tl.constexpr, LP: tl.constexpr):
    """Ask L2 for the rows of ``w`` (``[N, K]``, 16-bit) this program multiplies next: blocks of
    ``BN`` rows, ``LP`` 128-byte lines a block (a power of two; the requests past a block's lines
    repeat its last)."""
    lines = BN * K // 64
    offs = tl.minimum(tl.arange(0, LP), lines - 1) * 64
    for rb in range(pid, tl.cdiv(N, BN), G):
        base = w_ptr + rb.to(tl.int64) * BN * K
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [base + offs],
                                  dtype=tl.int32, is_pure=False, pack=1)


def block_rows(n: int, programs: int, most: int = 64) -> int:
    """Rows a block of a projection's ``n``: the largest power of two (at most ``most``) that still
    gives every one of ``programs`` a block."""
    bn = 1
    while n // (bn * 2) >= programs and bn < most:
        bn *= 2
    return bn


def prefetch_lines(bn: int, k: int) -> int:
    """L2 requests for a block of ``bn`` rows of ``k`` 16-bit weights, rounded up to a power of two."""
    return triton.next_power_of_2(max(1, bn * k // 64))


@triton.jit
def _rstd(x_ptr, K, KP: tl.constexpr, eps):
    ks = tl.arange(0, KP)
    x = tl.load(x_ptr + ks, mask=ks < K, other=0.0, cache_modifier=".cg")
    return 1.0 / tl.sqrt(tl.sum(x * x, 0) / K + eps)


@triton.jit
def _rows(w_ptr, x_ptr, scale, rb, K, BN: tl.constexpr, BK: tl.constexpr):
    rows = rb * BN + tl.arange(0, BN)
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + ks, cache_modifier=".cg").to(tl.float32) * scale
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    return rows, acc


@triton.jit
def _chain_kernel(x_ptr, qkv_ptr, h_ptr, act_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, counter_ptr,
                  H: tl.constexpr, HP: tl.constexpr, QKV: tl.constexpr, Q: tl.constexpr, I: tl.constexpr,
                  LAYERS: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BN3: tl.constexpr,
                  BN4: tl.constexpr, LP1: tl.constexpr, LP2: tl.constexpr, LP3: tl.constexpr,
                  LP4: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, WORK: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    zero = (pid * 0).to(tl.int64)  # layer offsets in 64 bits (an 8B model's stacked weights pass 2^31)
    for layer in range(LAYERS):
        wqkv = wqkv_ptr + (zero + layer) * QKV * H
        wo = wo_ptr + (zero + layer) * H * Q
        wgu = wgu_ptr + (zero + layer) * 2 * I * H
        wd = wd_ptr + (zero + layer) * H * I
        if WORK:  # qkv = Wqkv rms(x)
            scale = _rstd(x_ptr, H, HP, 1e-6)
            for rb in range(pid, QKV // BN1, G):
                rows, acc = _rows(wqkv, x_ptr, scale, rb, H, BN1, BK)
                tl.store(qkv_ptr + rows, acc)
        if PREFETCH:
            ask_l2(wo, pid, G, H, Q, BN2, LP2)
        grid_sync(counter_ptr, (layer * 4 + 1) * G)
        if WORK:  # h = x + Wo qkv[:q]
            for rb in range(pid, H // BN2, G):
                rows, acc = _rows(wo, qkv_ptr, 1.0, rb, Q, BN2, BK)
                tl.store(h_ptr + rows, acc + tl.load(x_ptr + rows, cache_modifier=".cg"))
        if PREFETCH:
            ask_l2(wgu, pid, G, I, H, BN3, LP3)
            ask_l2(wgu + I * H, pid, G, I, H, BN3, LP3)
        grid_sync(counter_ptr, (layer * 4 + 2) * G)
        if WORK:  # act = silu(g) * u, [g | u] = Wgu rms(h)
            scale = _rstd(h_ptr, H, HP, 1e-6)
            for rb in range(pid, I // BN3, G):
                rows, g = _rows(wgu, h_ptr, scale, rb, H, BN3, BK)
                rows, u = _rows(wgu + I * H, h_ptr, scale, rb, H, BN3, BK)
                tl.store(act_ptr + rows, g / (1.0 + tl.exp(-g)) * u)
        if PREFETCH:
            ask_l2(wd, pid, G, H, I, BN4, LP4)
        grid_sync(counter_ptr, (layer * 4 + 3) * G)
        if WORK:  # x = h + Wd act
            for rb in range(pid, H // BN4, G):
                rows, acc = _rows(wd, act_ptr, 1.0, rb, I, BN4, BK)
                tl.store(x_ptr + rows, acc + tl.load(h_ptr + rows, cache_modifier=".cg"))
        if PREFETCH:
            if layer + 1 < LAYERS:
                ask_l2(wqkv + QKV * H, pid, G, QKV, H, BN1, LP1)
        grid_sync(counter_ptr, (layer * 4 + 4) * G)


@triton.jit
def arrive(counter_ptr):
    """Arrive at a grid-wide barrier, this program's stores ordered before."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def wait_for(counter_ptr, target):
    """Wait until ``target`` arrivals have been counted (what they stored is visible after)."""
    while tl.load(counter_ptr, volatile=True) < target:
        pass
    tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _tile(w_ptr, pid, N, K, BN: tl.constexpr, KP: tl.constexpr):
    """This program's rows of ``w`` (``[N, K]``), whole: ``[BN, KP]``, zero past the edges."""
    rows = pid * BN + tl.arange(0, BN)
    ks = tl.arange(0, KP)
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=(rows < N)[:, None] & (ks < K)[None, :],
                   other=0.0)


@triton.jit
def _apply(tile, x_ptr, scale, pid, K, BN: tl.constexpr, KP: tl.constexpr):
    """The rows of ``tile`` times the activations ``x * scale`` (read past L1): (row ids, sums)."""
    ks = tl.arange(0, KP)
    x = tl.load(x_ptr + ks, mask=ks < K, other=0.0, cache_modifier=".cg").to(tl.float32) * scale
    return pid * BN + tl.arange(0, BN), tl.sum(tile.to(tl.float32) * x[None, :], 1)


@triton.jit
def _ahead(w_ptr, pid, G, N, K, BN: tl.constexpr, LP: tl.constexpr, AHEAD: tl.constexpr):
    """With ``AHEAD``: ask L2 for this program's block of ``w`` (the step after next's)."""
    if AHEAD:
        ask_l2(w_ptr, pid, G, N, K, BN, LP)


@triton.jit
def _held_kernel(x_ptr, qkv_ptr, h_ptr, act_ptr, wqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, counter_ptr,
                 H: tl.constexpr, HP: tl.constexpr, QKV: tl.constexpr, Q: tl.constexpr, QP: tl.constexpr,
                 I: tl.constexpr, IP: tl.constexpr, LAYERS: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr,
                 BN3: tl.constexpr, BN4: tl.constexpr, LP1: tl.constexpr, LP2: tl.constexpr,
                 LP3: tl.constexpr, LP4: tl.constexpr, AHEAD: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    zero = (pid * 0).to(tl.int64)
    w1 = _tile(wqkv_ptr, pid, QKV, H, BN1, HP)
    _ahead(wo_ptr, pid, G, H, Q, BN2, LP2, AHEAD)
    for layer in range(LAYERS):
        at = zero + layer
        nxt = tl.minimum(at + 1, LAYERS - 1)
        scale = _rstd(x_ptr, H, HP, 1e-6)  # qkv = Wqkv rms(x)
        rows, acc = _apply(w1, x_ptr, scale, pid, H, BN1, HP)
        tl.store(qkv_ptr + rows, acc, mask=rows < QKV)
        arrive(counter_ptr)
        w2 = _tile(wo_ptr + at * H * Q, pid, H, Q, BN2, QP)  # streams in while this program waits
        # (AHEAD: the block after it from HBM into L2 meanwhile, so that it streams from L2 next)
        _ahead(wgu_ptr + at * 2 * I * H, pid, G, I, H, BN3, LP3, AHEAD)
        _ahead(wgu_ptr + (at * 2 + 1) * I * H, pid, G, I, H, BN3, LP3, AHEAD)
        wait_for(counter_ptr, (layer * 4 + 1) * G)
        rows, acc = _apply(w2, qkv_ptr, 1.0, pid, Q, BN2, QP)  # h = x + Wo qkv[:q]
        ok = rows < H
        tl.store(h_ptr + rows, acc + tl.load(x_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg"), mask=ok)
        arrive(counter_ptr)
        wg = _tile(wgu_ptr + at * 2 * I * H, pid, I, H, BN3, HP)
        wu = _tile(wgu_ptr + (at * 2 + 1) * I * H, pid, I, H, BN3, HP)
        _ahead(wd_ptr + at * H * I, pid, G, H, I, BN4, LP4, AHEAD)
        wait_for(counter_ptr, (layer * 4 + 2) * G)
        scale = _rstd(h_ptr, H, HP, 1e-6)  # act = silu(g) * u, [g | u] = Wgu rms(h)
        rows, g = _apply(wg, h_ptr, scale, pid, H, BN3, HP)
        rows, u = _apply(wu, h_ptr, scale, pid, H, BN3, HP)
        tl.store(act_ptr + rows, g / (1.0 + tl.exp(-g)) * u, mask=rows < I)
        arrive(counter_ptr)
        w4 = _tile(wd_ptr + at * H * I, pid, H, I, BN4, IP)
        _ahead(wqkv_ptr + nxt * QKV * H, pid, G, QKV, H, BN1, LP1, AHEAD)
        wait_for(counter_ptr, (layer * 4 + 3) * G)
        rows, acc = _apply(w4, act_ptr, 1.0, pid, I, BN4, IP)  # x = h + Wd act
        ok = rows < H
        tl.store(x_ptr + rows, acc + tl.load(h_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg"), mask=ok)
        arrive(counter_ptr)
        w1 = _tile(wqkv_ptr + nxt * QKV * H, pid, QKV, H, BN1, HP)
        _ahead(wo_ptr + nxt * H * Q, pid, G, H, Q, BN2, LP2, AHEAD)
        wait_for(counter_ptr, (layer * 4 + 4) * G)


def resident(kernel: object, args: tuple, meta: dict, programs: int, device: torch.device) -> str | None:
    """Why ``programs`` programs of ``kernel`` could not all be resident at once on ``device`` (its
    programs wait for each other at barriers, so a launch that cannot hold them all hangs), or None:
    the compiled kernel's registers (a warp's in 256s), threads and shared memory against an SM's."""
    compiled = kernel.warmup(*args, grid=(programs,), **meta)
    compiled._init_handles()
    props = torch.cuda.get_device_properties(device)
    warps = compiled.metadata.num_warps
    regs = -(-compiled.n_regs * 32 // 256) * 256 * warps
    per_sm = min(getattr(props, "regs_per_multiprocessor", 65536) // max(regs, 1),
                 getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps),
                 getattr(props, "shared_memory_per_multiprocessor", 233472) // max(compiled.metadata.shared, 1))
    if programs > per_sm * props.multi_processor_count:
        return f"{programs} programs do not fit at once ({compiled.n_regs} registers a thread, {warps} warps)"
    return None


def held_rows(n: int, programs: int) -> int:
    """Rows a program of the held layout owns: enough for ``programs`` to cover ``n``, a power of two."""
    return triton.next_power_of_2(triton.cdiv(n, programs))


def chain_reference(x, wqkv, wo, wgu, wd, q):
    x = x.double()
    for layer in range(wqkv.shape[0]):
        rms = lambda v: v * torch.rsqrt(v.pow(2).mean() + 1e-6)  # noqa: E731
        qkv = wqkv[layer].double() @ rms(x)
        h = x + wo[layer].double() @ qkv[:q]
        g, u = (wgu[layer].double() @ rms(h)).chunk(2)
        x = h + wd[layer].double() @ (torch.nn.functional.silu(g) * u)
    return x


def graph_time_us(fn, replays: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / replays)
    return best


def run_shape(shape: str, args: argparse.Namespace, bandwidth: float) -> dict:
    from specloop.kernels.gemv import skinny_gated_linear, skinny_linear, skinny_norm_linear

    H, Q, KV, I, L = SHAPES[shape]
    L = min(L, args.layers or L)
    QKV = Q + 2 * KV
    dev = torch.device(args.device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    w = lambda *s: (torch.randn(*s, device=dev, dtype=dt, generator=gen) / s[-1] ** 0.5).contiguous()  # noqa: E731
    wqkv, wo, wgu, wd = w(L, QKV, H), w(L, H, Q), w(L, 2 * I, H), w(L, H, I)
    weight_bytes = sum(t.numel() * t.element_size() for t in (wqkv, wo, wgu, wd))
    x0 = torch.randn(H, device=dev, generator=gen)
    # On a CPU (the interpreter) one program: it runs programs one after another, and a barrier
    # would wait forever for the second.
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    timed = graph_time_us if dev.type == "cuda" else lambda fn: (fn(), float("nan"))[1]
    row = {"shape": shape, "layers": L, "weight_bytes": weight_bytes,
           "bandwidth_us": weight_bytes / bandwidth * 1e6}
    # The engine's kernels, one launch a projection, norm and activation fused.
    xb = x0.to(dt)[None]
    nw = torch.ones(H, device=dev, dtype=dt)

    def launches():
        x, res = xb, None
        for layer in range(L):
            qkv, res = skinny_norm_linear(x, res, nw, 1e-6, wqkv[layer])
            x = skinny_linear(qkv[:, :Q].contiguous() if args.copy_q else qkv[:, :Q], wo[layer])
            gu, res = skinny_norm_linear(x, res, nw, 1e-6, wgu[layer])
            x = skinny_gated_linear(gu, wd[layer])
        return x

    if dev.type == "cuda":
        try:
            row["launches_us"] = graph_time_us(launches)
        except Exception as e:  # e.g. a strided slice the kernel refuses
            row["launches_error"] = f"{type(e).__name__}: {e}"
    ref = chain_reference(x0, wqkv, wo, wgu, wd, Q)
    for programs in args.programs if dev.type == "cuda" else [1]:
        G = programs * sms
        bns = (block_rows(QKV, G), block_rows(H, G), block_rows(I, G), block_rows(H, G))
        x, qkv, h, act = (torch.empty(n, device=dev) for n in (H, QKV, H, I))
        counter = torch.zeros(1, device=dev, dtype=torch.int32)
        # (The interpreter runs no inline assembly: no L2 requests on a CPU.)
        for prefetch, work in ((False, False), (False, True), (True, True))[:3 if dev.type == "cuda" else 2]:
            chain_args = (x, qkv, h, act, wqkv, wo, wgu, wd, counter)
            chain_meta = dict(H=H, HP=triton.next_power_of_2(H), QKV=QKV, Q=Q, I=I, LAYERS=L, BN1=bns[0], BN2=bns[1],
                              BN3=bns[2], BN4=bns[3], LP1=prefetch_lines(bns[0], H), LP2=prefetch_lines(bns[1], Q),
                              LP3=prefetch_lines(bns[2], H), LP4=prefetch_lines(bns[3], I), BK=args.block_k,
                              PREFETCH=prefetch, WORK=work, num_warps=args.warps, num_stages=args.stages)

            def step():
                counter.zero_()
                x.copy_(x0)
                _chain_kernel[(G,)](*chain_args, **chain_meta)
            name = f"{programs}x{sms} programs, " + ("barriers only" if not work else
                                                     "prefetch" if prefetch else "no prefetch")
            why = resident(_chain_kernel, chain_args, chain_meta, G, dev) if dev.type == "cuda" else None
            if why is not None:
                row[name] = f"skipped: {why}"
                continue
            try:
                us = timed(step)
            except Exception as e:
                row[name] = f"{type(e).__name__}: {e}"
                continue
            arrivals = int(counter.item())
            entry = {"us": us, "arrivals_ok": arrivals == 4 * L * G, "block_rows": bns}
            if work:
                entry["rel_err"] = float((x.double() - ref).norm() / ref.norm())
                entry["of_bandwidth"] = row["bandwidth_us"] / us
            row[name] = entry
        # The held layout: a program's whole tile of each projection in registers, requested at
        # the barrier before it.
        warps = max(4, args.held_warps // programs)
        bns = (held_rows(QKV, G), held_rows(H, G), held_rows(I, G), held_rows(H, G))
        pads = [triton.next_power_of_2(k) for k in (H, Q, I)]
        live = max(bns[0] * pads[0] + bns[1] * pads[1], bns[1] * pads[1] + 2 * bns[2] * pads[0],
                   2 * bns[2] * pads[0] + bns[3] * pads[2], bns[3] * pads[2] + bns[0] * pads[0])
        for ahead in (False, True)[:2 if dev.type == "cuda" else 1]:
            name = f"{programs}x{sms} programs, held tiles, {warps} warps" + (", L2 a step ahead" if ahead else "")
            if live > 2 * HELD_ELEMENTS * 32 * warps:
                row[name] = f"skipped: {live} tile elements live, past {2 * HELD_ELEMENTS} a thread"
                continue
            held_args = (x, qkv, h, act, wqkv, wo, wgu, wd, counter)
            held_meta = dict(H=H, HP=pads[0], QKV=QKV, Q=Q, QP=pads[1], I=I, IP=pads[2], LAYERS=L, BN1=bns[0],
                             BN2=bns[1], BN3=bns[2], BN4=bns[3], LP1=prefetch_lines(bns[0], H), LP2=prefetch_lines(bns[1], Q),
                             LP3=prefetch_lines(bns[2], H), LP4=prefetch_lines(bns[3], I), AHEAD=ahead,
                             num_warps=warps, num_stages=1)
            why = resident(_held_kernel, held_args, held_meta, G, dev) if dev.type == "cuda" else None
            if why is not None:
                row[name] = f"skipped: {why}"
                continue

            def held():
                counter.zero_()
                x.copy_(x0)
                _held_kernel[(G,)](*held_args, **held_meta)
            try:
                us = timed(held)
            except Exception as e:
                row[name] = f"{type(e).__name__}: {e}"
                continue
            row[name] = {"us": us, "arrivals_ok": int(counter.item()) == 4 * L * G, "block_rows": bns,
                         "rel_err": float((x.double() - ref).norm() / ref.norm()),
                         "of_bandwidth": row["bandwidth_us"] / us}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench")
    parser.add_argument("--shapes", default="qwen3-0.6b,llama3-8b")
    parser.add_argument("--layers", type=int, default=0, help="at most this many layers (0: the shape's)")
    parser.add_argument("--programs", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2],
                        help="programs an SM, a list")
    parser.add_argument("--block-k", type=int, default=512)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--copy-q", action="store_true", help="the engine's o projection reads a contiguous copy")
    parser.add_argument("--held-warps", type=int, default=16, help="warps a program of the held layout at one "
                        "program an SM (halved at two)")
    parser.add_argument("--device", default="cuda", help="cpu: check the kernels at the tiny shape under "
                        "TRITON_INTERPRET=1 (no timings)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        args.shapes, args.block_k = "tiny", 32
    env = environment(device)
    bandwidth = measure_bandwidth(device) if device.type == "cuda" else float("nan")
    rows = []
    for shape in args.shapes.split(","):
        rows.append(run_shape(shape, args, bandwidth))
        report(f"persistent probe: {shape}", rows[-1])
        save(args.out, "persistent_probe", {"benchmark": "persistent_probe", "env": env, "config": vars(args),
                                            "bandwidth": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()

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
(docs/benchmarks.md, session of 2026-12-05).
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
}


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
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    w = lambda *s: (torch.randn(*s, device=dev, dtype=dt, generator=gen) / s[-1] ** 0.5).contiguous()  # noqa: E731
    wqkv, wo, wgu, wd = w(L, QKV, H), w(L, H, Q), w(L, 2 * I, H), w(L, H, I)
    weight_bytes = sum(t.numel() * t.element_size() for t in (wqkv, wo, wgu, wd))
    x0 = torch.randn(H, device=dev, generator=gen)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
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

    try:
        row["launches_us"] = graph_time_us(launches)
    except Exception as e:  # e.g. a strided slice the kernel refuses
        row["launches_error"] = f"{type(e).__name__}: {e}"
    ref = chain_reference(x0, wqkv, wo, wgu, wd, Q)
    for programs in args.programs:
        G = programs * sms
        bns = (block_rows(QKV, G), block_rows(H, G), block_rows(I, G), block_rows(H, G))
        x, qkv, h, act = (torch.empty(n, device=dev) for n in (H, QKV, H, I))
        counter = torch.zeros(1, device=dev, dtype=torch.int32)
        for prefetch, work in ((False, False), (False, True), (True, True)):
            def step():
                counter.zero_()
                x.copy_(x0)
                _chain_kernel[(G,)](x, qkv, h, act, wqkv, wo, wgu, wd, counter, H=H, HP=triton.next_power_of_2(H),
                                    QKV=QKV, Q=Q, I=I, LAYERS=L, BN1=bns[0], BN2=bns[1], BN3=bns[2], BN4=bns[3],
                                    LP1=prefetch_lines(bns[0], H), LP2=prefetch_lines(bns[1], Q), LP3=prefetch_lines(bns[2], H),
                                    LP4=prefetch_lines(bns[3], I),
                                    BK=args.block_k, PREFETCH=prefetch, WORK=work, num_warps=args.warps,
                                    num_stages=args.stages)
            name = f"{programs}x{sms} programs, " + ("barriers only" if not work else
                                                     "prefetch" if prefetch else "no prefetch")
            try:
                us = graph_time_us(step)
            except Exception as e:
                row[name] = f"{type(e).__name__}: {e}"
                continue
            arrivals = int(counter.item())
            entry = {"us": us, "arrivals_ok": arrivals == 4 * L * G, "block_rows": bns}
            if work:
                entry["rel_err"] = float((x.double() - ref).norm() / ref.norm())
                entry["of_bandwidth"] = row["bandwidth_us"] / us
            row[name] = entry
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
    args = parser.parse_args()
    device = torch.device("cuda")
    env = environment(device)
    bandwidth = measure_bandwidth(device)
    rows = []
    for shape in args.shapes.split(","):
        rows.append(run_shape(shape, args, bandwidth))
        report(f"persistent probe: {shape}", rows[-1])
        save(args.out, "persistent_probe", {"benchmark": "persistent_probe", "env": env, "config": vars(args),
                                            "bandwidth": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()

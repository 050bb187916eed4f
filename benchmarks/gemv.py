"""The few-rows linear kernel (``kernels/gemv.py``) against cuBLAS (``F.linear``) at the linear
layers of a decode step: qwen3-0.6b's and llama3-8b's fused q/k/v, output, fused gate/up, down and
LM head projections, bf16, 1 and 4 rows.

Each timing is a CUDA graph of ``--calls`` back-to-back products replayed ``--replays`` times, as a
decode step's graph runs them, over enough copies of the weight (at least ``--rotate-mb`` MB) that
no call finds its weights in the 50 MB L2 cache left by the one before. Reported: microseconds a
call, the weight bytes a call reads over that time, and, for the few-rows kernel, its default tile
and the fastest of the tiles swept (``BLOCK_N`` x ``BLOCK_K`` x warps x stages).

``--moe-shapes`` (default DeepSeek-V2-Lite's) also times a mixture-of-experts layer at one token,
the grouped GEMMs (``kernels/fused_moe.py``, with their sort) against the two few-tokens kernels
(``kernels/skinny_moe.py``): each call picks ``top_k`` experts at random (from a fixed list of
draws, the shared experts always), and the bytes are the picked experts' weights.

    python benchmarks/gemv.py --out out/gemv            # on the H200 (the suite's ``gemv`` stage)
    python benchmarks/gemv.py --smoke                   # a check of the script: one shape, interpreter-sized
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--smoke" in sys.argv:  # the kernel on the CPU: Triton's interpreter, chosen before the kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")
from common import SHAPES  # noqa: E402

from specloop.kernels.fused_moe import fused_moe  # noqa: E402
from specloop.kernels.gemv import DEFAULT_TILE, choose_block_n, skinny_linear  # noqa: E402
from specloop.kernels.skinny_moe import skinny_moe  # noqa: E402


def layer_shapes(shape: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of each linear layer, fused as the model runs them."""
    s = SHAPES[shape]
    h, heads, kv, d, inter = (s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"],
                              s["intermediate_size"])
    return [("qkv", (heads + 2 * kv) * d, h), ("o", h, heads * d), ("gate_up", 2 * inter, h), ("down", h, inter),
            ("lm_head", s["vocab_size"], h)]


def time_call(fn: Callable[[int], Any], copies: int, calls: int, replays: int) -> float:
    """Microseconds a call, ``fn(i)`` using weight copy ``i % copies``, inside one CUDA graph."""
    for i in range(copies):  # compile, and let cuBLAS pick
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def time_moe(shape: str, calls: int, replays: int) -> dict[str, Any]:
    """One token through a MoE layer of ``shape``: microseconds a call, grouped and few-tokens."""
    s = SHAPES[shape]
    h, inter, routed, shared = s["hidden_size"], s["moe_intermediate_size"], s["n_routed_experts"], s["n_shared_experts"]
    top_k, dev, dtype = s["num_experts_per_tok"], torch.device("cuda"), torch.bfloat16
    w13 = torch.randn(routed + shared, 2 * inter, h, dtype=dtype, device=dev) * 0.02
    w2 = torch.randn(routed + shared, h, inter, dtype=dtype, device=dev) * 0.02
    x = torch.randn(1, h, dtype=dtype, device=dev)
    gen = torch.Generator().manual_seed(0)
    draws = [torch.cat([torch.randperm(routed, generator=gen)[:top_k], torch.arange(routed, routed + shared)])
             .to(torch.int32).view(1, -1).to(dev) for _ in range(64)]
    weights = torch.cat([torch.rand(1, top_k), torch.ones(1, shared)], dim=1).to(dev)
    err = ((skinny_moe(x, w13, w2, weights, draws[0]).float() - fused_moe(x, w13, w2, weights, draws[0]).float()).norm()
           / fused_moe(x, w13, w2, weights, draws[0]).float().norm()).item()
    grouped = time_call(lambda i: fused_moe(x, w13, w2, weights, draws[i]), len(draws), calls, replays)
    few = time_call(lambda i: skinny_moe(x, w13, w2, weights, draws[i]), len(draws), calls, replays)
    size = (top_k + shared) * 3 * inter * h * 2
    print(f"| {shape} | MoE, 1 token, {top_k} + {shared} experts | {size / 1e6:.0f} MB | grouped {grouped:.1f} us "
          f"({size / grouped / 1e3:.0f} GB/s) | few-tokens {few:.1f} us ({size / few / 1e3:.0f} GB/s) | "
          f"{grouped / few:.2f}x | rel. difference {err:.1e} |", flush=True)
    return dict(shape=shape, layer="moe", bytes=size, grouped_us=grouped, skinny_us=few, rel_diff=err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/gemv")
    parser.add_argument("--shapes", default="qwen3-0.6b,llama3-8b")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--rotate-mb", type=int, default=256)
    parser.add_argument("--sweep", default="4,16:256,512:2,4:3",
                        help="BLOCK_N list : BLOCK_K list : warps list : stages list")
    parser.add_argument("--moe-shapes", default="deepseek-v2-lite", help="MoE layers at one token ('' for none)")
    parser.add_argument("--smoke", action="store_true", help="check the script on the CPU (no timing)")
    args = parser.parse_args()
    if args.smoke:
        x = torch.randn(2, 256, dtype=torch.float32)
        w = torch.randn(64, 256, dtype=torch.float32)
        err = (skinny_linear(x, w) - F.linear(x, w)).abs().max().item()
        print(f"smoke: {len(layer_shapes('qwen3-0.6b'))} layers of qwen3-0.6b, max error {err:.2e}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("gemv.py times CUDA graphs: run it on a GPU (or --smoke)")
    block_ns, ks, warps, stages = ([int(v) for v in part.split(",")] for part in args.sweep.split(":"))
    sweep = list(itertools.product(block_ns, ks, warps, stages))
    os.makedirs(args.out, exist_ok=True)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    results = []
    print("| shape | layer | N x K | rows | cuBLAS us (GB/s) | kernel, default us (GB/s) | kernel, best us (GB/s) "
          "| best tile | best / cuBLAS |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        for name, n, k in layer_shapes(shape):
            size = n * k * 2
            copies = max(1, -(-args.rotate_mb * 2 ** 20 // size))
            weights = [torch.randn(n, k, dtype=dtype, device=dev) * 0.02 for _ in range(copies)]
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, dtype=dtype, device=dev)
                want = F.linear(x.float(), weights[0].float())
                got = skinny_linear(x, weights[0])
                err = ((got.float() - want).norm() / want.norm()).item()
                cublas = time_call(lambda i: F.linear(x, weights[i]), copies, args.calls, args.replays)
                default = time_call(lambda i: skinny_linear(x, weights[i]), copies, args.calls, args.replays)
                tiles = {}
                for config in sweep:
                    try:
                        tiles[config] = time_call(
                            lambda i, c=config: skinny_linear(x, weights[i], tile=c[1:], block_n=c[0]), copies,
                            args.calls, args.replays)
                    except Exception as e:  # a tile that does not fit (registers, shared memory)
                        tiles[config] = float("inf")
                        print(f"  tile {config}: {type(e).__name__}", file=sys.stderr)
                best = min(tiles, key=tiles.get)
                row = dict(shape=shape, layer=name, n=n, k=k, rows=m, bytes=size, rel_err=err, cublas_us=cublas,
                           default_us=default, default_config=[choose_block_n(n, sms), *DEFAULT_TILE],
                           best_us=tiles[best],
                           best_config=list(best), tiles={str(c): t for c, t in tiles.items()})
                results.append(row)
                gbs = lambda us: size / us / 1e3  # noqa: E731
                print(f"| {shape} | {name} | {n} x {k} | {m} | {cublas:.1f} ({gbs(cublas):.0f}) | {default:.1f} "
                      f"({gbs(default):.0f}) | {tiles[best]:.1f} ({gbs(tiles[best]):.0f}) | {best} | "
                      f"{cublas / tiles[best]:.2f}x |", flush=True)
            del weights
            torch.cuda.empty_cache()
    for shape in filter(None, args.moe_shapes.split(",")):
        results.append(time_moe(shape, args.calls, args.replays))
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "gemv.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

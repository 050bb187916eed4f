"""The few-rows linear kernel (``kernels/gemv.py``) against cuBLAS (``F.linear``) at the linear
layers of a decode step: qwen3-0.6b's and llama3-8b's fused q/k/v, output, fused gate/up, down and
LM head projections, bf16, 1 and 4 rows (``--rows``, up to 16: from three rows the kernel multiplies
on tensor cores; the one-row-at-a-time kernel is timed beside it up to four).

Each timing is a CUDA graph of ``--calls`` back-to-back products replayed ``--replays`` times, as a
decode step's graph runs them, over enough copies of the weight (at least ``--rotate-mb`` MB) that
no call finds its weights in the 50 MB L2 cache left by the one before. Reported: microseconds a
call, the weight bytes a call reads over that time, and, for the few-rows kernel, its default tile
and the fastest of the tiles swept (``BLOCK_N`` x ``BLOCK_K`` x warps x stages, and optionally
the splits of ``K``).

``--moe-shapes`` (default DeepSeek-V2-Lite's) also times a mixture-of-experts layer at one token,
the grouped GEMMs (``kernels/fused_moe.py``, with their sort) against the two few-tokens kernels
(``kernels/skinny_moe.py``): each call picks ``top_k`` experts at random (from a fixed list of
draws, the shared experts always), and the bytes are the picked experts' weights. ``--moe-sweep``
times the tiles of each of the two kernels (the other at its default), then the best pair (the
down kernel's tiles may spread a token's picks over several programs: a fifth list, ``groups``);
``--moe-tokens 1,2,4`` times steps of several tokens too (a verification of drafts at batch 1).
``--mla-shapes`` times one token of latent attention (DeepSeek's absorbed MLA, ``kernels/mla_attention.py``)
over contexts of ``--mla-contexts`` tokens at each split count of the keys; ``--attention-shapes``
times paged (GQA) attention at ``--attention-batches`` sequences over ``--attention-contexts``
mean contexts for each tile of ``--attention-sweep`` (keys a tile, warps, stages, splits).
``--pdl`` launches the kernels with programmatic dependent launch, as the GPU runner does on
Hopper: a call's weights are asked of L2 while the call before it still runs.

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
from specloop.kernels.gemv import (DEFAULT_TILE, DOT_BLOCK_N, DOT_ROWS, DOT_TILE, ROW_LOOP_ROWS,  # noqa: E402
                                   choose_block_n, skinny_linear)
from specloop.kernels import pdl  # noqa: E402
from specloop.kernels.mla_attention import mla_attention  # noqa: E402
from specloop.kernels.paged_attention import paged_attention  # noqa: E402
from specloop.kernels.splits import choose_num_splits  # noqa: E402
from specloop.kernels.skinny_moe import DOWN_TILE, GATE_UP_TILE, skinny_moe  # noqa: E402


def layer_shapes(shape: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of each linear layer, fused as the model runs them."""
    s = SHAPES[shape]
    h, heads, inter = s["hidden_size"], s["num_attention_heads"], s["intermediate_size"]
    if "kv_lora_rank" in s:  # DeepSeek (no q LoRA): q and the latent in one product; the dense layer's MLP
        q = heads * (s["qk_nope_head_dim"] + s["qk_rope_head_dim"])
        attention = [("qkv_a", q + s["kv_lora_rank"] + s["qk_rope_head_dim"], h), ("o", h, heads * s["v_head_dim"])]
    else:
        kv, d = s["num_key_value_heads"], s["head_dim"]
        attention = [("qkv", (heads + 2 * kv) * d, h), ("o", h, heads * d)]
    return attention + [("gate_up", 2 * inter, h), ("down", h, inter), ("lm_head", s["vocab_size"], h)]


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


def tiles_of(spec: str) -> list[tuple[int, ...]]:
    """``"4,8:256,512:4:3"`` -> every combination of the lists; ``""`` -> none."""
    if not spec:
        return []
    return list(itertools.product(*([int(v) for v in part.split(",")] for part in spec.split(":"))))


def time_moe(shape: str, calls: int, replays: int, sweep: dict[str, str] | None = None,
             tokens: int = 1) -> dict[str, Any]:
    """``tokens`` tokens (a decode step, or a verification of ``tokens - 1`` drafts at batch 1)
    through a MoE layer of ``shape``: microseconds a call, grouped and few-tokens (and, with
    ``sweep``, each kernel's tiles: ``{"gate_up": spec, "down": spec}``, see :func:`tiles_of`). The
    bytes are the experts the tokens pick, each once."""
    s = SHAPES[shape]
    h, inter, routed, shared = s["hidden_size"], s["moe_intermediate_size"], s["n_routed_experts"], s["n_shared_experts"]
    top_k, dev, dtype = s["num_experts_per_tok"], torch.device("cuda"), torch.bfloat16
    w13 = torch.randn(routed + shared, 2 * inter, h, dtype=dtype, device=dev) * 0.02
    w2 = torch.randn(routed + shared, h, inter, dtype=dtype, device=dev) * 0.02
    x = torch.randn(tokens, h, dtype=dtype, device=dev)
    gen = torch.Generator().manual_seed(0)
    draws = [torch.stack([torch.cat([torch.randperm(routed, generator=gen)[:top_k], torch.arange(routed, routed + shared)])
                          for _ in range(tokens)]).to(torch.int32).to(dev) for _ in range(64)]
    weights = torch.cat([torch.rand(tokens, top_k), torch.ones(tokens, shared)], dim=1).to(dev)
    err = ((skinny_moe(x, w13, w2, weights, draws[0]).float() - fused_moe(x, w13, w2, weights, draws[0]).float()).norm()
           / fused_moe(x, w13, w2, weights, draws[0]).float().norm()).item()
    grouped = time_call(lambda i: fused_moe(x, w13, w2, weights, draws[i]), len(draws), calls, replays)
    few = time_call(lambda i: skinny_moe(x, w13, w2, weights, draws[i]), len(draws), calls, replays)
    size = sum(len(set(d.flatten().tolist())) for d in draws) / len(draws) * 3 * inter * h * 2
    print(f"| {shape} | MoE, {tokens} token(s), {top_k} + {shared} experts each | {size / 1e6:.0f} MB | grouped {grouped:.1f} us "
          f"({size / grouped / 1e3:.0f} GB/s) | few-tokens {few:.1f} us ({size / few / 1e3:.0f} GB/s) | "
          f"{grouped / few:.2f}x | rel. difference {err:.1e} |", flush=True)
    row = dict(shape=shape, layer="moe", tokens=tokens, bytes=size, grouped_us=grouped, skinny_us=few, rel_diff=err)
    if sweep:
        best = {}
        for kernel, default in (("gate_up", GATE_UP_TILE), ("down", DOWN_TILE)):
            times = {}
            for tile in tiles_of(sweep[kernel]):
                tiles = {"gate_up_tile": GATE_UP_TILE, "down_tile": DOWN_TILE, f"{kernel}_tile": tile}
                try:
                    times[tile] = time_call(lambda i, t=tiles: skinny_moe(x, w13, w2, weights, draws[i], **t),
                                            len(draws), calls, replays)
                except Exception as e:  # a tile that does not fit (registers, shared memory)
                    times[tile] = float("inf")
                    print(f"  {kernel} tile {tile}: {type(e).__name__}", file=sys.stderr)
            best[kernel] = min(times, key=times.get)
            row[f"{kernel}_tiles"] = {str(t): v for t, v in times.items()}
            print(f"  {kernel}: default {default} {times.get(default, times.get((*default, 1), float('nan'))):.1f} us, best {best[kernel]} "
                  f"{times[best[kernel]]:.1f} us; " + ", ".join(f"{t}: {v:.1f}" for t, v in sorted(times.items())),
                  flush=True)
        both = time_call(lambda i: skinny_moe(x, w13, w2, weights, draws[i], gate_up_tile=best["gate_up"],
                                              down_tile=best["down"]), len(draws), calls, replays)
        row.update(best_tiles=[list(best["gate_up"]), list(best["down"])], best_us=both)
        print(f"| {shape} | MoE, best tiles {best['gate_up']} / {best['down']} | {both:.1f} us "
              f"({size / both / 1e3:.0f} GB/s) | default {few:.1f} us |", flush=True)
    return row


ROUTER_SWEEP = "1,2,4:1,2,4,8:256,512:2,4:2:512,2048"  # the router tiles --router-shapes sweeps by default


def time_router(shape: str, calls: int, replays: int, sweep: str) -> dict[str, Any]:
    """A MoE router of ``shape`` at one token with the norm before it (float32 weights, softmax
    routing as V2-Lite's): the router's few-rows product then the routing kernel, against the two
    in one launch (``kernels.moe_route.router_route``) at its default tile and at each of
    ``sweep`` (``"block_n:split:block_k:warps:stages:stats_block"`` lists, :func:`tiles_of`)."""
    from specloop.kernels.gemv import skinny_norm_linear
    from specloop.kernels.moe_route import ROUTER_TILE, moe_route, router_route

    s = SHAPES[shape]
    h, experts, top_k, shared = s["hidden_size"], s["n_routed_experts"], s["num_experts_per_tok"], s["n_shared_experts"]
    dev = torch.device("cuda")
    copies = 64  # distinct routers and inputs, as distinct layers would be
    ws = [torch.randn(experts, h, device=dev) * 0.02 for _ in range(copies)]
    xs = [torch.randn(1, h, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
    nw = torch.ones(h, dtype=torch.bfloat16, device=dev)
    opts = dict(softmax=True, renormalize=False)

    def two(i: int) -> Any:
        logits, _ = skinny_norm_linear(xs[i], xs[i - 1], nw, 1e-6, ws[i], split=1, out_dtype=torch.float32)
        return moe_route(logits, None, top_k, shared, **opts)

    def one(i: int, tile: tuple[int, ...] | None = None) -> Any:
        return router_route(xs[i], xs[i - 1], nw, 1e-6, ws[i], None, top_k, shared, tile=tile, **opts)

    same = all(torch.equal(two(i)[1].sort().values, one(i)[1].sort().values) for i in range(8))
    before, fused = time_call(two, copies, calls, replays), time_call(one, copies, calls, replays)
    tiles = {}
    for tile in tiles_of(sweep):
        try:
            tiles[tile] = time_call(lambda i, t=tile: one(i, t), copies, calls, replays)
        except Exception as e:  # a tile that does not fit
            tiles[tile] = float("inf")
            print(f"  router tile {tile}: {type(e).__name__}", file=sys.stderr)
    best = min(tiles, key=tiles.get) if tiles else ROUTER_TILE
    print(f"| {shape} | router + routing, {experts} experts x {h} | product then routing {before:.1f} us | one launch "
          f"{fused:.1f} us ({ROUTER_TILE}) | best {tiles.get(best, fused):.1f} us {best} | same picks: {same} |",
          flush=True)
    for tile, us in sorted(tiles.items(), key=lambda kv: kv[1])[:12]:
        print(f"  router tile {tile}: {us:.2f} us", flush=True)
    return dict(shape=shape, layer="router", two_kernels_us=before, router_route_us=fused, same_picks=same,
                best_tile=list(best), tiles={str(t): v for t, v in tiles.items()})


def one_sequence(context: int, page: int, dev: torch.device) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step of one sequence over ``context`` tokens in consecutive pages: (pages, query
    start locations, sequence lengths, block table)."""
    blocks = -(-context // page)
    return (blocks, torch.tensor([0, 1], dtype=torch.int32, device=dev),
            torch.tensor([context], dtype=torch.int32, device=dev),
            torch.arange(blocks, dtype=torch.int32, device=dev).view(1, -1))


def time_mla(shape: str, contexts: list[int], calls: int, replays: int) -> list[dict[str, Any]]:
    """One decode token of ``shape``'s latent attention over each context, at every split count."""
    s = SHAPES[shape]
    heads, rank, rope = s["num_attention_heads"], s["kv_lora_rank"], s["qk_rope_head_dim"]
    dev, dtype, page = torch.device("cuda"), torch.bfloat16, 16
    rows = []
    for context in contexts:
        blocks, qsl, lens, table = one_sequence(context, page, dev)
        cache = torch.randn(blocks, page, rank + rope, dtype=dtype, device=dev)
        q_nope = torch.randn(1, heads, rank, dtype=dtype, device=dev)
        q_rope = torch.randn(1, heads, rope, dtype=dtype, device=dev)
        times = {}
        for splits in (1, 2, 4, 8, 16, 32):
            if splits > blocks:
                break
            times[splits] = time_call(lambda i, n=splits: mla_attention(
                q_nope, q_rope, cache, qsl, lens, table, scale=0.1, max_query_len=1, num_splits=n), 1, calls, replays)
        best = min(times, key=times.get)
        print(f"| {shape} | MLA decode, {context} tokens | " + " | ".join(f"{n}: {t:.1f} us" for n, t in times.items())
              + f" | best {best} |", flush=True)
        rows.append(dict(shape=shape, layer="mla", context=context, splits_us={str(n): t for n, t in times.items()},
                         best_splits=best))
    return rows


GRAPH_MAX_LEN = 32768  # the longest context a decode graph is captured for, in time_attention's report


def decode_batch(num_seqs: int, context: int, page: int, num_blocks: int, gen: torch.Generator,
                 dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step of ``num_seqs`` sequences, one alone over exactly ``context`` tokens, several
    over lengths drawn from ``[context / 2, 3 context / 2]``, in pages scattered over
    ``num_blocks`` as a cache that has served a while holds them: (query start locations, sequence
    lengths, block table)."""
    lens = (torch.full((num_seqs,), context) if num_seqs == 1 else
            torch.randint(max(1, context // 2), context * 3 // 2 + 1, (num_seqs,), generator=gen))
    pages = -(-int(lens.max()) // page)
    table = torch.randperm(num_blocks, generator=gen)[:num_seqs * pages].view(num_seqs, pages)
    return (torch.arange(num_seqs + 1, dtype=torch.int32, device=dev), lens.to(torch.int32).to(dev),
            table.to(torch.int32).to(dev))


def time_attention(shape: str, contexts: list[int], calls: int, replays: int, batches: tuple[int, ...] = (1,),
                   sweep: str = "16,32,64:4:2:1,2,4,8,16,32", rotate_mb: int = 256) -> list[dict[str, Any]]:
    """One decode step of ``shape``'s paged attention (one layer) at each batch size and mean
    context, for every tile of ``sweep`` (keys a tile : warps : stages : splits of the keys),
    over enough copies of the cache (``rotate_mb``) that a
    call reads its keys from memory, as each layer of a step does. A split count is timed whatever
    the keys, as a CUDA graph runs it (its splits fixed when captured; the slices past the keys
    end at once). Reported beside the best: what the runner's graph would run (the tile its
    start-up timing keeps most often, 64 keys x 4 warps x 2 stages, at the split count of
    ``choose_num_splits`` for a graph of contexts up to ``GRAPH_MAX_LEN``) and the bytes of keys
    and values read."""
    s = SHAPES[shape]
    heads, kv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
    dev, dtype, page = torch.device("cuda"), torch.bfloat16, 16
    gen = torch.Generator().manual_seed(0)
    rows = []
    for num_seqs, context in itertools.product(batches, contexts):
        need = num_seqs * -(-context * 3 // 2 // page) + 1
        qsl, lens, table = decode_batch(num_seqs, context, page, need, gen, dev)
        bytes_read = int(lens.sum()) * kv * d * 2 * 2
        copies = max(1, -(-rotate_mb * 2 ** 20 // (need * page * kv * d * 2 * 2)))
        caches = [torch.randn(2, need, page, kv, d, dtype=dtype, device=dev) for _ in range(copies)]
        q = torch.randn(num_seqs, heads, d, dtype=dtype, device=dev)
        rule = choose_num_splits(num_seqs, kv, GRAPH_MAX_LEN)
        times = {}
        for block_n, warps, stages, splits in tiles_of(sweep) + [(64, 4, 2, rule)]:
            if (block_n, warps, stages, splits) in times:
                continue
            try:
                times[(block_n, warps, stages, splits)] = time_call(
                    lambda i, n=splits, c=(block_n, warps, stages): paged_attention(
                        q, caches[i][0], caches[i][1], qsl, lens, table, scale=0.1, max_query_len=1, num_splits=n,
                        decode_config=c), copies, calls, replays)
            except Exception as e:  # a tile the chip lacks registers or shared memory for
                print(f"  tile {(block_n, warps, stages, splits)}: {type(e).__name__}", file=sys.stderr)
        default = times[(64, 4, 2, rule)]
        best = min(times, key=times.get)
        gbs = lambda us: bytes_read / us / 1e3  # noqa: E731
        print(f"| {shape} | attention decode, batch {num_seqs}, {context} tokens | {bytes_read / 1e6:.1f} MB | "
              f"default (64, 4, 2) x {rule}: {default:.1f} us ({gbs(default):.0f} GB/s) | best {best}: "
              f"{times[best]:.1f} us ({gbs(times[best]):.0f} GB/s) | " + " ".join(
                  f"{'x'.join(map(str, c))}:{t:.1f}" for c, t in sorted(times.items(), key=lambda x: x[1])[:8]) + " |",
              flush=True)
        rows.append(dict(shape=shape, layer="attention", batch=num_seqs, context=context, bytes=bytes_read,
                         best=list(best), rule_splits=rule, default_us=default,
                         us={"x".join(map(str, c)): t for c, t in times.items()}))
        del caches
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/gemv")
    parser.add_argument("--shapes", default="qwen3-0.6b,llama3-8b")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--rotate-mb", type=int, default=256,
                        help="weight copies a graph cycles through, in MB at least (0: one copy, so every call "
                             "after the first finds its weights in L2: the kernel's time without DRAM's)")
    parser.add_argument("--sweep", default="4,16:256,512:2,4:3",
                        help="BLOCK_N list : BLOCK_K list : warps list : stages list [: split list (0: the "
                        "kernel's choice, the default)]; '' times the default tile only")
    parser.add_argument("--moe-shapes", default="deepseek-v2-lite", help="MoE layers at one token ('' for none)")
    parser.add_argument("--moe-sweep", default="",
                        help="tiles of the MoE kernels to time, 'GATE_UP_SPEC/DOWN_SPEC', each "
                        "'BLOCK_N list : BLOCK_K list : warps list : stages list', the down kernel's with an "
                        "optional ': groups list' (programs over a token's picks; 1 the default) ('' for none)")
    parser.add_argument("--moe-tokens", default="1", help="tokens a MoE call, a list (the sweep runs at the first)")
    parser.add_argument("--router-shapes", default="", help="MoE routers to time at one token ('' for none)")
    parser.add_argument("--router-sweep", default=None,
                        help="router_route tiles: block_n:split:block_k:warps:stages:stats_block lists (default "
                             f"{ROUTER_SWEEP}; '' for none)")
    parser.add_argument("--mla-shapes", default="", help="shapes whose latent attention to time ('' for none)")
    parser.add_argument("--mla-contexts", default="160,1024,4096")
    parser.add_argument("--attention-shapes", default="", help="shapes whose paged attention to time ('' for none)")
    parser.add_argument("--attention-contexts", default="160,1024", help="mean contexts (one sequence: exact)")
    parser.add_argument("--attention-batches", default="1", help="sequences a decode step, a list")
    parser.add_argument("--attention-sweep", default="16,32,64:4:2:1,2,4,8,16,32",
                        help="attention tiles: keys a tile : warps : stages : splits, each a list")
    parser.add_argument("--pdl", action="store_true", help="programmatic dependent launch (Hopper), as the runner")
    parser.add_argument("--skip-linear", action="store_true", help="only the MoE and MLA timings")
    parser.add_argument("--smoke", action="store_true", help="check the script on the CPU (no timing)")
    args = parser.parse_args()
    if args.router_sweep is not None and not args.router_shapes:
        parser.error("--router-sweep sweeps the routers of --router-shapes, and none is given")
    pdl.set_enabled(args.pdl)
    if args.smoke:
        x = torch.randn(2, 256, dtype=torch.float32)
        w = torch.randn(64, 256, dtype=torch.float32)
        err = (skinny_linear(x, w) - F.linear(x, w)).abs().max().item()
        print(f"smoke: {len(layer_shapes('qwen3-0.6b'))} layers of qwen3-0.6b, max error {err:.2e}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("gemv.py times CUDA graphs: run it on a GPU (or --smoke)")
    sweep = [c if len(c) == 5 else (*c, 0) for c in tiles_of(args.sweep)]
    os.makedirs(args.out, exist_ok=True)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    results = []
    print("| shape | layer | N x K | rows | cuBLAS us (GB/s) | kernel, default us (GB/s) | one row at a time us "
          "| kernel, best us (GB/s) | best tile | best / cuBLAS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in [] if args.skip_linear else args.shapes.split(","):
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
                # From DOT_ROWS rows the default is the tensor-core kernel; the one-row-at-a-time
                # kernel beside it, where it runs.
                row_loop = (time_call(lambda i: skinny_linear(x, weights[i], dot=False), copies, args.calls,
                                      args.replays) if DOT_ROWS <= m <= ROW_LOOP_ROWS else None)
                tiles = {}
                for config in sweep:
                    try:
                        tiles[config] = time_call(
                            lambda i, c=config: skinny_linear(x, weights[i], tile=c[1:4], block_n=c[0],
                                                              split=c[4] or None), copies, args.calls, args.replays)
                    except Exception as e:  # a tile that does not fit (registers, shared memory)
                        tiles[config] = float("inf")
                        print(f"  tile {config}: {type(e).__name__}", file=sys.stderr)
                default_config = [DOT_BLOCK_N, *DOT_TILE] if m >= DOT_ROWS else [choose_block_n(n, sms), *DEFAULT_TILE]
                if not tiles:  # no sweep (--sweep ""): the default is the best timed
                    tiles[(*default_config, 0)] = default
                best = min(tiles, key=tiles.get)
                row = dict(shape=shape, layer=name, n=n, k=k, rows=m, bytes=size, rel_err=err, cublas_us=cublas,
                           default_us=default, row_loop_us=row_loop, default_config=default_config,
                           best_us=tiles[best],
                           best_config=list(best), tiles={str(c): t for c, t in tiles.items()})
                results.append(row)
                gbs = lambda us: size / us / 1e3  # noqa: E731
                print(f"| {shape} | {name} | {n} x {k} | {m} | {cublas:.1f} ({gbs(cublas):.0f}) | {default:.1f} "
                      f"({gbs(default):.0f}) | {'' if row_loop is None else f'{row_loop:.1f}'} "
                      f"| {tiles[best]:.1f} ({gbs(tiles[best]):.0f}) | {best} | "
                      f"{cublas / tiles[best]:.2f}x |", flush=True)
            del weights
            torch.cuda.empty_cache()
    for shape in filter(None, args.moe_shapes.split(",")):
        sweep = dict(zip(("gate_up", "down"), args.moe_sweep.split("/"))) if args.moe_sweep else None
        for i, tokens in enumerate(int(t) for t in args.moe_tokens.split(",")):
            results.append(time_moe(shape, args.calls, args.replays, sweep if i == 0 else None, tokens))
        torch.cuda.empty_cache()
    for shape in filter(None, args.router_shapes.split(",")):
        results.append(time_router(shape, args.calls, args.replays,
                                   ROUTER_SWEEP if args.router_sweep is None else args.router_sweep))
    for shape in filter(None, args.mla_shapes.split(",")):
        results += time_mla(shape, [int(c) for c in args.mla_contexts.split(",")], args.calls, args.replays)
    for shape in filter(None, args.attention_shapes.split(",")):
        results += time_attention(shape, [int(c) for c in args.attention_contexts.split(",")], args.calls, args.replays,
                                  tuple(int(b) for b in args.attention_batches.split(",")), args.attention_sweep,
                                  args.rotate_mb)
    with open(os.path.join(args.out, "gemv.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

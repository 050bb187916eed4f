"""Past one GPU: tensor-parallel decode and prefill, and data-parallel serving.

``--runs`` lists ``SHAPE[:LAYERS]@TP`` (``llama3-70b:10@4``: the 70B per-layer shapes, 10 of its 80
layers, over 4 ranks). For each run, on random bf16 weights: engine start-up, batch-1 decode
(ms/token over ``--output-len`` greedy tokens, median of ``--repeat``), decode throughput at each
``--batch-sizes`` entry, and one ``--prefill-len``-token prefill (time to the first token); the
speed-up against the same shape's TP=1 run when there is one. Runs needing more devices than
there are are reported as skipped.

``--dp`` lists data-parallel sizes served by ``specloop serve --data-parallel-size N`` (one GPU per
replica) under one load: ``--dp-prompts`` streamed requests in groups of ``--group`` sharing a
``--shared-len``-token prefix; one request per group goes first, then all the others at once, so
the router's prefix affinity shows in the prefix-cache hit rate of the second wave (the hit rate
of one replica is the ceiling). Reports the second wave's throughput, TTFT/TPOT and hit rate per
size.

On a CPU, with tiny shapes, it checks that everything runs (gloo, one process per rank):

    python benchmarks/distributed.py --device cpu --runs tiny@1,tiny@2 --dp 1,2 --dp-shape tiny \\
        --output-len 16 --batch-sizes 4 --prefill-len 64 --dp-prompts 16 --input-len 96 --shared-len 64 --group 4
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import time
from typing import Any

import httpx
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, base_args, build_checkpoint, environment, report, save  # noqa: E402
from serving import free_port, run_rate, start_server, summarize  # noqa: E402


def parse_run(spec: str) -> tuple[str, int]:
    """``SHAPE[:LAYERS]@TP`` -> (a shape name registered in SHAPES, TP)."""
    shape, _, tp = spec.partition("@")
    base, _, layers = shape.partition(":")
    if layers:
        shape = f"{base}-{layers}l"
        SHAPES[shape] = {**SHAPES[base], "num_hidden_layers": int(layers)}
    return shape, int(tp or 1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_tp(shape: str, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    from specloop import LLM, SamplingParams
    from specloop.models.config import read_model_config

    device = torch.device(args.device)
    path = build_checkpoint(shape, args.ckpt_root, device)
    vocab = read_model_config(path).vocab_size
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    llm = LLM(path, skip_tokenizer_init=True, device=args.device, tensor_parallel_size=tp,
              max_model_len=max(args.prefill_len, args.prompt_len + args.output_len) + 16,
              max_num_seqs=max(args.batch_sizes + [1]), num_kv_blocks=args.num_kv_blocks,
              gpu_memory_utilization=None if args.num_kv_blocks else args.gpu_memory_utilization)
    result: dict[str, Any] = {"shape": shape, "tp": tp, "init_s": time.perf_counter() - t0, "layers":
                              SHAPES[shape]["num_hidden_layers"]}
    decode = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([rng.integers(0, vocab, args.prompt_len).tolist()], decode, use_tqdm=False)  # warm-up
    times = []
    for _ in range(args.repeat):
        prompt = [rng.integers(0, vocab, args.prompt_len).tolist()]
        sync(device)
        t = time.perf_counter()
        llm.generate(prompt, decode, use_tqdm=False)
        times.append(time.perf_counter() - t)
    result["batch1_ms_per_token"] = 1e3 * float(np.median(times)) / args.output_len
    for b in args.batch_sizes:
        prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(b)]
        sync(device)
        t = time.perf_counter()
        llm.generate(prompts, decode, use_tqdm=False)
        result[f"batch{b}_tok_s"] = b * args.output_len / (time.perf_counter() - t)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([rng.integers(0, vocab, args.prefill_len).tolist()], first, use_tqdm=False)  # warm-up
    sync(device)
    t = time.perf_counter()
    llm.generate([rng.integers(0, vocab, args.prefill_len).tolist()], first, use_tqdm=False)
    result[f"prefill{args.prefill_len}_ms"] = 1e3 * (time.perf_counter() - t)
    runner = llm.core.runner
    local = getattr(runner, "local", runner)
    result["graph_replays"] = getattr(local.parts.executor, "num_replays", 0)
    result["num_kv_blocks"] = llm.config.num_kv_blocks
    llm.core.shutdown()
    del llm, runner, local
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def shared_prefix_groups(n: int, length: int, shared: int, group: int, vocab: int, seed: int
                         ) -> list[list[list[int]]]:
    """``n`` prompts of ``length`` tokens in groups of ``group`` sharing their first ``shared`` tokens."""
    rng = random.Random(seed)
    groups = []
    for start in range(0, n, group):
        prefix = [rng.randrange(10, vocab) for _ in range(shared)]
        groups.append([prefix + [rng.randrange(10, vocab) for _ in range(length - shared)]
                       for _ in range(min(group, n - start))])
    return groups


def run_dp(dp: int, path: str, args: argparse.Namespace) -> dict[str, Any]:
    from specloop.models.config import read_model_config

    vocab = read_model_config(path).vocab_size
    engine_args = ["--data-parallel-size", str(dp), "--skip-tokenizer-init", "--device", args.device, "--max-model-len",
                   str(args.input_len + args.output_len + 16)]
    if args.num_kv_blocks:
        engine_args += ["--num-kv-blocks", str(args.num_kv_blocks)]
    else:
        engine_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    port = free_port()
    t0 = time.perf_counter()
    proc = start_server(path, port, engine_args)
    url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {"dp": dp, "init_s": time.perf_counter() - t0}
    try:
        groups = shared_prefix_groups(args.dp_prompts, args.input_len, args.shared_len, args.group, vocab, seed=2)
        # One request per group first (the shared prefix becomes cached somewhere), then the rest
        # at once: prefix affinity sends each to the replica that cached its group's prefix.
        first = [g[0] for g in groups]
        rest = [p for g in groups for p in g[1:]]
        random.Random(3).shuffle(rest)
        asyncio.run(run_rate(url, "bench", first, args.output_len, float("inf"), args.dp_prompts, 1))
        before = _prefix_counters(url)
        results, duration = asyncio.run(run_rate(url, "bench", rest, args.output_len, float("inf"),
                                                 args.dp_prompts, 2))
        after = _prefix_counters(url)
        result.update(summarize(results, duration, args.input_len))
        queries = after[0] - before[0]
        result["prefix_cache_hit_rate"] = (after[1] - before[1]) / queries if queries else 0.0
    finally:
        proc.terminate()
        proc.wait(60)
    return result


def _prefix_counters(url: str) -> tuple[float, float]:
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("specloop:prefix_cache_"):
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name] = value
    return values.get("specloop:prefix_cache_queries_total", 0.0), values.get("specloop:prefix_cache_hits_total", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base_args(parser)
    parser.add_argument("--runs", default="llama3-8b@1,llama3-8b@2,llama3-8b@4,llama3-70b:10@4")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",") if x], default=[16, 64])
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--dp", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 2])
    parser.add_argument("--dp-shape", default="llama3-8b")
    parser.add_argument("--dp-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--shared-len", type=int, default=768)
    parser.add_argument("--group", type=int, default=8)
    args = parser.parse_args()
    device = torch.device(args.device)
    env = environment(device)
    report("distributed: configuration", {**env, **vars(args)})
    devices = torch.cuda.device_count() if device.type == "cuda" else os.cpu_count() or 1
    results: dict[str, Any] = {"benchmark": "distributed", "env": env, "config": vars(args), "tp": [], "dp": []}
    for spec in filter(None, args.runs.split(",")):
        shape, tp = parse_run(spec)
        if device.type == "cuda" and tp > devices:
            results["tp"].append({"shape": shape, "tp": tp, "skipped": f"needs {tp} GPUs, {devices} present"})
            report(f"{shape} TP={tp}", results["tp"][-1])
            continue
        row = run_tp(shape, tp, args)
        base = next((r for r in results["tp"] if r["shape"] == shape and r["tp"] == 1 and "skipped" not in r), None)
        if base is not None:
            row["batch1_speedup_vs_tp1"] = base["batch1_ms_per_token"] / row["batch1_ms_per_token"]
            row["prefill_speedup_vs_tp1"] = base[f"prefill{args.prefill_len}_ms"] / row[f"prefill{args.prefill_len}_ms"]
        results["tp"].append(row)
        report(f"{shape} TP={tp}", row)
        save(args.out, "distributed", results)
    if args.dp:
        path = build_checkpoint(args.dp_shape, args.ckpt_root, device)
        for dp in args.dp:
            if device.type == "cuda" and dp > devices:
                results["dp"].append({"dp": dp, "skipped": f"needs {dp} GPUs, {devices} present"})
            else:
                results["dp"].append(run_dp(dp, path, args))
            report(f"{args.dp_shape} DP={dp} serving", results["dp"][-1])
            save(args.out, "distributed", results)
    print(f"\nwrote {save(args.out, 'distributed', results)}")


if __name__ == "__main__":
    main()

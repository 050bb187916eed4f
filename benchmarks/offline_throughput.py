"""Offline throughput on the nano-vllm protocol, against Hugging Face transformers
in the same run and against the workload's own roofline.

256 requests; input and output lengths uniform in [100, 1024] (fixed seed); random token ids;
``ignore_eos``; temperature 0.6. Throughput = output tokens / wall time of ``LLM.generate``
(prefill included, engine start-up and a short warm-up excluded).

Roofline (computed here from the workload, at the bandwidth and matmul rate measured in this run):
decode is bound by bytes (each step reads the weights once, shared by the batch, plus every
running request's KV; with every request admitted at once there are ``max(output_len)`` steps; a
mixture of experts reads the experts the step's tokens picked),
prefill by FLOPs (matmuls + causal attention). The plot shows decode throughput per step against
the number of requests decoding, from this run's steps.

    python benchmarks/offline_throughput.py --out out/bench [--peer-time-limit 60] [--no-peer]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

from specloop.kernel.hookspecs import hookimpl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (ModelCost, base_args, build_checkpoint, environment, measure_bandwidth,  # noqa: E402
                    measure_matmul, plot, report, save)


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    ins = rng.integers(lo, hi + 1, n)
    outs = rng.integers(lo, hi + 1, n)
    return [(rng.integers(0, vocab, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def roofline(cost: ModelCost, work: list[tuple[list[int], int]], bandwidth: float, flops: float) -> dict[str, float]:
    ins = np.array([len(p) for p, _ in work], dtype=np.float64)
    outs = np.array([o for _, o in work], dtype=np.float64)
    # Decode: token t of a request reads the KV of its prompt and its first t outputs.
    kv_bytes = float(np.sum(outs * ins + outs * (outs - 1) / 2)) * cost.kv_bytes_per_token
    # Every request is admitted at once: decode step t runs the requests with more than t outputs.
    running = np.searchsorted(np.sort(outs), np.arange(int(outs.max())), side="right")
    weight_bytes = float(sum(cost.weight_bytes_at(int(len(outs) - r)) for r in running))
    prefill_flops = float(np.sum(2 * cost.matmul_params * ins + cost.attn_flops_per_pair * ins * (ins + 1) / 2))
    decode_flops = float(np.sum(outs)) * 2 * (cost.matmul_params + cost.lm_head_params)
    t = (kv_bytes + weight_bytes) / bandwidth + (prefill_flops + decode_flops) / flops
    return {"roofline_s": t, "roofline_tok_s": float(np.sum(outs)) / t, "decode_kv_bytes": kv_bytes,
            "decode_weight_bytes": weight_bytes, "prefill_flops": prefill_flops, "decode_matmul_flops": decode_flops}


class StepRecorder:
    """A plugin recording each step's batch size, scheduled tokens and duration."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float]] = []

    @hookimpl
    def specloop_step_finished(self, plan: Any, timings: dict[str, float]) -> None:
        self.steps.append((plan.num_reqs, plan.total_num_scheduled_tokens, timings["total"]))


def run_specloop(path: str, work: list[tuple[list[int], int]], args: argparse.Namespace) -> dict[str, Any]:
    from specloop import LLM, SamplingParams
    from specloop.frontend.engine_builder import freeze_heap
    from specloop.kernel.plugins import PluginManager

    recorder = StepRecorder()
    plugins = PluginManager([recorder])
    t0 = time.perf_counter()
    llm = LLM(path, plugins=plugins, skip_tokenizer_init=True, device=args.device, max_model_len=args.max_len * 2 + 16,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization, model_runner=args.runner)
    init_s = time.perf_counter() - t0
    freeze_heap()  # no full collection over the KV blocks inside the timed run
    runner = llm.core.runner
    # Warm-up: every kernel variant the run needs (prefill tiles, decode graphs, sampling).
    llm.generate([p for p, _ in work[:8]], SamplingParams(temperature=args.temperature, max_tokens=16,
                                                          ignore_eos=True), use_tqdm=False)
    recorder.steps.clear()
    params = [SamplingParams(temperature=args.temperature, max_tokens=o, ignore_eos=True) for _, o in work]
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = llm.generate([p for p, _ in work], params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(o for _, o in work)
    if generated != expected:
        raise RuntimeError(f"generated {generated} tokens, expected {expected}")
    decode = [(b, t) for b, n, t in recorder.steps if n == b]
    by_batch: dict[int, list[float]] = {}
    for b, t in decode:
        by_batch.setdefault(b, []).append(b / t)
    curve = sorted((b, float(np.median(v))) for b, v in by_batch.items())
    metrics = llm.get_metrics()
    executor = runner.parts.executor
    replays = getattr(executor, "num_replays", 0)
    backend = runner.attn_backend
    tile = {"decode_attention_tile": getattr(backend, "decode_config", None),
            "decode_attention_tuning_us": getattr(backend, "decode_tuning", {})}
    llm.core.shutdown()  # frees the KV cache and graph pools for the peer
    return {"tok_s": generated / elapsed, "elapsed_s": elapsed, "output_tokens": generated, "init_s": init_s,
            "steps": len(recorder.steps), "decode_steps": len(decode), "runner": type(runner).__name__,
            "num_kv_blocks": llm.config.num_kv_blocks, "preemptions": metrics.get("num_preemptions"),
            "graph_replays": replays, **tile,
            "decode_tok_s_by_batch": curve,
            "step_time_total_s": float(sum(t for _, _, t in recorder.steps))}


def run_peer(path: str, work: list[tuple[list[int], int]], args: argparse.Namespace) -> dict[str, Any]:
    wl = os.path.join(args.out, "offline_workload.json")
    with open(wl, "w") as f:
        json.dump(work, f)
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_peer.py"), "--model", path,
           "--workload", wl, "--time-limit", str(args.peer_time_limit), "--temperature", str(args.temperature),
           "--device", args.device]
    last: dict[str, Any] = {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.perf_counter() + args.peer_time_limit + 300
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{"):
            last.update(json.loads(line))
            print("  peer:", line, flush=True)
            if last.get("done") is not None:
                break
        elif line:
            print("  peer|", line[:300], flush=True)
        if time.perf_counter() > deadline:
            break
    proc.kill()
    proc.wait()
    if "elapsed" not in last or not last.get("tokens"):
        return {"error": "the peer produced no measurement", **last}
    return {**last, "tok_s": last["tokens"] / last["elapsed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base_args(parser)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--runner", default=None, help="model runner (default: gpu on CUDA)")
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--peer-time-limit", type=float, default=60.0,
                        help="seconds of peer generation to measure (its full run takes minutes)")
    args = parser.parse_args()
    device = torch.device(args.device)
    env = environment(device)
    config = {k: v for k, v in vars(args).items()}
    report("offline throughput: configuration", {**env, **config})

    bandwidth, flops = measure_bandwidth(device), measure_matmul(device)
    report("device ceilings (measured now)", {"copy bandwidth TB/s": bandwidth / 1e12, "bf16 matmul TFLOP/s": flops / 1e12})
    path = build_checkpoint(args.shape, args.ckpt_root, device)
    from specloop.models.config import read_model_config

    vocab = read_model_config(path).vocab_size
    work = workload(args.num_requests, args.min_len, args.max_len, vocab, args.seed)
    cost = ModelCost.of(args.shape)
    roof = roofline(cost, work, bandwidth, flops) if device.type == "cuda" else {}
    report("workload and roofline", {"requests": len(work), "input tokens": sum(len(p) for p, _ in work),
                                     "output tokens": sum(o for _, o in work), **roof})

    ours = run_specloop(path, work, args)
    report("specloop", {k: v for k, v in ours.items() if k != "decode_tok_s_by_batch"})
    result: dict[str, Any] = {"benchmark": "offline_throughput", "env": env, "config": config,
                              "ceilings": {"bandwidth_Bps": bandwidth, "matmul_flops": flops}, "roofline": roof,
                              "specloop": ours}
    save(args.out, "offline_throughput", result)
    if roof:
        result["pct_of_roofline"] = 100 * ours["tok_s"] / roof["roofline_tok_s"]
    if args.peer:
        free_memory()
        peer = run_peer(path, work, args)
        result["peer"] = peer
        if peer.get("tok_s"):
            result["speedup_vs_peer"] = ours["tok_s"] / peer["tok_s"]
    curve = ours["decode_tok_s_by_batch"]
    if curve:
        plot(args.out, "offline_throughput", {"specloop decode steps": ([b for b, _ in curve], [v for _, v in curve])},
             "requests decoding in the step", "output tok/s (step)",
             f"{args.shape} offline run, {env.get('gpu', env['device'])}, {env['commit']}")
    save(args.out, "offline_throughput", result)
    summary = {"specloop tok/s": ours["tok_s"], "roofline tok/s": roof.get("roofline_tok_s", float("nan")),
               "% of roofline": result.get("pct_of_roofline", float("nan")),
               "peer tok/s": result.get("peer", {}).get("tok_s", float("nan")),
               "specloop / peer": result.get("speedup_vs_peer", float("nan"))}
    report("offline throughput: summary", summary)


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

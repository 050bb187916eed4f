"""Decode speed against the physical limit, and decode throughput vs batch size.

For each shape: requests of a 32-token random prompt and 256 greedy output tokens (``ignore_eos``)
through ``LLM.generate``, at batch 1 and at each ``--batch-sizes`` entry. tok/s = output tokens /
wall time (the 32-token prefill is included; it is under 1% of the work). The roofline at batch b
is ``b * bandwidth / (weight bytes + b * mean context * KV bytes per token)``, at the copy
bandwidth measured in this run; for a mixture of experts the weight bytes are those a step of b
tokens reads (dense weights, and the routed experts some token picked, expected under uniform
routing), for MLA the KV bytes are the latent's. Plot: tok/s vs batch size, with the roofline.

    python benchmarks/decode_latency.py --shapes qwen3-0.6b,llama3-8b --out out/bench
    python benchmarks/decode_latency.py --shapes deepseek-v2-lite --batch-sizes 1,16,64,256
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ModelCost, base_args, begin_shapes, build_checkpoint, plot, report, save  # noqa: E402


# The GPU runner's options this benchmark sets from the command line: (option, type, what it does);
# a bool option is --name / --no-name, unset means the runner's default.
GPU_FLAGS = (
    ("skinny_gemv", bool, "kernels/gemv.py in one-row steps; on by default on CUDA"),
    ("graph_sampling", bool, "decode graphs draw their tokens; on by default"),
    ("pdl", bool, "programmatic dependent launch; on by default on Hopper where it pays"),
    ("rope_in_attention", bool, "a decode step's rotary and KV write inside the attention kernel; off by default"),
    ("skinny_rows", int, "the most rows a step its few-rows kernels take"),
    ("last_sums", bool, "split work added by its last program, not a second kernel; off by default"),
    ("long_context_graphs", bool, "decode graphs with more splits, replayed over long contexts; off by default"),
    ("moe_down_groups", int, "programs over a token's experts in the one-token MoE's down projection; 8 where it "
     "runs by default"),
    ("fused_latent", bool, "one-token latent attention in three kernels; on by default"),
    ("moe_shared_stream", bool, "a one-token MoE's shared experts beside its routing, on a second stream; on by "
     "default"),
    ("fused_routing", bool, "a one-token MoE's router and routing in one kernel; on by default"),
)


def gpu_options(args: argparse.Namespace) -> dict[str, Any]:
    """``plugin_options`` for the GPU runner flags given on the command line (none: its defaults)."""
    gpu = {name: getattr(args, name) for name, _, _ in GPU_FLAGS if getattr(args, name) is not None}
    return {"gpu": gpu} if gpu else {}


def run_shape(shape: str, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    from specloop import LLM, SamplingParams
    from specloop.frontend.engine_builder import freeze_heap
    from specloop.models.config import read_model_config

    device = torch.device(args.device)
    path = build_checkpoint(shape, args.ckpt_root, device)
    vocab = read_model_config(path).vocab_size
    sizes = sorted({1, *args.batch_sizes})
    t0 = time.perf_counter()
    llm = LLM(path, skip_tokenizer_init=True, device=args.device, max_model_len=args.prompt_len + args.output_len + 16,
              max_num_seqs=max(sizes), gpu_memory_utilization=args.gpu_memory_utilization, model_runner=args.runner,
              plugin_options=gpu_options(args))
    init_s = time.perf_counter() - t0
    freeze_heap()  # no full collection over the KV blocks inside a timed run
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([rng.integers(0, vocab, args.prompt_len).tolist()], params, use_tqdm=False)  # warm-up
    cost = ModelCost.of(shape)
    mean_ctx = args.prompt_len + (args.output_len - 1) / 2
    rows = []
    for b in sizes:
        prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(b)]
        times = []
        for _ in range(args.repeat if b == 1 else 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs)
        elapsed = float(np.median(times))
        tok_s = b * args.output_len / elapsed
        roof = b * bandwidth / (cost.weight_bytes_at(b) + b * mean_ctx * cost.kv_bytes_per_token)
        rows.append({"batch": b, "tok_s": tok_s, "ms_per_step": 1e3 * elapsed / args.output_len,
                     "roofline_tok_s": roof, "pct_of_roofline": 100 * tok_s / roof, "runs_s": times})
        report(f"{shape} batch {b}", rows[-1])
    runner = llm.core.runner
    executor = runner.parts.executor
    result = {"shape": shape, "init_s": init_s, "runner": type(runner).__name__,
              "graph_replays": getattr(executor, "num_replays", 0),
              "decode_attention_tile": getattr(runner.attn_backend, "decode_config", None),
              "decode_attention_tuning_us": getattr(runner.attn_backend, "decode_tuning", {}),
              "bytes_per_token_batch1": cost.weight_bytes + mean_ctx * cost.kv_bytes_per_token, "rows": rows}
    llm.core.shutdown()
    del llm
    import gc

    gc.unfreeze()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base_args(parser)
    parser.add_argument("--shapes", default="qwen3-0.6b,llama3-8b")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeat", type=int, default=3, help="runs at batch 1 (median)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--runner", default=None)
    for name, kind, what in GPU_FLAGS:
        how = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        parser.add_argument("--" + name.replace("_", "-"), default=None, help=f"the GPU runner's {name} option ({what})",
                            **how)
    args = parser.parse_args()
    bandwidth, results = begin_shapes("decode_latency", "decode latency", args)
    from tqdm import tqdm

    for shape in tqdm(args.shapes.split(","), desc="shapes"):
        results["shapes"][shape] = run_shape(shape, args, bandwidth)
        save(args.out, "decode_latency", results)
    series = {}
    for shape, r in results["shapes"].items():
        xs = [row["batch"] for row in r["rows"]]
        series[f"{shape} specloop"] = (xs, [row["tok_s"] for row in r["rows"]])
        series[f"{shape} roofline"] = (xs, [row["roofline_tok_s"] for row in r["rows"]])
    plot(args.out, "decode_latency", series, "batch size", "output tok/s",
         f"decode, {args.prompt_len}+{args.output_len} tokens, {results['env'].get('gpu', args.device)}, "
         f"{results['env']['commit']}")
    summary = {}
    for shape, r in results["shapes"].items():
        one = r["rows"][0]
        summary[f"{shape} batch-1 tok/s"] = one["tok_s"]
        summary[f"{shape} batch-1 % of roofline"] = one["pct_of_roofline"]
    report("decode latency: summary", summary)


if __name__ == "__main__":
    main()

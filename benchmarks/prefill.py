"""Prefill throughput for long prompts against the compute roofline.

Each measurement prefills ``--batch`` random prompts of one length in a single engine step
(``max_num_batched_tokens`` covers them; prefix caching off, so nothing is reused) and samples one
token. FLOPs = matmuls (2 x layer parameters per token, LM head for the last rows only) + causal
attention (QK^T and PV over the visible pairs). The roofline is the bf16 matmul rate measured in
this run. Plot: TFLOP/s and prompt tok/s vs prompt length.

    python benchmarks/prefill.py --prompt-lens 1024,4096,8192,16384 --out out/bench
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
from common import (ModelCost, base_args, build_checkpoint, environment, measure_matmul, plot,  # noqa: E402
                    report, save)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base_args(parser)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 8192, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--runner", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    env = environment(device)
    report("prefill: configuration", {**env, **vars(args)})
    flops_peak = measure_matmul(device)
    report("device ceilings (measured now)", {"bf16 matmul TFLOP/s": flops_peak / 1e12})

    from tqdm import tqdm

    from specloop import LLM, SamplingParams
    from specloop.models.config import read_model_config

    path = build_checkpoint(args.shape, args.ckpt_root, device)
    vocab = read_model_config(path).vocab_size
    longest = max(args.prompt_lens)
    llm = LLM(path, skip_tokenizer_init=True, device=args.device, max_model_len=longest + 16,
              max_num_batched_tokens=longest * args.batch, max_num_seqs=max(args.batch, 1),
              enable_prefix_caching=False, gpu_memory_utilization=0.8, model_runner=args.runner)
    cost = ModelCost.of(args.shape)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([rng.integers(0, vocab, min(512, longest)).tolist()], params, use_tqdm=False)  # warm-up
    rows = []
    for length in tqdm(args.prompt_lens, desc="prompt lengths"):
        times = []
        for _ in range(args.repeat + 1):
            prompts = [rng.integers(0, vocab, length).tolist() for _ in range(args.batch)]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
        elapsed = float(np.median(times[1:]))  # the first run of a length compiles its tile shapes
        tokens = length * args.batch
        flops = args.batch * (2 * cost.matmul_params * length + 2 * cost.lm_head_params
                              + cost.attn_flops_per_pair * length * (length + 1) / 2)
        row: dict[str, Any] = {"prompt_len": length, "batch": args.batch, "seconds": elapsed,
                               "prompt_tok_s": tokens / elapsed, "tflop_s": flops / elapsed / 1e12,
                               "pct_of_matmul_peak": 100 * flops / elapsed / flops_peak, "runs_s": times}
        rows.append(row)
        report(f"prompt {length} x {args.batch}", row)
    llm.core.shutdown()
    result = {"benchmark": "prefill", "env": env, "config": vars(args), "matmul_flops": flops_peak, "rows": rows}
    save(args.out, "prefill", result)
    plot(args.out, "prefill", {"specloop TFLOP/s": ([r["prompt_len"] for r in rows], [r["tflop_s"] for r in rows]),
                               "matmul peak TFLOP/s": ([r["prompt_len"] for r in rows],
                                                       [flops_peak / 1e12] * len(rows))},
         "prompt length", "TFLOP/s", f"{args.shape} prefill, {env.get('gpu', env['device'])}, {env['commit']}")
    report("prefill: summary", {f"{r['prompt_len']} tokens TFLOP/s (% peak)": f"{r['tflop_s']:.1f} "
                                f"({r['pct_of_matmul_peak']:.0f}%)" for r in rows})


if __name__ == "__main__":
    main()

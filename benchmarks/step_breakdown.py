"""Where one decode step's time goes, so the next optimisation targets the biggest slice.

With ``--batch-sizes`` requests decoding (128-token prompts, long outputs), each measured step is
driven by hand through the same calls ``EngineCore.step`` makes, synchronising the device between
phases so each phase is charged its own time:

* ``schedule``: ``scheduler.schedule()`` (host);
* ``update_states``: the runner applies the plan to its resident state (host);
* ``prepare_host``: packing the step into the pinned buffer and enqueueing its copy and kernels;
* ``h2d_prepare``: the wait until that copy and the ``prepare_inputs`` kernel finish (device);
* ``forward``: CUDA-graph replay or eager forward, timed by CUDA events (device kernels);
* ``sample_d2h``: sampling kernel, token write-back, D2H copy and the host sync;
* ``update_from_output``: the scheduler's commit (host).

The synchronisations make the sum a little larger than an unsynchronised step; the plain step time
(``EngineCore.step`` without them) is reported too, and a profile of the GPU kernels of a few plain
steps (CUDA-graph replays included). Plot: each phase's time vs batch size.

    python benchmarks/step_breakdown.py --batch-sizes 1,16,64,256 --out out/bench
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
from common import base_args, build_checkpoint, environment, gpu_kernels, plot, report, save  # noqa: E402

PHASES = ("schedule", "update_states", "prepare_host", "h2d_prepare", "forward", "sample_d2h", "update_from_output")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(core: Any, device: torch.device) -> dict[str, float]:
    """One engine step split into phases (the calls of ``EngineCore.step`` and the runner's
    ``execute_model`` / ``sample_tokens``)."""
    from specloop.backends.pending import PendingOutput
    from specloop.backends.runner import ExecutedStep

    runner = core.runner
    t: dict[str, float] = {}
    c0 = time.perf_counter()
    plan = core.scheduler.schedule()
    c1 = time.perf_counter()
    runner.update_states(plan)
    c2 = time.perf_counter()
    batch, key = runner.prepare_inputs(plan)
    c3 = time.perf_counter()
    sync(device)
    c4 = time.perf_counter()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    out = runner.forward(batch, key)
    if device.type == "cuda":
        end.record()
        end.synchronize()
        t["forward"] = start.elapsed_time(end) / 1e3
    c5 = time.perf_counter()
    if device.type != "cuda":
        t["forward"] = c5 - c4
    runner.executed = ExecutedStep(plan, batch, out.hidden_states, out.aux_hidden_states)
    result = runner.sample_tokens()
    if isinstance(result, PendingOutput):  # asynchronous scheduling: the tokens are read here
        result = result.result()
    c6 = time.perf_counter()
    core.scheduler.update_from_output(plan, result)
    core.post_step()
    c7 = time.perf_counter()
    t.update(schedule=c1 - c0, update_states=c2 - c1, prepare_host=c3 - c2, h2d_prepare=c4 - c3,
             sample_d2h=c6 - c5, update_from_output=c7 - c6, graph=float(key is not None))
    return t


def kernel_profile(core: Any, steps: int) -> list[dict[str, Any]]:
    """GPU kernels of ``steps`` plain engine steps (graph replays included), by total time."""
    def work() -> None:
        for _ in range(steps):
            core.step()
            core.post_step()
    return gpu_kernels(work, steps)


def run_batch(llm: Any, batch: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    from specloop.kernel.request import Request
    from specloop.kernel.sampling_params import SamplingParams

    core = llm.core
    device = core.runner.device
    rng = np.random.default_rng(batch)
    params = SamplingParams(temperature=0.0, max_tokens=args.warm_steps + 2 * args.steps + 8, ignore_eos=True)
    ids = [f"bd{batch}-{i}" for i in range(batch)]
    core.add_requests([Request(rid, rng.integers(0, vocab, args.prompt_len).tolist(), params) for rid in ids])
    for _ in range(args.warm_steps):  # prefill and settle into uniform decode
        core.step()
        core.post_step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        core.step()
        core.post_step()
    sync(device)
    plain = (time.perf_counter() - t0) / args.steps
    # The phases are timed one plan at a time: the plan in flight is committed first, and the engine
    # and runner plan, launch and commit synchronously until the kernel profile.
    overlap = (core.config.async_scheduling, core.runner.async_scheduling)
    core.config.async_scheduling = core.runner.async_scheduling = False
    while core.in_flight:
        core.step()
        core.post_step()
    phases = [timed_step(core, device) for _ in range(args.steps)]
    core.config.async_scheduling, core.runner.async_scheduling = overlap
    kernels = kernel_profile(core, 5) if device.type == "cuda" else []
    core.abort_requests(ids)
    while core.has_unfinished_requests():
        core.step()
    med = {p: float(np.median([s[p] for s in phases])) for p in PHASES}
    total = sum(med.values())
    return {"batch": batch, "step_s": plain, "tok_s": batch / plain, "phases_s": med, "phases_sum_s": total,
            "graph_fraction": float(np.mean([s["graph"] for s in phases])), "kernels": kernels,
            "share": {p: med[p] / total for p in PHASES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base_args(parser)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--warm-steps", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="plain steps overlap the host with the device (default: the engine's, on on CUDA)")
    parser.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                        help="the GPU runner's pdl option (programmatic dependent launch; a kernel waiting for the "
                        "one before it is profiled from its launch: turn it off for each kernel's own time)")
    parser.add_argument("--skinny-rows", type=int, default=None,
                        help="the GPU runner's skinny_rows option (the most rows a step its few-rows kernels take)")
    parser.add_argument("--moe-down-groups", type=int, default=None,
                        help="the GPU runner's moe_down_groups option (programs over a token's experts in the "
                        "one-token MoE's down projection)")
    args = parser.parse_args()
    device = torch.device(args.device)
    env = environment(device)
    report("step breakdown: configuration", {**env, **vars(args)})

    from tqdm import tqdm

    from specloop import LLM
    from specloop.models.config import read_model_config

    path = build_checkpoint(args.shape, args.ckpt_root, device)
    vocab = read_model_config(path).vocab_size
    llm = LLM(path, skip_tokenizer_init=True, device=args.device, max_num_seqs=max(args.batch_sizes),
              max_model_len=args.prompt_len + args.warm_steps + 2 * args.steps + 64, gpu_memory_utilization=0.8,
              model_runner="gpu", async_scheduling=args.async_scheduling,
              plugin_options={"gpu": {k: v for k, v in (("pdl", args.pdl), ("skinny_rows", args.skinny_rows),
                                                        ("moe_down_groups", args.moe_down_groups)) if v is not None}})
    backend = llm.core.runner.attn_backend
    report("decode attention tile (timed at start-up, us)", {"chosen": backend.decode_config, **backend.decode_tuning})
    rows = []
    for b in tqdm(args.batch_sizes, desc="batch sizes"):
        rows.append(run_batch(llm, b, args, vocab))
        save(args.out, "step_breakdown", {"benchmark": "step_breakdown", "env": env, "config": vars(args),
                                          "rows": rows})
        report(f"batch {b}", {"step ms (unsynchronised)": 1e3 * rows[-1]["step_s"], "tok/s": rows[-1]["tok_s"],
                              "graph replays (fraction)": rows[-1]["graph_fraction"],
                              **{f"{p} ms": 1e3 * v for p, v in rows[-1]["phases_s"].items()}})
        report(f"batch {b}: top kernels (us per step, calls per step)",
               {k["kernel"]: f"{k['us_per_step']:.1f} us  x{k['calls_per_step']:.0f}" for k in rows[-1]["kernels"]})
    llm.core.shutdown()
    save(args.out, "step_breakdown", {"benchmark": "step_breakdown", "env": env, "config": vars(args), "rows": rows})
    xs = [r["batch"] for r in rows]
    plot(args.out, "step_breakdown", {p: (xs, [1e3 * r["phases_s"][p] for r in rows]) for p in PHASES},
         "batch size", "ms per decode step", f"{args.shape} decode step phases, {env.get('gpu', env['device'])}, "
         f"{env['commit']}")


if __name__ == "__main__":
    main()

"""DeepSeek's latent KV cache and the MTP proposer's cost, on the DeepSeek-V2-Lite shape with one
random MTP layer (``common.SHAPES["deepseek-v2-lite"]``).

* KV bytes per token: ``(kv_lora_rank + qk_rope_head_dim) x layers x 2`` (bf16) for the latent
  cache, read back from the engine's block size in bytes, next to what expanded K/V would take
  (``heads x (qk_nope + qk_rope + v) x layers x 2``).
* MTP step cost at batch 1: a 32-token prompt and ``--output-len`` greedy tokens (``ignore_eos``)
  without speculation (ms per engine step), then with ``{"method": "mtp", "num_speculative_tokens":
  1}``, timing each proposal (device-synchronised: the layer over the step's verified positions
  plus one draft), whether the runner launched it from the device (``Proposer.launch``: one graph
  replay) or called ``propose``. Ratio = median draft step / median target decode step. Random weights
  accept few drafts, which does not change a step's cost; greedy outputs must be identical in
  float32 (in bf16 the sequences may part at a near-tie: reported, not an error). ``--token-map N``
  also times MTP with a token map of N ids (``speculative_config["token_map"]``: the draft step
  reads N rows of the head), the engines without and with it in turn, ``--rounds`` times each.
* The same ratio as the engine pays it ("pipelined", CUDA only): each engine decodes the request
  again without synchronising between steps (the host prepares a step while the device runs the
  last, as in serving), the target's step is that run's seconds a step, and a proposal's cost is
  the device time between CUDA events recorded around its launch in the stream, behind the
  verification it follows (the host's launch work overlaps that verification).

    python benchmarks/mtp_cost.py --out out/bench            # H200
    python benchmarks/mtp_cost.py --smoke                     # CPU, the tiny DeepSeek shape
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, base_args, build_checkpoint, environment, report, save  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times(llm: Any, prompt: list[int], output_len: int, device: torch.device, synced: bool = True
               ) -> list[float]:
    """Seconds of every engine step of one request, driven like ``LLM.generate`` does. ``synced``:
    each step timed alone, the device synchronised before and after it; otherwise the steps run as
    the engine runs them (the host preparing a step while the device computes the last) and one
    figure comes back: the whole run's seconds a step after the first (the prefill)."""
    from specloop import SamplingParams
    from specloop.kernel.request import Request

    core = llm.core
    core.add_requests([Request(f"r{time.monotonic_ns()}", prompt,
                               SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))])
    times, tokens, steps = [], [], 0
    start = 0.0
    while core.has_unfinished_requests():
        if synced:
            sync(device)
        t = time.perf_counter()
        out = core.step()
        if synced:
            sync(device)
            times.append(time.perf_counter() - t)
        elif steps == 0:
            sync(device)
            start = time.perf_counter()
        steps += 1
        tokens.extend(tok for o in out.outputs for tok in o.new_token_ids)
        core.post_step()
    if not synced:
        sync(device)
        times = [(time.perf_counter() - start) / max(1, steps - 1)]
    step_times.tokens = tokens  # type: ignore[attr-defined]
    return times


def mtp_run(spec: Any, prompt: list[int], output_len: int, device: torch.device, target: list[float],
            target_pipelined: float = 0.0) -> tuple[dict[str, Any], list[int], list[float]]:
    """Every MTP proposal of one greedy request on ``spec`` timed (device-synchronised), against the
    target engine's steps ``target``; then the request again unsynchronised, each launched proposal
    timed by events in the stream, against ``target_pipelined`` (the few proposals the runner calls
    rather than launches, after a prefill, still synchronise). Returns the figures, the tokens and
    the synchronised proposal times."""
    proposer = spec.core.runner.drafter.proposer
    draft_times: list[float] = []
    propose = proposer.propose

    def timed(inputs: Any) -> Any:
        sync(device)
        t = time.perf_counter()
        with torch.profiler.record_function("mtp.propose"):
            out = propose(inputs)
        sync(device)
        draft_times.append(time.perf_counter() - t)
        return out

    proposer.propose = timed
    launch = proposer.launch

    in_stream: list[tuple[Any, Any]] = []  # (start, end) events of launches in the unsynchronised run

    def timed_launch(step: Any) -> Any:  # a proposal fed from the device (one graph): its whole run
        if timed_launch.pipelined and device.type == "cuda":  # type: ignore[attr-defined]
            # No synchronisation: the start event enters the stream behind the verification, which
            # the device is still computing while the host prepares this launch, so the events
            # span the proposal's device time as the engine pays it.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = launch(step)
            end.record()
            if out is not None:
                in_stream.append((start, end))
            return out
        sync(device)
        t = time.perf_counter()
        with torch.profiler.record_function("mtp.launch"):
            out = launch(step)
        sync(device)
        if out is not None:
            draft_times.append(time.perf_counter() - t)
            timed_launch.count += 1  # type: ignore[attr-defined]
        return out

    timed_launch.count = 0  # type: ignore[attr-defined]
    timed_launch.pipelined = False  # type: ignore[attr-defined]
    proposer.launch = timed_launch
    step_times(spec, prompt, 8, device)  # warm-up
    draft_times.clear()
    timed_launch.count = 0  # type: ignore[attr-defined]
    spec_steps = step_times(spec, prompt, output_len, device)
    got = list(step_times.tokens)  # type: ignore[attr-defined]
    metrics = spec.get_metrics()
    draft_times = list(draft_times)  # the synchronised run's (the next run's calls append to the old list)
    timed_launch.pipelined = True  # type: ignore[attr-defined]
    spec_pipelined = step_times(spec, prompt, output_len, device, synced=False)[0]
    proposer.launch, proposer.propose = launch, propose
    device_ms = sorted(s.elapsed_time(e) for s, e in in_stream[1:])
    decode = sorted(target[1:])  # the first step is the prefill
    result = {
        "target decode step ms (median)": 1e3 * float(np.median(decode)),
        "MTP draft step ms (median)": 1e3 * float(np.median(draft_times[1:])),
        "MTP / target step": float(np.median(draft_times[1:]) / np.median(decode)),
        "MTP proposals timed (launched from the device / called)": f"{timed_launch.count} / {len(draft_times)}",
        "spec engine step ms (median)": 1e3 * float(np.median(spec_steps[1:])),
        "spec engine step ms, pipelined": 1e3 * spec_pipelined,
        "draft acceptance (random weights)": metrics.get("spec_acceptance_rate"),
    }
    if device_ms and target_pipelined:
        result.update({
            "target decode step ms, pipelined": 1e3 * target_pipelined,
            "MTP draft step device ms in stream (median)": float(np.median(device_ms)),
            "MTP / target step, pipelined": float(np.median(device_ms)) / (1e3 * target_pipelined),
            "MTP proposals timed in stream": len(device_ms),
        })
    return result, got, draft_times


def profile_steps(spec: Any, prompt: list[int], steps: int, device: torch.device, path: str) -> None:
    """``steps`` speculative steps under torch.profiler: the kernels by device time (printed, and to
    ``path``), the proposer's calls ('mtp.launch', 'mtp.propose') beside the target's."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step_times(spec, prompt, steps, device)
    table = prof.key_averages().table(sort_by="cuda_time_total" if device.type == "cuda" else "cpu_time_total",
                                      row_limit=40)
    print(table)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base_args(parser)
    parser.add_argument("--shape", default="deepseek-v2-lite")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--smoke", action="store_true", help="the tiny DeepSeek shape, a few tokens (CPU check)")
    parser.add_argument("--skinny-gemv", action=argparse.BooleanOptionalAction, default=None,
                        help="the GPU runner's skinny_gemv option (kernels/gemv.py in one-row steps; on by default on CUDA)")
    parser.add_argument("--token-map", type=int, default=0, metavar="N",
                        help="also time MTP with a token map of N ids (speculative_config's token_map: the draft "
                        "step reads N rows of the head, not the whole vocabulary's)")
    parser.add_argument("--rounds", type=int, default=1, help="with --token-map: engines without and with it, "
                        "in turn, this many times each")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the timed runs, profile this many speculative steps (torch.profiler): the "
                        "kernels by device time, and the proposer's calls ('mtp.propose') beside the target's")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.output_len = "deepseek-tiny", 24
    from specloop import LLM
    from specloop.models.config import read_model_config

    device = torch.device(args.device)
    env = environment(device)
    report("MTP cost: configuration", {**env, **vars(args)})
    path = build_checkpoint(args.shape, args.ckpt_root, device)
    cfg = read_model_config(path)
    s = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
    engine = dict(skip_tokenizer_init=True, device=args.device, max_model_len=args.prompt_len + args.output_len + 16,
                  max_num_seqs=4, gpu_memory_utilization=args.gpu_memory_utilization,
                  plugin_options={"gpu": {"skinny_gemv": args.skinny_gemv}} if args.skinny_gemv is not None else {})

    plain = LLM(path, **engine)
    runner = plain.core.runner
    exact = runner.dtype == torch.float32
    size = runner.dtype.itemsize  # 2 in bf16 on the GPU; float32 on a CPU
    latent = cfg.mla.latent_dim * cfg.num_layers * size
    expanded = s["num_attention_heads"] * (s["qk_nope_head_dim"] + s["qk_rope_head_dim"] + s["v_head_dim"]) \
        * cfg.num_layers * size
    kv = {"dtype": str(runner.dtype), "latent KV bytes/token (formula)": latent,
          "latent KV bytes/token (engine)": runner.kv_bytes_per_block() // runner.block_size,
          "expanded K/V bytes/token": expanded, "expanded / latent": expanded / latent,
          "KV blocks": plain.config.num_kv_blocks}
    report("KV cache", kv)
    step_times(plain, prompt, 8, device)  # warm-up
    target = step_times(plain, prompt, args.output_len, device)
    want = list(step_times.tokens)  # type: ignore[attr-defined]
    target_pipelined = step_times(plain, prompt, args.output_len, device, synced=False)[0]
    plain.core.shutdown()
    del plain, runner
    if device.type == "cuda":
        torch.cuda.empty_cache()

    results, spec = [], None
    # With a token map the two engines take turns (``--rounds``): a later engine of one process
    # can run slower, and a single pair would measure the order.
    order = [0, args.token_map] * args.rounds if args.token_map else [0]
    for ids in order:
        if spec is not None:
            spec.core.shutdown()
            del spec
            if device.type == "cuda":
                torch.cuda.empty_cache()
        token_map = None
        if ids:  # random weights favour no token: the lowest ids stand for a counted map
            os.makedirs(args.out, exist_ok=True)
            token_map = os.path.join(args.out, f"token_map_{ids}.json")
            with open(token_map, "w") as f:
                json.dump(list(range(min(ids, cfg.vocab_size))), f)
        spec = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1, "token_map": token_map},
                   **engine)
        result, got, draft_times = mtp_run(spec, prompt, args.output_len, device, target, target_pipelined)
        result = {"token map": f"{ids} of {cfg.vocab_size} ids" if ids else "none (whole vocabulary)", **result,
                  "greedy identical": got == want,
                  "tokens equal before they part": next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                                                        min(len(got), len(want)))}
        report("MTP step cost, batch 1", result)
        results.append((result, got, draft_times))
        if args.profile:
            profile_steps(spec, prompt, args.profile, device, os.path.join(args.out, f"mtp_profile_{ids}.txt"))
    result, got, draft_times = results[0]
    if args.token_map:
        summary = {}
        for ids in (0, args.token_map):
            runs = [r for (r, _, _), i in zip(results, order) if i == ids]
            for key in ("MTP / target step", "MTP / target step, pipelined"):
                summary[f"token map {ids or 'none'}: {key}, each run"] = [round(r[key], 4) for r in runs if key in r]
        report("MTP step cost with and without the token map", summary)
    save(args.out, "mtp_cost", {"benchmark": "mtp_cost", "env": env, "config": vars(args), "kv": kv,
                                "result": result, "target_steps_s": target, "draft_steps_s": draft_times,
                                "runs": [{"token_map": i, "result": r, "draft_steps_s": d}
                                         for (r, _, d), i in zip(results, order)]})
    spec.core.shutdown()
    # In half precision a one-token decode step and a two-token verification run different kernels
    # (the few-rows ones take one row), and random weights put near-ties everywhere: the sequences
    # may part (the GPU tests check identity on the trained model); in float32 they must not.
    if exact and any(g != want for _, g, _ in results):
        raise SystemExit("greedy output with MTP differs from the output without it")


if __name__ == "__main__":
    main()

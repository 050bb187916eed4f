"""Where an engine step's host time goes, with and without drafts, on the default models.

For each engine (no drafts; then per method: the proposer attached but held at speculation length
0, fixed K, fixed K with every verification read before the next plan (``--early-verification``),
the adaptive policy) one timed run of ``spec_decode.py``'s workload (held-out prompts,
every prompt submitted at once with at most ``--batch`` running) with the engine's host phases
timed by wrapping its methods: the scheduler's ``schedule`` and ``update_from_output``, the
runner's ``execute_model`` (state update, input preparation, the forward's launch) and
``sample_tokens`` (the sampler, the proposal), the commit; within them the verification's logits,
a launched proposal's parts, and every CUDA graph replay. Reported per engine: wall ms a step and
each phase's ms a step, averaged over the run (a phase that waits for the device counts its wait),
and the run's step times by speculation length (``spec_decode.StepTimes``). With ``--profile``,
a cProfile of one more run of each engine goes to ``--out`` (text and pstats); with ``--kernels``, the GPU kernels of
one more run (calls and device microseconds a step, by kernel, CUDA-graph replays included) are
reported beside the phases, so that work an engine adds on the device shows as well as on the host.
``--interleave`` builds every engine first and runs them in turn. ``--control`` builds a second
engine without drafts last: what a later engine of the same process
costs, drafts aside. Each engine's report also carries the host CPU's speed as the interpreter sees
it (a fixed pure-Python loop timed before and after the instrumented run), the CPU time of the
process's other threads and of other processes: on a shared machine the host can run the same
Python 1.5-1.8x slower for tens of seconds, and a comparison of engines timed in such different
windows measures the machine, not the engines.

    python benchmarks/step_phases.py --batch 32 --methods ngram,eagle3 --out out/phases
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spec_decode  # noqa: E402
from common import base_args, gpu_kernels, host_loop_ms, report  # noqa: E402

PHASES = {  # label: (object path from the engine core, method)
    "schedule": ("scheduler", "schedule"), "commit": ("", "_commit_oldest"),
    "update_from_output": ("scheduler", "update_from_output"), "step": ("", "step"),
    "update_states": ("runner", "update_states"), "prepare_inputs": ("runner", "prepare_inputs"),
    "forward": ("runner", "forward"), "sample": ("runner.parts.sampler", "sample"),
    "sample_tokens": ("runner", "sample_tokens"), "propose": ("runner.drafter", "propose"),
    # parts of the above, where a proposal is launched from the device
    "logits": ("runner.parts.sampler.reference", "logits"), "resolve": ("runner.drafter", "resolve"),
    "accept": ("runner.parts.device_rows", "accept"), "launch": ("runner.drafter.proposer", "launch"),
    "fill_gaps": ("runner.drafter.proposer.recorded", "fill_gaps"),
    "write_drafts": ("runner.parts.device_rows", "write_drafts"),
    "placeholders": ("runner.drafter", "_placeholders"),
}


def timed(totals: dict[str, list[float]], label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    kept = totals.setdefault(label, [0, 0.0])  # calls, seconds

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            kept[0] += 1
            kept[1] += time.perf_counter() - t0
    return wrapper


def instrument(core: Any) -> dict[str, list[float]]:
    """Wrap each of :data:`PHASES` the engine has; returns ``{label: [calls, seconds]}``."""
    totals: dict[str, list[float]] = {}
    for label, (path, name) in PHASES.items():
        obj = core
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        if obj is not None:
            setattr(obj, name, timed(totals, label, getattr(obj, name)))
    proposer = getattr(getattr(core.runner, "drafter", None), "proposer", None)
    for feed in getattr(proposer, "feed_graphs", {}).values():  # a head's first-step / proposal graphs
        feed.run = timed(totals, "feed graphs run", feed.run)
    import torch

    return totals


def file_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "=-" else "_" for c in label)


def set_replay_totals(totals: dict[str, list[float]]) -> None:
    """Count every CUDA graph replay from here on into ``totals`` (the engine about to run)."""
    import torch

    graph = torch.cuda.CUDAGraph
    replay = getattr(graph, "_untimed_replay", graph.replay)
    graph._untimed_replay = replay
    graph.replay = timed(totals, "graph replays", replay)


def thread_cpu() -> dict[str, float]:
    """CPU seconds each of this process's threads has used, by thread name (Linux; empty elsewhere)."""
    used: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        key = "main" if int(tid) == os.getpid() else f"{name}:{tid}"
        used[key] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return used


def machine_cpu() -> list[int]:
    """The machine's CPU time so far, in clock ticks: [busy, idle, steal] over all cores (Linux)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return [0, 0, 0]
    return [user + nice + system + irq + softirq, idle + iowait, steal]


def kernel_profile(engine: Any, steps: int) -> dict[str, Any]:
    """The GPU kernels of one more run of ``engine``, per step of the timed run (``steps``)."""
    rows = gpu_kernels(engine.run, steps, top=10_000)
    total = {"us_per_step": round(sum(r["us_per_step"] for r in rows), 1),
             "calls_per_step": round(sum(r["calls_per_step"] for r in rows), 1)}
    return {"total": total, "top": [dict(r, us_per_step=round(r["us_per_step"], 2),
                                         calls_per_step=round(r["calls_per_step"], 2)) for r in rows[:30]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base_args(parser)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--methods", default="ngram,eagle3")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--min-rounds", type=int, default=4)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--output-len-spread", type=float, default=0.0,
                        help="per-prompt output lengths, as spec_decode.py --output-len-spread")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--kernels", action="store_true", help="profile one more run's GPU kernels (torch's "
                        "profiler: the CUDA calls of engines built after it run slower on the host, so without "
                        "--interleave only the first engine's host figures are clean)")
    parser.add_argument("--warm-seconds", type=float, default=None,
                        help="untimed runs of each engine for this long (default 10 on CUDA, as spec_decode.py)")
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of each engine: the first "
                        "instrumented, the others before it plain (their min and median reported)")
    parser.add_argument("--engines", default="", help="run only the engines whose name contains one of "
                        "these comma-separated words (the engine without drafts always runs)")
    parser.add_argument("--interleave", action="store_true", help="build every engine first, then run them "
                        "in turn (warm-up, plain, instrumented and profiled runs alike), so that they share "
                        "the host's speed of the moment; without it each engine is built, measured and freed "
                        "before the next")
    parser.add_argument("--profile-rounds", type=int, default=None, help="profiled runs of each engine "
                        "(with --profile; 1 by default), their counts summed")
    parser.add_argument("--control", action="store_true", help="a second engine without drafts, built and "
                        "run last: what a later engine of the same process costs, drafts aside")
    args = parser.parse_args()
    if args.profile_rounds is not None and not args.profile:
        parser.error("--profile-rounds counts profiled runs: it needs --profile")
    args.profile_rounds = args.profile_rounds or 1
    if args.kernels and not str(args.device).startswith("cuda"):
        parser.error("--kernels profiles GPU kernels: it needs --device cuda")
    if args.warm_seconds is None:
        args.warm_seconds = 10.0 if str(args.device).startswith("cuda") else 0.0
    model = os.path.join(spec_decode.ROOT, "default_models", "specloop-tiny")
    run_args = argparse.Namespace(
        model=model, draft_model=model + "-draft", prompts="heldout", prompt_len=256, output_len=128, seed=0,
        min_prompts=16, continuous=True, min_rounds=args.min_rounds, gpu_memory_utilization=args.gpu_memory_utilization,
        batch_invariant=False, length_zero=False, host_proposals=False, early_verification=False, device=args.device,
        ckpt_root=args.ckpt_root, batch_sizes=[args.batch], output_len_spread=args.output_len_spread)
    from specloop.models.config import read_model_config

    prompts = spec_decode.make_prompts(run_args, read_model_config(model).vocab_size)
    prompts = prompts[:spec_decode.num_prompts(run_args, args.batch)]
    engines: list[tuple[str, dict[str, Any] | None, bool, bool]] = [("no drafts", None, False, False)]
    for method in args.methods.split(","):
        spec: dict[str, Any] = {"method": method, "num_speculative_tokens": args.k}
        if method == "ngram":
            spec.update(prompt_lookup_min=2, prompt_lookup_max=4)
        elif method == "draft_model":
            spec["model"] = run_args.draft_model
        elif os.path.isdir(f"{model}-{method}"):
            spec["model"] = f"{model}-{method}"
        engines += [(f"{method} at length 0", spec, True, False), (f"{method} K={args.k}", spec, False, False),
                    (f"{method} K={args.k}, read early", spec, False, True),
                    (f"{method} adaptive", dict(spec, policy="adaptive"), False, False)]
    if args.engines:
        words = args.engines.split(",")
        engines = [e for e in engines if e[1] is None or any(w in e[0] for w in words)]
    if args.control:
        engines.append(("no drafts, built last", None, False, False))
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, Any] = {}
    tile: list[Any] = []  # the first engine's decode attention tile, given to the others

    def build(name: str, spec: dict[str, Any] | None, zero: bool, early: bool) -> Any:
        run_args.length_zero, run_args.early_verification = zero, early
        engine = spec_decode.Engine(run_args, prompts, args.batch, spec, decode_tile=tile[0] if tile else None)
        if not tile:
            tile.append(getattr(engine.llm.core.runner.attn_backend, "decode_config", None))
        engine.run()  # warm-up: compiles, graph pools, the policy's first probes
        return engine

    def warm(group: list[Any]) -> None:  # until the device leaves its idle clocks, and the process settles
        warm_until = time.perf_counter() + args.warm_seconds
        while time.perf_counter() < warm_until:
            for engine in group:
                engine.run()

    def timed_run(name: str, engine: Any, totals: dict[str, list[float]], plain: list[float]) -> None:
        """One instrumented run; its row into ``results``."""
        set_replay_totals(totals)
        loop_before, cpu_before, machine_before = host_loop_ms(), thread_cpu(), machine_cpu()
        engine.run()
        machine_after, cpu_after, loop_after = machine_cpu(), thread_cpu(), host_loop_ms()
        busy, idle, steal = (a - b for a, b in zip(machine_after, machine_before))
        ours = sum(cpu_after.values()) - sum(cpu_before.values())  # seconds
        steps = max(int(totals["step"][0]), 1)
        others = {k: round(1e3 * (v - cpu_before.get(k, 0.0)) / steps, 3) for k, v in cpu_after.items() if k != "main"}
        row = {"ms_per_step": round(1e3 * engine.times[-1] / steps, 3), "steps": steps,
               **({"uninstrumented ms a step (min, median)": [round(1e3 * plain[0] / steps, 3),
                                                              round(1e3 * plain[len(plain) // 2] / steps, 3)]}
                  if plain else {}),
               **{label: round(1e3 * seconds / steps, 3) for label, (_, seconds) in totals.items()},
               "calls a step": {label: round(calls / steps, 2) for label, (calls, _) in totals.items() if calls},
               "host loop ms (before, after)": [loop_before, loop_after],
               "main thread cpu ms a step": round(1e3 * (cpu_after.get("main", 0.0) - cpu_before.get("main", 0.0)) / steps, 3),
               "other threads cpu ms a step": {k: v for k, v in others.items() if v > 0} or 0,
               "other processes' cpu (cores busy), steal %": [
                   round(max(busy / (os.sysconf("SC_CLK_TCK") * engine.times[-1]) - ours / engine.times[-1], 0.0), 2),
                   round(100 * steal / max(busy + idle + steal, 1), 2)]}
        if engine.step_times is not None and engine.step_times.runs:
            row["step times by length (steps, ms)"] = engine.step_times.runs[-1]
        results[name] = row
        report(f"batch {args.batch}: {name}", row)

    def save_profile(name: str, profile: cProfile.Profile) -> None:
        profile.dump_stats(os.path.join(args.out, f"profile_b{args.batch}_{file_name(name)}.pstats"))
        text = io.StringIO()
        for order in ("cumulative", "tottime"):
            pstats.Stats(profile, stream=text).sort_stats(order).print_stats(60)
        with open(os.path.join(args.out, f"profile_b{args.batch}_{file_name(name)}.txt"), "w") as f:
            f.write(text.getvalue())

    def finish(name: str, engine: Any) -> None:
        if args.kernels:
            row = results[name]
            row["kernels"] = kernel_profile(engine, row["steps"])
            report(f"batch {args.batch}: {name}, GPU kernels a step", row["kernels"]["total"])
            for k in row["kernels"]["top"][:12]:
                print(f"    {k['us_per_step']:9.2f} us {k['calls_per_step']:6.2f}x  {k['kernel']}")
        engine.llm.core.shutdown()
        engine.close()  # the engine's objects unfrozen and freed before the next is built

    if args.interleave:  # every engine built first; each round runs each once, in turn
        built = [(name, build(name, *rest)) for name, *rest in engines]
        warm([engine for _, engine in built])
        warmed = {name: len(engine.times) for name, engine in built}
        for _ in range(args.repeat - 1):
            for _, engine in built:
                engine.run()
        plains = {name: sorted(engine.times[warmed[name]:]) for name, engine in built}
        totals = {name: instrument(engine.llm.core) for name, engine in built}
        for name, engine in built:
            timed_run(name, engine, totals[name], plains[name])
        if args.profile:
            profiles = {name: cProfile.Profile() for name, _ in built}
            for _ in range(args.profile_rounds):
                for name, engine in built:
                    profiles[name].enable()
                    engine.run()
                    profiles[name].disable()
            for name, profile in profiles.items():
                save_profile(name, profile)
        for name, engine in built:
            finish(name, engine)
        del built
    else:
        for name, *rest in engines:
            engine = build(name, *rest)
            warm([engine])
            warmed = len(engine.times)
            for _ in range(args.repeat - 1):  # uninstrumented runs, timed whole
                engine.run()
            totals = instrument(engine.llm.core)
            timed_run(name, engine, totals, sorted(engine.times[warmed:]))
            if args.profile:
                profile = cProfile.Profile()
                for _ in range(args.profile_rounds):
                    profile.enable()
                    engine.run()
                    profile.disable()
                save_profile(name, profile)
            finish(name, engine)
            del engine
    with open(os.path.join(args.out, f"step_phases_b{args.batch}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

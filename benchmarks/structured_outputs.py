"""Structured outputs: what the grammar bitmask costs a decode step, how long schemas take to
compile, and whether the outputs are valid.

* step overhead: median decode-step time with ``--batch`` JSON-schema requests (the schemas of
  ``structured_schemas.py``, in turn) against the same batch unconstrained, counting only steps
  where every request is still decoding (a step's time: from one ``step()`` return to the next,
  unsynchronised, so asynchronous scheduling's overlap counts); also the host time of
  ``grammar_bitmask`` per step (it overlaps the forward on a GPU);
* compile time of every schema (cold, through the engine's structured-output manager);
* validity: each request runs to its end at temperature 1; of those that finish with ``stop``, the
  fraction whose text parses and validates against its schema (goal: all).

On the GPU the model is a random checkpoint of ``--shape`` with a byte-level BPE tokenizer trained
here (``--tokenizer-vocab`` tokens; the model's larger vocabulary is masked beyond it). ``--small``
runs the default model on the CPU with a small batch, to try the script anywhere.

    python benchmarks/structured_outputs.py --out out/bench            # H200
    python benchmarks/structured_outputs.py --small --device cpu       # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import base_args, build_checkpoint, environment, report, save  # noqa: E402
from grammar_engines import train_tokenizer  # noqa: E402
from structured_schemas import SCHEMAS  # noqa: E402

SUPPORTED = {k: v for k, v in SCHEMAS.items() if k not in ("unique_items", "dependent")}  # llguidance refuses these


def tokenizer_dir(root: str, vocab: int) -> str:
    path = os.path.join(root, f"bpe-{vocab}")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        import shutil

        shutil.copytree(train_tokenizer(vocab), path, dirs_exist_ok=True)
    return path


REFILL_EVERY = 8  # steps between replacing finished requests


def decode_steps(core: Any, make: Any, batch: int, steps: int, warm: int) -> tuple[list[float], dict[str, float]]:
    """Decode-step times at about ``batch`` requests, and the host time of the structured-output
    calls on the step thread. ``make(i)`` builds request ``i``; requests that finish are replaced
    every :data:`REFILL_EVERY` steps, as a server under load would see, and the step of a refill
    and the two after it (their prefills run outside the decode graphs) are not counted. A step's
    time is the interval between two returns of ``step()`` with nothing synchronised in between:
    with asynchronous scheduling the device runs one step while the host plans the next, and a
    synchronisation per step would hide exactly that overlap. The first ``warm`` steps are not
    counted (compilation, first masks)."""
    so = core.structured_output
    spent = {"bitmask_s": 0.0, "commit_s": 0.0, "steps": 0, "running": 0}
    fill, commit = so.grammar_bitmask, so.commit

    def timed(fn: Any, key: str) -> Any:
        def call(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args)
            if counting:
                spent[key] += time.perf_counter() - t0
            return out
        return call

    so.grammar_bitmask, so.commit = timed(fill, "bitmask_s"), timed(commit, "commit_s")
    live = {}
    for i in range(batch):
        r = make(i)
        live[r.request_id] = r
    core.add_requests(list(live.values()))
    made, finished, quiet = batch, 0, 0
    times = []
    counting = False
    try:
        sync(core)
        last = time.perf_counter()
        for i in range(warm + steps):
            counting = i >= warm and quiet == 0
            out = core.step()
            core.post_step()
            now = time.perf_counter()
            if counting:
                times.append(now - last)
                spent["steps"] += 1
                spent["running"] += len(core.scheduler.running)
            last = now
            quiet = max(quiet - 1, 0)
            for o in out.outputs:
                if o.finished and live.pop(o.req_id, None) is not None:
                    finished += 1
            if i % REFILL_EVERY == REFILL_EVERY - 1 and len(live) < batch:
                fresh = [make(made + k) for k in range(batch - len(live))]
                made += len(fresh)
                live.update((r.request_id, r) for r in fresh)
                core.add_requests(fresh)
                quiet = 3
    finally:
        so.grammar_bitmask, so.commit = fill, commit
        core.abort_requests(list(live))
        while core.has_unfinished_requests():
            core.step()
    spent["replaced"] = made - batch
    return times, spent


def sync(core: Any) -> None:
    if core.runner.device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base_args(parser)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warm", type=int, default=30, help="steps before counting (first masks are slow)")
    parser.add_argument("--tokenizer-vocab", type=int, default=65536)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine's asynchronous scheduling (default: on with CUDA)")
    parser.add_argument("--small", action="store_true", help="the default model, batch 8 (any device)")
    args = parser.parse_args()
    if args.small:
        args.batch, args.steps, args.warm = min(args.batch, 8), min(args.steps, 24), min(args.warm, 4)
    device = torch.device(args.device)
    env = environment(device)
    report("structured outputs: configuration", {**env, **vars(args)})

    from specloop import LLM, SamplingParams, StructuredOutputsParams
    from specloop.frontend.engine_builder import freeze_heap
    from specloop.kernel.request import Request

    if args.small:
        llm = LLM(device=args.device, max_model_len=512, max_num_seqs=args.batch,
                  async_scheduling=args.async_scheduling)
    else:
        path = build_checkpoint(args.shape, args.ckpt_root, device)
        llm = LLM(path, tokenizer=tokenizer_dir(args.ckpt_root, args.tokenizer_vocab), device=args.device,
                  max_model_len=1024, max_num_seqs=args.batch, gpu_memory_utilization=0.8,
                  async_scheduling=args.async_scheduling)
    freeze_heap()  # no full collection over the KV blocks inside the timed steps
    core, tok = llm.core, llm.tokenizer
    eos = llm.processor.eos_token_ids
    names = list(SUPPORTED)

    compile_ms = {}
    for name in names:
        t0 = time.perf_counter()
        core.structured_output.compile(StructuredOutputsParams(json=SUPPORTED[name][0]), eos).result()
        compile_ms[name] = 1e3 * (time.perf_counter() - t0)
    report("compile ms (cold)", {**compile_ms, "median": statistics.median(compile_ms.values()),
                                 "max": max(compile_ms.values())})

    prompt = tok.encode("Here is the record as JSON:", add_special_tokens=False)

    def maker(tag: str, constrained: bool, temperature: float, max_tokens: int) -> Any:
        def make(i: int) -> Any:
            schema = SUPPORTED[names[i % len(names)]][0]
            so = StructuredOutputsParams(json=schema) if constrained else None
            params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i, structured_outputs=so,
                                    ignore_eos=not constrained)
            return Request(f"{tag}-{i}", list(prompt), params, eos_token_ids=eos)
        return make

    plain, plain_spent = decode_steps(core, maker("plain", False, 1.0, 512), args.batch, args.steps, args.warm)
    constrained, spent = decode_steps(core, maker("json", True, 1.0, 512), args.batch, args.steps, args.warm)
    overhead = statistics.median(constrained) / statistics.median(plain) - 1 if plain and constrained else None
    n = max(spent["steps"], 1)
    report(f"decode step at batch {args.batch}", {
        "plain ms (median)": 1e3 * statistics.median(plain) if plain else None,
        "json-schema ms (median)": 1e3 * statistics.median(constrained) if constrained else None,
        "overhead": overhead, "steps counted": len(constrained),
        "running per step (plain, json)": f"{plain_spent['running'] / max(plain_spent['steps'], 1):.1f}, "
                                          f"{spent['running'] / n:.1f}",
        "json requests replaced": spent["replaced"],
        "async scheduling": llm.config.async_scheduling,
        "grammar_bitmask host ms per step": 1e3 * spent["bitmask_s"] / n,
        "commit host ms per step": 1e3 * spent["commit_s"] / n})

    outs = llm.generate([{"prompt_token_ids": prompt}] * args.batch,
                        [SamplingParams(temperature=1.0, max_tokens=400, seed=100 + i,
                                        structured_outputs=StructuredOutputsParams(json=SUPPORTED[names[i % len(names)]][0]))
                         for i in range(args.batch)], use_tqdm=False)
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    stopped = valid = 0
    for i, o in enumerate(outs):
        c = o.outputs[0]
        if c.finish_reason != "stop":
            continue
        stopped += 1
        try:
            value = json.loads(c.text)
            if jsonschema is not None:
                jsonschema.validate(value, SUPPORTED[names[i % len(names)]][0])
            valid += 1
        except Exception as e:  # reported, and the benchmark goes on
            print(f"  invalid output for {names[i % len(names)]}: {type(e).__name__}: {str(e)[:100]} {c.text[:80]!r}")
    report("validity", {"finished with stop": f"{stopped}/{args.batch}", "valid among them": f"{valid}/{stopped}",
                        "validated with": "jsonschema" if jsonschema is not None else "json.loads only"})
    save(args.out, "structured_outputs", {"benchmark": "structured_outputs", "env": env, "config": vars(args),
                                          "compile_ms": compile_ms, "plain_step_s": plain,
                                          "json_step_s": constrained, "overhead": overhead,
                                          "async_scheduling": llm.config.async_scheduling,
                                          "bitmask_host_s_per_step": spent["bitmask_s"] / max(spent["steps"], 1),
                                          "commit_host_s_per_step": spent["commit_s"] / max(spent["steps"], 1),
                                          "stopped": stopped, "valid": valid})
    core.shutdown()


if __name__ == "__main__":
    main()

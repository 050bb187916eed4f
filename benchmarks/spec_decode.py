"""Speculative decoding: acceptance and speedup over no speculation, same run.

For each batch size b, the same prompts (at least ``--min-prompts``, b at a time) are generated
greedily (``ignore_eos``, fixed output length) without speculation and then with each proposer and
each K. Reported per configuration:

* acceptance rate = accepted / drafted tokens; mean acceptance length = 1 + accepted / drafts
  (tokens committed per verification); per-position acceptance = share of drafts whose i-th token
  was accepted;
* speedup = wall time without speculation / with it (prefill included; the fastest of
  ``--repeat`` runs each, the two engines alternating so both see the same machine load); paired
  speedup = the median over runs of each run without speculation / the run with it that followed
  (robust to a machine whose speed drifts between runs);
* efficiency = speedup / ideal, ideal = mean acceptance length * t_step(no spec) / t_step(spec),
  t_step being wall time per engine step (drafting included);
* step ratio = engine steps without / with speculation: the speedup a step-time-bound engine would
  see if drafting and wider verification were free (deterministic, unlike wall times);
* whether the tokens equal the run without speculation (they must, for greedy decoding);
* draft cost = the proposer's time per verify step (feeding the accepted tokens and drafting K) and
  per drafted token, relative to the target's forward per step without speculation, both measured
  in one extra untimed run of each engine with timers around ``proposer.propose``,
  ``proposer.launch`` (a proposal started from the device) and the executor's forward
  (synchronising the device around each; a launch the proposer declines counts as a call).

Prompts: ``heldout`` takes windows of the standard-library modules held out from the default model's
training (``tools/train_default_models.py``), tokenized with the model's tokenizer; ``random``
draws token ids uniformly. The model defaults to the shipped ``specloop-tiny`` and the draft to
``specloop-tiny-draft`` (else the target itself, an upper bound on acceptance); a head method
(``eagle``, ``eagle3``, ``medusa``, any other registered one) reads ``<model>-<method>`` next to the
target, or ``--head METHOD=DIR``; on a shape (random weights) ``eagle3`` gets a random head of the
shape's width (``common.build_eagle3_head``). ``--methods`` defaults to every built-in proposer (and ``mtp``
when one is registered); a method whose engine cannot be built for this target is reported and
skipped.

With ``--alpha A`` every method runs acceptance-controlled (``proposers/controlled.py``): it pays its
real drafting cost, but its drafts are replaced by the target's known greedy continuation (from the
run without speculation), each position right with probability A, so speedup can be read against
acceptance on any shape, random weights included. ``--policy adaptive`` lets the adaptive
speculation policy choose the speculation length per step (K is then its maximum).
``--control`` adds an A/A pair per batch size: a second engine without drafts, alternated with the
first as the engines with drafts are, whose "speedup" should read 1.00x; it stays alive and runs
in every configuration's rounds too (without drafts, with drafts, the second), so each row also
has its own A/A figure from the same rounds: the spread against which that row's speedup is read.
``--length-zero`` holds every engine with drafts at speculation length 0 (its proposer attached,
drafting nothing): its speedup is what a proposer costs a step when it drafts nothing.
``--continuous`` submits every prompt at once with at most b running (continuous batching, as a
server sees it) instead of lockstep rounds of b, whose tails (requests finishing at different steps
under speculation) the run without drafts never has. With every output the same length, though,
the run without drafts still admits a round's replacements all in one step, while requests with
drafts finish, and are replaced, one at a time: ``--output-len-spread 0.5`` draws each prompt's
output length from 0.5-1.5x ``--output-len`` (the same for both engines), as a server's traffic
would. ``--batch-invariant`` runs both engines in
batch-invariant mode: ``identical`` should then read yes
in bf16, and the no-draft time against a run without the flag is the mode's cost. The two
engines of a comparison are alive at once, so each gets ``--gpu-memory-utilization`` of the GPU: 0.4,
or 0.3 with ``--control``, which keeps three alive.

    python benchmarks/spec_decode.py --batch-sizes 1,32 --ks 1,2,3,5
    python benchmarks/spec_decode.py --model out/checkpoints/tiny --prompts random --device cpu
    python benchmarks/spec_decode.py --model llama3-8b --prompts random --alpha 0.8 --ks 3 --batch-sizes 1 \
        --methods ngram,eagle3,draft_model --draft-model llama3.2-1b
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from specloop.proposers.policy import batch_bucket

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (ROOT, base_args, build_checkpoint, build_eagle3_head, environment, host_loop_ms,  # noqa: E402
                    report, save)


def heldout_prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` windows of ``length`` tokens from held-out standard-library modules: one window per
    module while there are modules long enough, then further windows of the same modules (a
    Python installation may ship fewer of them)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from train_default_models import is_heldout, stdlib_dir

    root = stdlib_dir()
    files = sorted(p for p in root.rglob("*.py") if is_heldout(str(p.relative_to(root))))
    rng = np.random.default_rng(seed)
    texts: list[list[int]] = []
    prompts: list[list[int]] = []
    for i in rng.permutation(len(files)):
        if len(prompts) == n:
            return prompts
        ids = tokenizer.encode(files[i].read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
        if len(ids) > length:
            start = int(rng.integers(0, len(ids) - length))
            prompts.append(ids[start:start + length])
            texts.append(ids)
    if not texts:
        raise SystemExit(f"no held-out module has {length} tokens")
    while len(prompts) < n:
        ids = texts[len(prompts) % len(texts)]
        start = int(rng.integers(0, len(ids) - length))
        prompts.append(ids[start:start + length])
    return prompts


def output_lengths(args: argparse.Namespace, n: int) -> list[int]:
    """Each prompt's output length: ``--output-len``, or with ``--output-len-spread f`` drawn
    uniformly from ``[(1 - f) L, (1 + f) L]`` (seeded, the same for every engine), so that the
    engine without drafts also admits requests one at a time instead of all at once."""
    f = getattr(args, "output_len_spread", 0.0)
    if not f:
        return [args.output_len] * n
    rng = np.random.default_rng(args.seed + 1)
    low, high = max(1, round(args.output_len * (1 - f))), round(args.output_len * (1 + f))
    return [int(x) for x in rng.integers(low, high + 1, n)]


def num_prompts(args: argparse.Namespace, batch_size: int) -> int:
    """Whole rounds of ``batch_size`` covering at least ``--min-prompts``, and at least
    ``--min-rounds`` of them (a large batch is otherwise one short round)."""
    return batch_size * max(-(-args.min_prompts // batch_size), args.min_rounds)


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    n = max(num_prompts(args, b) for b in args.batch_sizes)
    if args.prompts == "random":
        rng = np.random.default_rng(args.seed)
        return [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(n)]
    from specloop.frontend.tokenizer import Tokenizer

    return heldout_prompts(Tokenizer(args.model), n, args.prompt_len, args.seed)


class Timer:
    """Wall time inside a callable, the device synchronised around each call."""

    def __init__(self, fn: Any, cuda: bool) -> None:
        self.fn, self.cuda, self.seconds, self.calls = fn, cuda, 0.0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


class PolicyTrace:
    """What the speculation policy chose and measured, step by step, read from the drafting stage's
    records (``StepRates.history``: nothing wraps the engine's calls, so tracing costs a timed
    run one list append a step): the length it ran at each step (run-length encoded, ``3x40 0x8
    ...``) and, per batch-size bucket and length, the steady step times it was told
    (``observe_rate``: median and mean ms per step, count)."""

    def __init__(self, drafter: Any) -> None:
        self.history: list[Any] = []
        drafter.rates.history = self.history

    def reset(self) -> None:
        self.history.clear()

    def summary(self) -> dict[str, Any]:
        lengths = [r.length for r in self.history]
        runs: list[list[int]] = []
        for n in lengths:
            if runs and runs[-1][0] == n:
                runs[-1][1] += 1
            else:
                runs.append([n, 1])
        steps: dict[str, list[float]] = {}
        # A reported step's time ran to the next step's start; the first of a run (after a step of
        # another length) was reported as such, and is left out as the policy's trace always did.
        for before, step, after in zip(self.history, self.history[1:], self.history[2:]):
            if step.reported and before.length == step.length:
                steps.setdefault(f"b{batch_bucket(step.num_reqs)} L{step.length}", []).append(
                    1e3 * (after.started - step.started))
        return {"lengths": " ".join(f"{n}x{c}" for n, c in runs),
                "share": {n: lengths.count(n) / len(lengths) for n in sorted(set(lengths))} if lengths else {},
                "step_ms": {k: {"median": float(np.median(v)), "mean": float(np.mean(v)), "count": len(v)}
                            for k, v in sorted(steps.items())}}


class StepTimes:
    """Where a timed run's wall time went, by step: the speculation length it ran at, whether it
    was the first of a run at that length (a switch: a drained pipeline, a catch-up) and whether it
    admitted requests (their prefill, a proposer's first pass over their prompts). A step's time is
    from its sampling to the next step's, as the drafting stage measures it for the policy; read
    from the same records as :class:`PolicyTrace`."""

    def __init__(self, trace: PolicyTrace) -> None:
        self.trace = trace
        self.seen = 0  # records of earlier runs
        self.runs: list[dict[str, list[float]]] = []

    def end_run(self) -> None:
        """Close a timed run: ``{category: [steps, milliseconds]}``."""
        cats: dict[str, list[float]] = {}
        steps = self.trace.history[self.seen:]
        self.seen = len(self.trace.history)
        for before, step, after in zip(steps, steps[1:], steps[2:]):
            key = (f"L{step.length}" + ("-first" if before.length != step.length else "")
                   + ("-admit" if step.admits else ""))
            c = cats.setdefault(key, [0, 0.0])
            c[0] += 1
            c[1] += 1e3 * (after.started - step.started)
        self.runs.append({k: [n, round(ms, 1)] for k, (n, ms) in sorted(cats.items())})


class Engine:
    """One ``LLM`` (with or without speculation) generating the benchmark's prompts ``batch_size`` at
    a time, one ``generate`` call per round."""

    def __init__(self, args: argparse.Namespace, prompts: list[list[int]], batch_size: int,
                 spec: dict[str, Any] | None, plugin_options: dict[str, Any] | None = None,
                 decode_tile: Any = None) -> None:
        from specloop import LLM, SamplingParams
        from specloop.frontend.engine_builder import freeze_heap

        self.cuda = args.device.startswith("cuda")
        options = dict(plugin_options or {})
        if args.host_proposals and self.cuda:
            options["gpu"] = {"device_proposals": False}
        if args.early_verification and self.cuda:
            options["gpu"] = {**options.get("gpu", {}), "late_verification": False}
        if decode_tile is not None and self.cuda:  # the first engine's, not one timed anew
            options["gpu"] = {**options.get("gpu", {}), "decode_tile": list(decode_tile)}
        self.llm = LLM(args.model, skip_tokenizer_init=True, device=args.device, speculative_config=spec,
                       max_model_len=args.prompt_len + max(output_lengths(args, len(prompts))) + 16,
                       max_num_seqs=batch_size,
                       gpu_memory_utilization=args.gpu_memory_utilization, plugin_options=options,
                       batch_invariant=args.batch_invariant)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in output_lengths(args, len(prompts))]
        requests = [{"prompt_token_ids": p} for p in prompts]
        # Lockstep rounds of batch_size (the default), or every prompt at once with at most
        # batch_size running (--continuous: a finished request's place goes to the next prompt).
        self.rounds = ([(requests, params)] if args.continuous else
                       [(requests[i:i + batch_size], params[i:i + batch_size])
                        for i in range(0, len(requests), batch_size)])
        self.llm.generate(requests[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
        drafter = self.llm.core.runner.drafter
        if drafter is not None and args.length_zero:  # the proposer attached, drafting nothing
            drafter.policy.drafting = lambda req_ids: 0
            drafter.policy.choose = lambda req_ids, limit: [0] * len(req_ids)
        self.trace = PolicyTrace(drafter) if drafter is not None else None
        self.step_times = StepTimes(self.trace) if self.trace is not None else None
        freeze_heap()  # no full collection over the KV blocks inside a timed run
        self.times: list[float] = []
        # The first timed run's tokens and counters (greedy: every run is the same).
        self.stats: dict[str, Any] | None = None

    def run(self) -> None:
        before = self.llm.get_metrics()
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = [out for batch, params in self.rounds for out in self.llm.generate(batch, params, use_tqdm=False)]
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - t0)
        if self.step_times is not None:
            self.step_times.end_run()
        if self.stats is None:
            self.stats = counters(before, self.llm.get_metrics())
            drafter = self.llm.core.runner.drafter
            diverged = getattr(drafter.proposer, "diverged", None) if drafter is not None else None
            if diverged is not None:  # acceptance-controlled: requests that left their known continuation
                self.stats["diverged_requests"] = len(diverged)
            self.stats["tokens"] = [o.outputs[0].token_ids for o in outs]
            self.stats["output_tokens"] = sum(len(o.outputs[0].token_ids) for o in outs)

    def costs(self) -> dict[str, float]:
        """One more run with timers: seconds of target forward and of proposing, per step."""
        runner = self.llm.core.runner
        forward = Timer(runner.forward, self.cuda)
        runner.forward = forward
        timers: list[Timer] = []
        if runner.drafter is not None:  # a proposal is a propose call, or a launch from the device
            proposer = runner.drafter.proposer
            proposer.propose = Timer(proposer.propose, self.cuda)
            proposer.launch = Timer(proposer.launch, self.cuda)
            timers = [proposer.propose, proposer.launch]
        before = self.llm.get_metrics()
        for batch, params in self.rounds:
            self.llm.generate(batch, params, use_tqdm=False)
        drafted = self.llm.get_metrics()["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
        del runner.forward
        if timers:
            del runner.drafter.proposer.propose, runner.drafter.proposer.launch
        seconds, calls = sum(t.seconds for t in timers), sum(t.calls for t in timers)
        return {"forward_s": forward.seconds / max(forward.calls, 1),
                "propose_s": seconds / max(calls, 1) if timers else 0.0,
                "propose_per_token_s": seconds / max(drafted, 1) if timers else 0.0}

    @property
    def seconds(self) -> float:
        return min(self.times)

    def close(self) -> None:
        del self.llm
        gc.unfreeze()
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def counters(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Steps and speculative-decoding figures between two ``get_metrics()`` snapshots."""
    def delta(key: str) -> int:
        return after[key] - before[key]

    per_pos_before = before["spec_num_accepted_tokens_per_pos"]
    per_pos = [n - (per_pos_before[i] if i < len(per_pos_before) else 0)
               for i, n in enumerate(after["spec_num_accepted_tokens_per_pos"])]
    drafts, drafted, accepted = delta("spec_num_drafts"), delta("spec_num_draft_tokens"), delta("spec_num_accepted_tokens")
    return {"steps": delta("num_steps"), "drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "per_position_acceptance": [n / drafts for n in per_pos] if drafts else []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base_args(parser)
    parser.add_argument("--model", default=os.path.join(ROOT, "default_models", "specloop-tiny"),
                        help="target model directory, or a benchmarks/common.py shape name (random weights)")
    parser.add_argument("--draft-model", default=None,
                        help="draft model directory (default: specloop-tiny-draft next to the target, else the target)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated (default: ngram,draft_model,eagle,eagle3,medusa, and mtp if registered)")
    parser.add_argument("--head", action="append", default=[], metavar="METHOD=DIR",
                        help="checkpoint of a head method (default: <model>-<method> next to the target)")
    parser.add_argument("--ks", default="1,2,3,5")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--prompts", choices=("heldout", "random"), default="heldout")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--output-len-spread", type=float, default=0.0,
                        help="output lengths uniform in [(1-f), (1+f)] x --output-len per prompt (seeded; 0: all "
                             "equal, and without drafts every request of a round finishes at the same step)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-prompts", type=int, default=16,
                        help="prompts per batch size at least; smaller batches run several rounds")
    parser.add_argument("--continuous", action="store_true",
                        help="submit every prompt at once, at most the batch size running, instead of lockstep "
                             "rounds (with drafts the requests of a round finish at different steps, so each round "
                             "ends with a shrinking batch the run without drafts never has)")
    parser.add_argument("--min-rounds", type=int, default=1,
                        help="at least this many rounds of each batch size (e.g. 3: the adaptive policy "
                             "measures before it settles, and one round of batch 128 is ~130 steps)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed runs per configuration, alternating with no speculation; the fastest counts "
                             "(0: one run each, not alternated)")
    parser.add_argument("--warm-seconds", type=float, default=None,
                        help="untimed runs of the first engine until this long after its first (default 10 on "
                             "CUDA: an H200 left idle runs a host-bound step up to twice as slowly for its first "
                             "seconds of work; 0 on the CPU)")
    parser.add_argument("--warm-runs", type=int, default=1,
                        help="untimed runs of each further engine before its timed runs (with --repeat)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default 1 on the CPU: small models' ops gain nothing from more, "
                             "and a busy machine makes a multi-threaded pool stall)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="per engine: a comparison keeps two engines alive, three with --control "
                             "(default 0.4, 0.3 with --control)")
    parser.add_argument("--alpha", type=float, default=None,
                        help="acceptance-controlled: each draft position right with this probability")
    parser.add_argument("--policy", default="fixed", help="speculation policy (fixed, adaptive)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="both engines in batch-invariant mode (bf16 identity; its cost is the no-draft time)")
    parser.add_argument("--control", action="store_true",
                        help="also time a second engine without drafts against the first, alternated the same way "
                             "(an A/A pair: what the order and the second engine's start cost, with nothing to gain), "
                             "and in every configuration's rounds (each row's A/A figure)")
    parser.add_argument("--length-zero", action="store_true",
                        help="hold every engine with drafts at speculation length 0 after its warm-up request: "
                             "what a proposer costs when it drafts nothing (speedup ~1 is the aim)")
    parser.add_argument("--early-verification", action="store_true",
                        help="plugin_options gpu late_verification=False: read every verification before planning "
                             "the next step (what reading it a step late gains)")
    parser.add_argument("--host-proposals", action="store_true",
                        help="plugin_options gpu device_proposals=False: propose on the host after reading each "
                             "verification, never launching a proposal from the device (what launching gains)")
    args = parser.parse_args()
    if args.warm_seconds is None:
        args.warm_seconds = 10.0 if args.device.startswith("cuda") else 0.0
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.3 if args.control else 0.4
    args.ks = [int(k) for k in args.ks.split(",")]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.methods is None:
        from specloop.kernel.plugins import PluginManager

        registered = PluginManager().proposers.names()
        args.methods = "ngram,draft_model,eagle,eagle3,medusa" + (",mtp" if "mtp" in registered else "")
    args.methods = args.methods.split(",")
    heads = dict(h.split("=", 1) for h in args.head)
    device = torch.device(args.device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    args.threads = torch.get_num_threads()
    from common import SHAPES

    if args.model in SHAPES:
        if "eagle3" in args.methods and "eagle3" not in heads:  # a random head of the shape's width
            heads["eagle3"] = build_eagle3_head(args.model, args.ckpt_root, device)
        args.model = build_checkpoint(args.model, args.ckpt_root, device)
    if not os.path.isdir(args.model):
        raise SystemExit(f"no model at {args.model}; pass --model DIR or a shape ({', '.join(SHAPES)})")
    if args.draft_model in SHAPES:
        args.draft_model = build_checkpoint(args.draft_model, args.ckpt_root, device)
    if args.draft_model is None:
        sibling = args.model.rstrip("/") + "-draft"
        args.draft_model = sibling if os.path.isdir(sibling) else args.model
    from specloop.models.config import read_model_config

    prompts = make_prompts(args, read_model_config(args.model).vocab_size)
    config = dict(vars(args))
    report("configuration", {**environment(device), **{k: str(v) for k, v in config.items()}})

    results: list[dict[str, Any]] = []
    controls: list[dict[str, Any]] = []
    for b in args.batch_sizes:
        batch = prompts[:num_prompts(args, b)]
        base = Engine(args, batch, b, None)
        # Every later engine decodes with the tile this one timed: each would time its own at
        # start-up, and two engines of one process have chosen differently (a confound of a few %).
        tile = getattr(base.llm.core.runner.attn_backend, "decode_config", None)
        base.run()
        warm_until = time.perf_counter() + args.warm_seconds
        while time.perf_counter() < warm_until:  # until the device has left its idle clocks
            base.run()
        base_cost = base.costs()
        report(f"batch {b}: no speculation", {"seconds": base.seconds, "steps": base.stats["steps"],
                                             "output tok/s": base.stats["output_tokens"] / base.seconds,
                                             "target forward ms/step": 1e3 * base_cost["forward_s"]})
        if args.control:  # an A/A pair: a second engine without drafts, alternated as the others are
            other = Engine(args, batch, b, None, decode_tile=tile)
            for _ in range(args.warm_runs):
                other.run()
            base.times.clear()
            other.times.clear()
            loops = []
            for _ in range(max(args.repeat, 1)):
                loops.append(host_loop_ms())
                base.run()
                other.run()
            controls.append({"batch": b, "speedup": base.seconds / other.seconds, "seconds": other.seconds,
                             "host_loop_ms": loops,
                             "base_seconds": base.seconds, "runs_seconds": list(other.times),
                             "base_runs_seconds": list(base.times)})
            report(f"batch {b}: control (a second engine without drafts)", {
                "speedup": controls[-1]["speedup"],
                "all runs (second engine)": " ".join(f"{t:.3f}" for t in other.times)
                                            + " (first: " + " ".join(f"{t:.3f}" for t in base.times) + ")"})
        else:
            other = None
        for method in args.methods:
            for k in args.ks:
                spec: dict[str, Any] = {"method": method, "num_speculative_tokens": k, "policy": args.policy}
                if method == "ngram":
                    spec.update(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
                elif method == "draft_model":
                    spec["model"] = args.draft_model
                else:
                    head = heads.get(method, args.model.rstrip("/") + "-" + method)
                    if os.path.isdir(head):
                        spec["model"] = head
                options: dict[str, Any] = {}
                if args.alpha is not None:
                    spec.update(method="controlled", extra={"wraps": method, "alpha": args.alpha})
                    truth = {tuple(p): t for p, t in zip(batch, base.stats["tokens"])}
                    options["controlled"] = {"continuations": truth}
                try:
                    engine = Engine(args, batch, b, spec, options, decode_tile=tile)
                except (ValueError, RuntimeError) as e:
                    report(f"batch {b}: {method} K={k}", {"skipped": str(e)})
                    continue
                # Alternate the two engines so that both see the same machine conditions (--repeat 0:
                # one run with speculation against the first run without, for acceptance tables).
                if args.repeat:
                    for _ in range(args.warm_runs):  # compiles, first replays, the policy's first probes
                        engine.run()
                    base.times.clear()
                    engine.times.clear()
                    if other is not None:
                        other.times.clear()
                    engine.stats = None  # counted again over the first timed run
                    if engine.trace is not None:
                        engine.trace.reset()
                    if engine.step_times is not None:
                        engine.step_times.runs.clear()
                        engine.step_times.seen = 0
                loops = []  # the host's speed before each pair of runs (common.host_loop_ms)
                for _ in range(max(args.repeat, 1)):
                    loops.append(host_loop_ms())
                    if args.repeat:
                        base.run()
                    engine.run()
                    if args.repeat and other is not None:
                        other.run()
                # What the policy did in the timed runs (the cost run's timers would skew its rates).
                policy = engine.trace.summary() if engine.trace is not None else None
                cost = engine.costs()
                # The decode attention tiles, with and without drafts (the same: given the first's).
                tiles = [getattr(e.llm.core.runner.attn_backend, "decode_config", None) for e in (base, engine)]
                engine.close()
                run, base_steps = engine.stats, base.stats["steps"]
                speedup = base.seconds / engine.seconds
                # Each run with drafts against the run without that came just before it: a machine
                # whose speed drifts between runs moves both alike (the fastest of each may not).
                paired = float(np.median([t0 / t1 for t0, t1 in zip(base.times, engine.times)])) \
                    if args.repeat else speedup
                # The A/A pair in the same rounds: what two engines without drafts read against each other.
                control = (float(np.median([t0 / t1 for t0, t1 in zip(base.times, other.times)]))
                           if args.repeat and other is not None and other.times else None)
                ideal = run["mean_acceptance_length"] * (base.seconds / base_steps) / (engine.seconds / run["steps"])
                row = {"batch": b, "method": method, "k": k, "seconds": engine.seconds,
                       "base_seconds": base.seconds, "speedup": speedup, "paired_speedup": paired,
                       "control_paired": control,
                       "ideal_speedup": ideal,
                       # every timed run, for the spread: the fastest of each counts
                       "runs_seconds": list(engine.times), "base_runs_seconds": list(base.times),
                       "efficiency": speedup / ideal, "step_ratio": base_steps / run["steps"],
                       "identical": run["tokens"] == base.stats["tokens"],
                       "draft_step_cost": cost["propose_s"] / base_cost["forward_s"],
                       "draft_token_cost": cost["propose_per_token_s"] / base_cost["forward_s"],
                       "policy": policy, "decode_attention_tiles": tiles, "host_loop_ms": loops,
                       # per timed run, {length[-first][-admit]: [steps, ms]}
                       "step_times": engine.step_times.runs[:len(engine.times)] if engine.step_times else None,
                       **{key: v for key, v in run.items() if key != "tokens"}}
                results.append(row)
                report(f"batch {b}: {method} K={k}", {
                    "acceptance rate": row["acceptance_rate"], "mean acceptance length": row["mean_acceptance_length"],
                    "per-position acceptance": ", ".join(f"{a:.2f}" for a in row["per_position_acceptance"]),
                    "seconds (no speculation)": f"{engine.seconds:.3f} ({base.seconds:.3f})",
                    "all runs (no speculation)": " ".join(f"{t:.3f}" for t in engine.times)
                                                 + " (" + " ".join(f"{t:.3f}" for t in base.times) + ")",
                    "speedup": speedup, "paired speedup (median of run-by-run ratios)": paired,
                    **({"A/A in the same rounds (paired)": control} if control is not None else {}),
                    "host loop ms before each pair (min, max)": f"{min(loops):.2f}, {max(loops):.2f}",
                    "ideal speedup": ideal, "efficiency": row["efficiency"],
                    "steps": row["steps"], "step ratio": row["step_ratio"],
                    "draft cost per step / per token (x target step)":
                        f"{row['draft_step_cost']:.2f} / {row['draft_token_cost']:.2f}",
                    "identical to no speculation": row["identical"],
                    **({"policy lengths (share)": " ".join(f"{n}: {v:.2f}" for n, v in row["policy"]["share"].items())}
                       if args.policy != "fixed" and row["policy"] else {}),
                    **({"where the fastest run's time went (steps, ms)": " ".join(
                        f"{key} {n} {ms:.0f}" for key, (n, ms) in
                        row["step_times"][engine.times.index(engine.seconds)].items())} if row["step_times"] else {}),
                    **({"requests off their known continuation (no drafts after)": row["diverged_requests"]}
                       if "diverged_requests" in row else {})})
        if other is not None:
            other.close()
        base.close()
    print("\n| batch | method | K | acceptance | mean acc. len | per-position | draft cost / step | "
          "/ token | step ratio | speedup | paired | A/A paired | ideal | efficiency | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        per_pos = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"])
        print(f"| {r['batch']} | {r['method']} | {r['k']} | {r['acceptance_rate']:.3f} | "
              f"{r['mean_acceptance_length']:.2f} | {per_pos} | {r['draft_step_cost']:.2f} | "
              f"{r['draft_token_cost']:.2f} | {r['step_ratio']:.2f} | {r['speedup']:.2f}x | "
              f"{r['paired_speedup']:.2f}x | "
              f"{'' if r['control_paired'] is None else format(r['control_paired'], '.2f') + 'x'} | "
              f"{r['ideal_speedup']:.2f}x | "
              f"{r['efficiency']:.2f} | {'yes' if r['identical'] else 'NO'} |")
    for c in controls:
        print(f"| {c['batch']} | control: no drafts | - | | | | | | | {c['speedup']:.2f}x | | | | | |")
    path = save(args.out, "spec_decode", {"config": config, "environment": environment(device), "results": results,
                                          "controls": controls})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()

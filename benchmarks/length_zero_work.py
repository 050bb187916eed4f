"""What a decode step launches with a proposer attached but drafting nothing, against no proposer.

The adaptive speculation policy runs length 0 for most steps where drafting does not pay, and on the
H200 such an engine measured 4-6% slower than one without a proposer (docs/benchmarks.md). This
counts, per decode step, the Triton kernels launched and the torch (aten) ops dispatched by the gpu
runner on the CPU, kernels under Triton's interpreter and no CUDA graphs (so a graph's body is
counted op by op), for the engine without a proposer and for each method held at length 0, and
prints every count that differs. The default models, greedy, one request, asynchronous scheduling
as on CUDA. A step's count is the difference between a run of ``2n`` and one of ``n`` decode steps
over ``n``, so prefill and start-up cancel.

    python -P benchmarks/length_zero_work.py --methods ngram,medusa,draft_model,eagle,eagle3
"""

from __future__ import annotations

import argparse
import collections
import os
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "default_models"
HEADS = {"draft_model": "specloop-tiny-draft", "medusa": "specloop-tiny-medusa", "eagle": "specloop-tiny-eagle",
         "eagle3": "specloop-tiny-eagle3"}
_counts: collections.Counter | None = None


class _Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _counts is not None:
            _counts[f"op {func}"] += 1
        return func(*args, **(kwargs or {}))


def _count_launches() -> None:
    run = interpreter.InterpretedFunction.run

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _counts is not None:
            _counts[f"kernel {getattr(self.fn, '__name__', self.fn)}"] += 1
        return run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted


def per_step(method: str | None, steps: int) -> dict[str, float]:
    """Kernels and ops a decode step of the engine with ``method`` held at length 0 (None: no proposer)."""
    global _counts
    from specloop import LLM, SamplingParams

    spec: dict[str, Any] | None = None if method is None else {"method": method, "num_speculative_tokens": 3}
    if method in HEADS:
        spec["model"] = str(ROOT / HEADS[method])
    llm = LLM(str(ROOT / "specloop-tiny"), model_runner="gpu", device="cpu", dtype="float32", skip_tokenizer_init=True,
              max_model_len=128, max_num_seqs=4, async_scheduling=True, speculative_config=spec)
    drafter = llm.core.runner.drafter
    if drafter is not None:  # the proposer attached, drafting nothing
        drafter.policy.drafting = lambda req_ids: 0
        drafter.policy.choose = lambda req_ids, limit: [0] * len(req_ids)
    prompt = [{"prompt_token_ids": list(range(5, 12))}]
    try:
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        runs = []
        for tokens in (steps, 2 * steps):
            _counts = collections.Counter()
            with _Ops():
                llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                             use_tqdm=False)
            runs.append(_counts)
            _counts = None
    finally:
        llm.core.shutdown()
    return {k: (runs[1][k] - runs[0][k]) / steps for k in set(runs[0]) | set(runs[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="ngram,medusa,draft_model,eagle3")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    _count_launches()
    base = per_step(None, args.steps)
    kernels = {k: v for k, v in base.items() if k.startswith("kernel")}
    print(f"no proposer, a decode step: {sum(v for k, v in base.items() if k.startswith('op')):.1f} ops, "
          f"kernels {dict(sorted(kernels.items()))}")
    for method in args.methods.split(","):
        own = per_step(method, args.steps)
        diff = {k: (base.get(k, 0.0), own.get(k, 0.0)) for k in set(base) | set(own)
                if abs(base.get(k, 0.0) - own.get(k, 0.0)) > 1e-9}
        print(f"{method} at length 0: {len(diff)} counts differ")
        for k, (a, b) in sorted(diff.items()):
            print(f"    {k:56s} none {a:7.2f}   {method} {b:7.2f}")


if __name__ == "__main__":
    main()

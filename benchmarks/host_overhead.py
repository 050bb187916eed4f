"""Host time per engine step, without a model: the engine core (scheduler, KV-cache manager, commit)
and the offline frontend (output processing) around the ``scripted`` runner, whose "forward" is a
Python function of the token history.

At large batch a GPU step is a few milliseconds and this host work has to hide behind it
(asynchronous scheduling overlaps it with the forward). The figure is wall time per step of
``LLM.generate`` over ``--batch`` requests decoding together (``--prompt-len`` token prompts,
``--output-len`` new tokens, greedy, ``ignore_eos``), fastest and median of ``--repeat`` runs after
one warm-up run; the scripted runner's own share is reported beside it (its ``execute_model`` and
``sample_tokens``, timed), so what is left is the engine's. ``--profile`` prints a cProfile of one
more run.

    python benchmarks/host_overhead.py --batch 256
    python benchmarks/host_overhead.py --batch 256 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

from specloop import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    b = args.batch
    llm = LLM(model_runner="scripted", skip_tokenizer_init=True, max_num_seqs=b,
              max_model_len=args.prompt_len + args.output_len + 16, block_size=16,
              num_kv_blocks=b * (-(-(args.prompt_len + args.output_len + 16) // 16) + 1),
              max_num_batched_tokens=b * args.prompt_len + b)
    prompts = [{"prompt_token_ids": [(i * 13 + j) % 900 + 1 for j in range(args.prompt_len)]} for i in range(b)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    runner = llm.core.runner
    runner_seconds = [0.0]
    for name in ("execute_model", "sample_tokens"):
        inner = getattr(runner, name)

        def timed(*a, _inner=inner, **kw):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                runner_seconds[0] += time.perf_counter() - t0

        setattr(runner, name, timed)

    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    per_step, runner_share = [], []
    for _ in range(args.repeat):
        steps0, runner_seconds[0] = llm.get_metrics()["num_steps"], 0.0
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        steps = llm.get_metrics()["num_steps"] - steps0
        per_step.append(1e3 * seconds / steps)
        runner_share.append(1e3 * runner_seconds[0] / steps)
    best = min(range(len(per_step)), key=per_step.__getitem__)
    print(f"batch {b}, {args.prompt_len}-token prompts, {args.output_len} new tokens, {args.repeat} runs")
    print(f"ms per step: fastest {per_step[best]:.2f} (scripted runner {runner_share[best]:.2f}, "
          f"engine and frontend {per_step[best] - runner_share[best]:.2f}), median {statistics.median(per_step):.2f}")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        llm.generate(prompts, params, use_tqdm=False)
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())


if __name__ == "__main__":
    main()

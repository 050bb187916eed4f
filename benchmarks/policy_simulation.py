"""The adaptive speculation policy against the simulated machine of its tests
(``tests/test_speculation_policy.py``, ``Machine``): committed tokens per second as a share of
the best fixed length's, exploration included, averaged over ``--seeds`` runs of ``--steps`` steps.

Scenarios: batch 1 (drafting pays, best K = 3 at acceptance 0.7 and K = 1 at 0.3) and batch 32
(compute-bound, no drafting pays), each at acceptance 0.7 and 0.3; drafts that lose (every length
4-5x a plain step, acceptance 0.05) over ``--long-steps`` steps; ``warm-up``: batch 1 at 0.7
whose first 12 steps at K cost 2.5 times their due (what a fresh engine's first steps can look
like); and rounds of 8 requests that drain to 5 (drafting loses at 8, gains a few percent at 5,
and entering a length with drafts costs a draft model's catch-up). No model and no device; a few seconds.

``--text`` adds a scenario whose acceptance is read from real text instead of drawn: the draft
model on the held-out prompts of ``spec_decode.py`` (its defaults: 16 prompts of 256 tokens, 64-192
output tokens each). The target's greedy continuations are generated on the CPU, and the draft
model's greedy token at each output position, given the true text before it (which is what it
drafts from while every earlier draft is accepted), says whether a draft there is accepted; a step
at length n from a position accepts the run of right drafts that starts there, n at most. The
texts follow one another as batch 1 decodes them, again and again for ``--steps`` steps. Step costs
(``--costs``, ms a step at lengths 0..K, and ``--entering``, ms more for the first step of a run at
a length, 0 and the rest) default to what the H200 measured for the default models at batch 1 with
the draft model (docs/benchmarks.md, sixth session of 2026-12-03: 0.343 and 0.567 ms at lengths 0
and 3, lengths 1 and 2 in between; a first step at 3 cost 1.5 ms more, at 0 0.4 ms). About a
minute on the CPU.

    python benchmarks/policy_simulation.py
    python benchmarks/policy_simulation.py --text
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_speculation_policy import (CATCH_UP, DRAIN, DRAIN_ALPHA, K, LARGE, ROUND, SMALL, Machine,  # noqa: E402
                                     expected_rate, policy)


def share_of_best(batch: int, alpha: float, seconds: dict[int, float], steps: int, seed: int,
                  warm_up: bool = False) -> float:
    m = Machine(policy(), seed=seed)
    if warm_up:
        m.run(12, batch, alpha, {n: s * (2.5 if n else 1.0) for n, s in seconds.items()})
    m.run(steps, batch, alpha, seconds)
    best = max(range(K + 1), key=lambda n: expected_rate(alpha, seconds, n))
    return m.tokens / m.seconds / (batch * expected_rate(alpha, seconds, best))


def drain_share(seed: int, cycles: int = 20) -> float:
    """Rounds of 186 steps at 8 requests, each draining for 30 steps at 5 (``ROUND``, ``DRAIN``,
    entering a length with drafts ``CATCH_UP``): the policy's tokens per second as a share of
    the best fixed length's."""
    from specloop.kernel.config import EngineConfig
    from specloop.proposers.policy import FixedPolicy

    rates = {}
    for name in ("adaptive", *range(K + 1)):
        if name == "adaptive":
            p = policy()
        else:
            p = FixedPolicy(EngineConfig())
            p.k = name
        m = Machine(p, seed=seed)
        for _ in range(cycles):
            m.run(186, 8, DRAIN_ALPHA, ROUND, entering=CATCH_UP)
            m.run(30, 5, DRAIN_ALPHA, DRAIN, entering=CATCH_UP)
        rates[name] = m.tokens / m.seconds
    return rates["adaptive"] / max(rates[n] for n in range(K + 1))


def draft_matches(model: str, draft: str) -> list[list[bool]]:
    """Per held-out prompt (``spec_decode.py``'s defaults): whether the draft model's greedy
    token, given the true text before it, is the target's at each output position."""
    import argparse as _argparse

    from spec_decode import heldout_prompts, output_lengths

    from specloop import LLM, SamplingParams
    from specloop.frontend.tokenizer import Tokenizer

    defaults = _argparse.Namespace(output_len=128, output_len_spread=0.5, seed=0)
    prompts = heldout_prompts(Tokenizer(model), 16, 256, 0)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lengths(defaults, 16)]
    target = LLM(model, skip_tokenizer_init=True, device="cpu", max_model_len=512)
    texts = [list(o.outputs[0].token_ids) for o in target.generate([{"prompt_token_ids": p} for p in prompts],
                                                                      greedy, use_tqdm=False)]
    del target
    ranks = LLM(draft, skip_tokenizer_init=True, device="cpu", max_model_len=512)
    scored = ranks.generate([{"prompt_token_ids": p + t} for p, t in zip(prompts, texts)],
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    del ranks
    return [[o.prompt_logprobs[len(p) + j][t[j]].rank == 1 for j in range(len(t))]
            for p, t, o in zip(prompts, texts, scored)]


class Text:
    """Batch 1 reading ``matches`` (texts one after another, in a loop): a step with ``drafts``
    accepts the run of right drafts from the current position, and moves past it and its own
    token."""

    def __init__(self, matches: list[list[bool]]) -> None:
        self.matches, self.text, self.pos = matches, 0, 0

    def __call__(self, rid: str, drafts: int) -> int:
        m = self.matches[self.text]
        accepted = 0
        while accepted < drafts and self.pos + accepted < len(m) and m[self.pos + accepted]:
            accepted += 1
        self.pos += accepted + 1
        if self.pos >= len(m):
            self.text, self.pos = (self.text + 1) % len(self.matches), 0
        return accepted


def text_scenario(args: argparse.Namespace) -> None:
    matches = draft_matches(args.model, args.draft_model)
    costs = [float(c) * 1e-3 for c in args.costs.split(",")]
    if len(costs) == 2:  # lengths between 0 and K: linear
        costs = [costs[0] + (costs[1] - costs[0]) * n / K for n in range(K + 1)]
    seconds = dict(enumerate(costs))
    first = [float(c) * 1e-3 for c in args.entering.split(",")]
    entering = {n: first[0] if n == 0 else first[1] for n in range(K + 1)}
    print(f"draft model on held-out text: {sum(map(len, matches))} output tokens, "
          f"{sum(map(sum, matches)) / sum(map(len, matches)):.3f} of positions drafted right")
    rates = {}
    for name in [*range(K + 1), "adaptive"]:
        runs = []
        for seed in range(args.seeds):
            m = Machine(policy(), seed=seed)
            if name != "adaptive":
                m.p.drafting = lambda req_ids, n=name: n
            m.run(args.steps, 1, Text(matches), seconds, switch=1.0, entering=entering)
            runs.append((m.tokens / m.seconds, m.lengths))
        rates[name] = statistics.mean(r for r, _ in runs)
        lengths = [n for _, chosen in runs for n in chosen]
        share = " ".join(f"{n}: {lengths.count(n) / len(lengths):.2f}" for n in range(K + 1))
        label = f"fixed {name}" if name != "adaptive" else "adaptive"
        print(f"  {label:<9} {rates[name] / rates[0]:.3f}x no drafts   lengths run: {share}")
    best = max(rates[n] for n in range(K + 1))
    print(f"  adaptive: {rates['adaptive'] / best:.3f} of the best fixed length")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--long-steps", type=int, default=65536, help="steps of the scenario whose drafts lose")
    parser.add_argument("--text", action="store_true", help="add the scenario read from real text")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--model", default=os.path.join(root, "default_models", "specloop-tiny"))
    parser.add_argument("--draft-model", default=os.path.join(root, "default_models", "specloop-tiny-draft"))
    parser.add_argument("--costs", default="0.343,0.567", help="ms a step at lengths 0..K (or 0 and K)")
    parser.add_argument("--entering", default="0.4,1.5", help="ms more for a run's first step: at 0, at the rest")
    args = parser.parse_args()
    scenarios = [("batch 1, acceptance 0.7", 1, 0.7, SMALL, False), ("batch 1, acceptance 0.3", 1, 0.3, SMALL, False),
                 ("batch 32, acceptance 0.7", 32, 0.7, LARGE, False), ("batch 32, acceptance 0.3", 32, 0.3, LARGE, False),
                 ("warm-up (batch 1, 0.7)", 1, 0.7, SMALL, True)]
    for name, batch, alpha, seconds, warm_up in scenarios:
        shares = [share_of_best(batch, alpha, seconds, args.steps, seed, warm_up) for seed in range(args.seeds)]
        print(f"{name:<26} {statistics.mean(shares):.3f} of the best fixed length "
              f"(seeds: {' '.join(f'{s:.3f}' for s in shares)})")
    # Drafts that lose (Medusa on the default models: every length 4-5x a plain step, little
    # accepted), over a long run: what the probes of lengths far behind cost in the end.
    losing = {0: 1.0e-3, 1: 4.0e-3, 2: 4.5e-3, 3: 5.0e-3}
    shares = [share_of_best(1, 0.05, losing, args.long_steps, seed) for seed in range(args.seeds)]
    print(f"{'drafts that lose, long run':<26} {statistics.mean(shares):.3f} of the best fixed length "
          f"(seeds: {' '.join(f'{s:.3f}' for s in shares)})")
    shares = [drain_share(seed) for seed in range(args.seeds)]
    print(f"{'rounds of 8 draining to 5':<26} {statistics.mean(shares):.3f} of the best fixed length "
          f"(seeds: {' '.join(f'{s:.3f}' for s in shares)})")
    if args.text:
        text_scenario(args)


if __name__ == "__main__":
    main()

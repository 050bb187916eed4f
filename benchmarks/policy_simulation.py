"""The adaptive speculation policy against the simulated machine of its tests
(``tests/test_speculation_policy.py``, ``Machine``): committed tokens per second as a share of
the best fixed length's, exploration included, averaged over ``--seeds`` runs of ``--steps`` steps.

Scenarios: batch 1 (drafting pays, best K = 3 at acceptance 0.7 and K = 1 at 0.3) and batch 32
(compute-bound, no drafting pays), each at acceptance 0.7 and 0.3; and ``warm-up``: batch 1 at 0.7
whose first 12 steps at K cost 2.5 times their due (what a fresh engine's first steps can look
like). No model and no device; a few seconds.

    python benchmarks/policy_simulation.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from test_speculation_policy import K, LARGE, SMALL, Machine, expected_rate, policy  # noqa: E402


def share_of_best(batch: int, alpha: float, seconds: dict[int, float], steps: int, seed: int,
                  warm_up: bool = False) -> float:
    m = Machine(policy(), seed=seed)
    if warm_up:
        m.run(12, batch, alpha, {n: s * (2.5 if n else 1.0) for n, s in seconds.items()})
    m.run(steps, batch, alpha, seconds)
    best = max(range(K + 1), key=lambda n: expected_rate(alpha, seconds, n))
    return m.tokens / m.seconds / (batch * expected_rate(alpha, seconds, best))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    scenarios = [("batch 1, acceptance 0.7", 1, 0.7, SMALL, False), ("batch 1, acceptance 0.3", 1, 0.3, SMALL, False),
                 ("batch 32, acceptance 0.7", 32, 0.7, LARGE, False), ("batch 32, acceptance 0.3", 32, 0.3, LARGE, False),
                 ("warm-up (batch 1, 0.7)", 1, 0.7, SMALL, True)]
    for name, batch, alpha, seconds, warm_up in scenarios:
        shares = [share_of_best(batch, alpha, seconds, args.steps, seed, warm_up) for seed in range(args.seeds)]
        print(f"{name:<26} {statistics.mean(shares):.3f} of the best fixed length "
              f"(seeds: {' '.join(f'{s:.3f}' for s in shares)})")


if __name__ == "__main__":
    main()

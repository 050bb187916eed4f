"""Speculation policies: the adaptive policy's choices against a simulated machine and scripted
acceptances, and greedy outputs unchanged by whatever it chooses."""

from __future__ import annotations

import random
from typing import Callable

import pytest

from specloop import LLM, SamplingParams
from specloop.kernel.config import EngineConfig
from specloop.proposers.policy import AdaptivePolicy, FixedPolicy, StepObservation

K = 3


def policy(**kw) -> AdaptivePolicy:
    return AdaptivePolicy(EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                                           "policy": "adaptive"}), **kw)


class Machine:
    """Each draft is accepted with probability ``alpha`` (until the first rejection; a list: per
    draft position, given every earlier one was accepted; a function ``(request id, drafts) ->
    accepted``: whatever it says, e.g. read from a text); a step costs
    ``seconds[length]`` (+-20%, random), and a step whose length differs from the previous one's
    costs ``switch`` times as much plus ``entering[length]`` seconds (a pipeline drained, a proposer
    catching up). Reports to the policy as the runner's drafting stage does: the verified drafts of
    every step, and the time of a step the next one continued at its length (``first`` when the
    one before ran at another)."""

    def __init__(self, p: AdaptivePolicy, seed: int = 0) -> None:
        self.p, self.rng = p, random.Random(seed)
        self.lengths: list[int] = []
        self.tokens = self.seconds = 0.0

    def run(self, steps: int, batch: int, alpha: float | list[float] | Callable[[str, int], int],
            seconds: dict[int, float], switch: float = 2.0,
            entering: dict[int, float] | None = None) -> list[int]:
        ids = [f"r{i}" for i in range(batch)]
        chances = alpha if isinstance(alpha, list) else [alpha] * K

        def drawn(rid: str, drafts: int) -> int:
            accepted = 0
            while accepted < drafts and self.rng.random() < chances[accepted]:
                accepted += 1
            return accepted

        draw = alpha if callable(alpha) else drawn
        chosen = []
        last = None  # the previous step: (length, tokens, seconds)
        for _ in range(steps):
            n = self.p.drafting(ids)
            if last is not None and len(self.lengths) >= 2 and last[0] == n:
                self.p.observe_rate(n, batch, last[1], last[2], first=self.lengths[-2] != n)
            drafts = self.lengths[-1] if self.lengths else 0  # this step verifies the previous one's
            verified = []
            for rid in ids:
                verified.append((rid, drafts, draw(rid, drafts)))
            tokens = sum(1 + a for _, _, a in verified)
            self.p.observe(StepObservation(batch * (1 + drafts), 0.0, 0.0, n * batch, verified if drafts else []))
            switched = bool(self.lengths) and self.lengths[-1] != n
            sec = seconds[n] * self.rng.uniform(0.8, 1.2) * (switch if switched else 1)
            sec += (entering or {}).get(n, 0.0) if switched else 0.0
            self.lengths.append(n)
            chosen.append(n)
            self.tokens, self.seconds = self.tokens + tokens, self.seconds + sec
            last = (n, tokens, sec)
        return chosen


def expected_rate(alpha: float, seconds: dict[int, float], length: int) -> float:
    return sum(alpha ** i for i in range(length + 1)) / seconds[length]


# Seconds per step by speculation length: batch 1, where drafting pays most at K = 3 for acceptance
# 0.7, and batch 32, compute-bound, where every length with drafts is slower than none.
SMALL = {0: 1.0e-3, 1: 1.1e-3, 2: 1.2e-3, 3: 1.3e-3}
LARGE = {0: 2.0e-3, 1: 4.0e-3, 2: 6.0e-3, 3: 8.0e-3}


@pytest.mark.parametrize("batch, seconds, best", [(1, SMALL, 3), (32, LARGE, 0)], ids=["pays", "loses"])
def test_it_finds_the_fastest_length_and_keeps_within_a_few_percent_of_it(batch, seconds, best):
    m = Machine(policy())
    chosen = m.run(3000, batch, 0.7, seconds)
    assert max(range(K + 1), key=lambda n: expected_rate(0.7, seconds, n)) == best
    assert chosen[-1000:].count(best) > 900
    # Exploring every length first and probing the others since included.
    assert m.tokens / m.seconds > 0.95 * batch * expected_rate(0.7, seconds, best)


def test_it_probes_k_then_0_and_interpolates_the_lengths_between():
    p = policy(probe_len=4)
    # Acceptance 0.9: K is clearly best (at 0.7 length 2 is within 6% of it, closer than these
    # few steps, each +-20%, can tell apart).
    chosen = Machine(p).run(96, 1, 0.9, SMALL)
    # K then 0 in warm-up (steps 1-8; their times, reported up to 6 steps later, dropped), then
    # K and 0 measured; it settles on K (weighing the lengths again every 8 steps), length 1 never
    # run.
    assert chosen[:20] == [K] * 4 + [0] * 4 + [K] * 8 + [0] * 4 and chosen[-32:] == [K] * 32 and 1 not in chosen
    s0, s3 = p.step_time(1, 0)[0], p.step_time(1, K)[0]
    assert p.step_times(1)[1] == (pytest.approx(s0 + (s3 - s0) / 3), 0.0)


def test_it_weighs_the_lengths_every_few_steps_or_when_the_batch_changes_bucket():
    p = policy()
    m = Machine(p)
    m.run(400, 1, 0.7, SMALL)
    weighed = []
    next_length = p._next_length
    p._next_length = lambda bucket, running=None: weighed.append(bucket) or next_length(bucket, running)
    m.run(160, 1, 0.7, SMALL)
    assert 0 < len(weighed) <= 160 // p.recheck + 2, len(weighed)  # (a probe's first step is weighed too)
    weighed.clear()
    p.drafting([f"r{i}" for i in range(32)])
    assert weighed == [6]


def test_lengths_far_behind_take_turns_at_one_probe_each_max_interval():
    # Drafts that lose: every length costs 4-5x a step without drafts for almost no accepted token.
    dear = {0: 1.0e-3, 1: 4.0e-3, 2: 4.5e-3, 3: 5.0e-3}
    p = policy()
    m = Machine(p)
    chosen = m.run(8 * p.max_interval, 1, 0.05, dear)
    starts = [(n, i) for i, n in enumerate(chosen) if n and i > 300 and chosen[i - 1] != n]
    assert len(starts) <= 8 and {n for n, _ in starts} == {1, 2, 3}, starts
    assert all(b - a >= p.max_interval for (_, a), (_, b) in zip(starts, starts[1:])), starts
    assert m.tokens / m.seconds > 0.97 / dear[0]


def test_probes_of_lengths_far_behind_space_out_while_they_find_nothing():
    """Each far probe that leaves the best length as it was makes the next come twice as late, up
    to ``far_backoff`` times ``max_interval`` (what ``probe_cost`` allows these lengths is more);
    when drafting pays again, the next such probe finds it and the policy returns to K."""
    dear = {0: 1.0e-3, 1: 4.0e-3, 2: 4.5e-3, 3: 5.0e-3}
    p = policy()
    m = Machine(p)
    chosen = m.run(40 * p.max_interval, 1, 0.05, dear)
    starts = [i for i, n in enumerate(chosen) if n and i > 300 and chosen[i - 1] != n]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    cap = p.far_backoff * p.max_interval
    assert all(b >= a for a, b in zip(gaps, gaps[1:])), gaps
    assert gaps[0] < 2 * p.max_interval and cap <= gaps[-1] < cap + p.max_interval, gaps
    assert m.tokens / m.seconds > 0.99 / dear[0]
    cheap = {0: 1.0e-3, 1: 1.1e-3, 2: 1.2e-3, 3: 1.3e-3}
    chosen = m.run(cap + 4 * p.max_interval, 1, 0.8, cheap)
    back = next(i for i, n in enumerate(chosen) if n == K)
    assert back <= cap + p.max_interval and chosen[-256:] == [K] * 256, back
    assert p.far_every[1] == p.max_interval  # a new best length: far probes start over


def test_probes_of_lengths_that_lose_share_one_budget():
    """Medusa-like drafts on the default model (acceptance 0.37 / 0.35 / 0.45 by position, as
    measured on the H200): every length with drafts is 20-30% slower than none. The probes of the
    three lengths together cost about ``probe_cost`` of the time, not that much each (1.5% lost
    when each length had the whole budget)."""
    costs = {0: 0.62e-3, 1: 1.15e-3, 2: 1.17e-3, 3: 1.08e-3}
    for seed in range(2):
        m = Machine(policy(), seed=seed)
        chosen = m.run(20000, 1, [0.37, 0.35, 0.45], costs)
        assert m.tokens / m.seconds > 0.99 / costs[0], m.tokens / m.seconds * costs[0]
        assert chosen[-10000:].count(0) > 9900


def test_each_batch_size_has_its_own_choice():
    m = Machine(policy())
    m.run(2000, 1, 0.7, SMALL)
    m.run(2000, 32, 0.7, LARGE)
    # Each kept its own measurements (the lengths overdue for a probe come first).
    assert m.run(200, 1, 0.7, SMALL).count(3) > 150
    assert m.run(200, 32, 0.7, LARGE).count(0) > 150


def test_probes_run_their_steps_out_when_the_batch_crosses_buckets():
    """A batch of 31 or 32 requests (one finished, the next not yet admitted) crosses between two
    buckets every few steps: a probe still runs ``probe_len`` steps, rather than one step per
    crossing that measures nothing and is tried again at the next."""
    m = Machine(policy())
    for _ in range(400):
        m.run(3, 31, 0.7, LARGE)
        m.run(3, 32, 0.7, LARGE)
    runs: list[list[int]] = []
    for n in m.lengths:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    assert all(count >= 8 for n, count in runs[:-1] if n)
    assert m.lengths[-1200:].count(0) > 1100


def test_a_full_batch_that_dips_by_a_request_keeps_its_length():
    """Trained at 32 requests (drafting does not pay), a batch of 31 between batches of 32 (a
    request finished, the next not yet admitted) runs the same length: not the one its own bucket
    (16-31) would pick, for one step, a switch each way."""
    p = policy(max_interval=1 << 20, min_interval=1 << 20)
    m = Machine(p)
    m.run(2000, 32, 0.7, LARGE)
    m.run(500, 1, 0.7, SMALL)  # teaches the smaller buckets (by borrowing) that drafting pays
    m.run(200, 32, 0.7, LARGE)
    full = [f"r{i}" for i in range(32)]
    chosen = [p.drafting(full[:31] if i % 3 == 0 else full) for i in range(60)]
    assert chosen == [0] * 60
    assert p.drafting(full[:20]) != 0  # a batch well inside the smaller bucket is that bucket's


def test_a_dip_below_a_full_batch_is_measured_where_it_decides():
    """The bucket a step's time joins is the one its batch read its length from: a batch of 7
    between batches of 8 decides in the 8s' bucket, so its time must not teach the 4-7 bucket
    (the drain at the end of a run) what a length costs there."""
    from specloop.proposers.policy import batch_bucket

    assert [batch_bucket(n) for n in (1, 2, 3, 4, 6, 7, 8, 14, 15, 16, 29, 30, 31, 32)] == \
        [1, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6, 6]
    p = policy(warmup=0)
    p.observe_rate(0, 7, 7, 1.2e-3)
    p.observe_rate(2, 5, 6, 1.25e-3)
    assert p.step_time(batch_bucket(8), 0) == (1.2e-3, 1.0)
    assert p.step_time(batch_bucket(5), 0) is None and p.step_time(batch_bucket(5), 2) == (1.25e-3, 1.0)


def test_a_new_batch_size_starts_from_the_nearest_one_measured():
    p = policy()
    Machine(p).run(2000, 1, 0.7, SMALL)
    assert [p.drafting(["a", "b"]) for _ in range(32)] == [3] * 32  # bucket 2 borrows bucket 1's times


def test_it_follows_the_text_when_acceptance_falls_and_comes_back():
    m = Machine(policy())
    m.run(1000, 1, 0.7, SMALL)
    assert m.run(500, 1, 0.02, SMALL)[-200:].count(0) > 180  # drafting stopped once it did not pay
    assert m.run(3000, 1, 0.7, SMALL)[-1000:].count(3) > 900  # a probe saw them pay again


def test_hard_stretches_of_text_do_not_hold_it_at_a_shorter_length():
    """Text alternates between easy stretches (every draft likely right: K is best) and hard ones
    where only the first draft often is (length 1 is best), and entering a length with drafts
    costs three steps' time. At length 1 the deeper positions go untried; they must follow the
    first position back up when the text turns easy, not hold the hard stretch's figures (which
    kept the policy at length 1 through most easy stretches: 0.78-0.89 of the best fixed length)."""
    easy, hard = [0.85] * K, [0.5, 0.1, 0.1]
    phases = [(300, easy), (100, hard)] * 15
    entering = {n: 3 * SMALL[0] if n else 0.0 for n in SMALL}

    def rate(n: int) -> float:  # committed tokens per second over the whole text at fixed length n
        tokens = 0.0
        for steps, chances in phases:
            reach, expected = 1.0, 1.0
            for c in chances[:n]:
                reach *= c
                expected += reach
            tokens += steps * expected
        return tokens / (len(phases) // 2 * 400 * SMALL[n])

    for seed in range(3):
        m = Machine(policy(), seed=seed)
        for steps, chances in phases:
            m.run(steps, 1, chances, SMALL, entering=entering)
        assert m.tokens / m.seconds > 0.93 * max(rate(n) for n in range(K + 1))


def test_a_dear_warm_up_does_not_keep_it_off_a_length():
    """The engine's first steps at K cost 2.5 times their due (kernels compiled, graphs replayed for
    the first time): dropped as warm-up, they do not keep the policy off K."""
    for seed in range(3):
        m = Machine(policy(), seed=seed)
        m.run(12, 1, 0.7, {n: s * (2.5 if n else 1.0) for n, s in SMALL.items()})
        chosen = m.run(3000, 1, 0.7, SMALL)
        assert chosen[-2000:].count(K) > 1800


def test_a_dear_switch_makes_probes_rarer():
    """Entering a length with drafts costs 20 steps' time (a draft model catching up on the tokens
    it skipped): measured, it spaces the probes of that length out."""
    entering = {n: 20 * LARGE[0] if n else 0.0 for n in LARGE}
    spaced = dict(max_interval=1 << 20)  # probes as far apart as their cost allows
    cheap, dear = Machine(policy(**spaced)), Machine(policy(**spaced), seed=1)
    cheap.run(20000, 32, 0.7, LARGE)
    dear.run(20000, 32, 0.7, LARGE, entering=entering)
    assert dear.lengths[-16000:].count(0) > cheap.lengths[-16000:].count(0)
    assert dear.tokens / dear.seconds > 0.95 * 32 * expected_rate(0.7, LARGE, 0)


# Rounds of 8 requests draining to 5 (the draft model's batch-8 runs on the H200): drafting loses
# at 8, gains a few percent at 5; entering a length with drafts costs a catch-up of 7.7 ms.
ROUND = {0: 0.45e-3, 1: 0.8e-3, 2: 1.15e-3, 3: 1.52e-3}
DRAIN = {0: 0.42e-3, 1: 0.55e-3, 2: 0.68e-3, 3: 0.80e-3}
CATCH_UP = {0: 0.4e-3, 1: 7.7e-3, 2: 7.7e-3, 3: 7.7e-3}
DRAIN_ALPHA = [0.6, 0.45, 0.38]


def test_a_drain_does_not_enter_a_length_for_a_few_steps_gain():
    """Rounds of 8 requests (drafting loses) that end draining to 5 (a length with drafts gains a
    few percent there), entering a length with drafts costing 17 steps (a draft model catching up
    on what it skipped): the drain keeps the length the full batch ran, as the switch never pays
    for itself in the drain's few steps. (Weighed only within its bucket, each drain entered the
    drain bucket's own length, the batch-8 runs of the draft model on the H200: ``0x186 3x91``.)"""
    full, drain, entering, alpha = ROUND, DRAIN, CATCH_UP, DRAIN_ALPHA
    for seed in (0, 2):
        m, zero = Machine(policy(), seed=seed), Machine(FixedPolicy(EngineConfig()), seed=seed)
        entered = 0
        for cycle in range(40):
            for machine in (m, zero):
                machine.run(186, 8, alpha, full, entering=entering)
            first = m.run(30, 5, alpha, drain, entering=entering)[0]
            entered += cycle >= 2 and first != 0  # (the first drains explore)
            zero.run(30, 5, alpha, drain, entering=entering)
        assert entered <= 8, (seed, entered)
        assert m.tokens / m.seconds > 0.96 * zero.tokens / zero.seconds, seed


def test_one_dear_entry_does_not_keep_it_off_a_length():
    """The first step of the first run at K after warm-up costs half a second (a kernel compiled
    for the proposer's first catch-up over skipped steps): K is probed again within
    ``max_interval`` steps, the cheap entry restarts its estimate, and the policy returns to K."""
    for seed in range(3):
        m = Machine(policy(), seed=seed)
        m.run(40, 1, 0.7, SMALL, entering={K: 0.5})
        chosen = m.run(5000, 1, 0.7, SMALL)
        assert chosen[-2000:].count(K) > 1800, seed


def test_it_follows_the_machine_when_the_costs_change():
    m = Machine(policy())
    m.run(2000, 1, 0.7, SMALL)
    # Steps with drafts became 2.5 times as dear (e.g. another tenant on the GPU).
    dear = {n: s * (2.5 if n else 1.0) for n, s in SMALL.items()}
    chosen = m.run(3000, 1, 0.7, dear)
    assert chosen[-500:].count(0) > 450


def test_a_length_measured_elsewhere_is_scaled_by_one_measured_in_both():
    p = policy(warmup=0)
    for _ in range(20):
        p.observe_rate(0, 1, 1, 1.0e-3)  # batch 1: 1 ms a step without drafts, 1.5 ms with 3
        p.observe_rate(3, 1, 2, 1.5e-3)
        p.observe_rate(0, 32, 32, 2.0e-3)  # batch 32: 2 ms without drafts; 3 not measured
    assert p.step_times(6)[3] == (pytest.approx(3.0e-3), 0.0)
    assert p.step_times(6)[0] == (pytest.approx(2.0e-3), pytest.approx(sum(0.98 ** i for i in range(20))))


def test_one_paused_step_barely_moves_its_lengths_step_time():
    p = policy(warmup=0)
    for _ in range(20):
        p.observe_rate(0, 1, 1, 1.0e-3)
    p.observe_rate(0, 1, 1, 0.5)  # a half-second collection inside one step
    seconds, _ = p.step_time(1, 0)
    assert 1.0e-3 < seconds < 1.25e-3


def test_the_drafting_stage_reports_a_step_once_its_tokens_are_known():
    """Under asynchronous scheduling a step's tokens may be known only after the next step began
    (a sampling thread); its rate is reported then, with its own request count, unless it admitted
    requests (their prefill costs every length alike) or the step after it holds only new requests
    (the engine may have waited for them); the first step of a run is marked, the second not
    reported (the pipeline refills)."""
    from types import SimpleNamespace

    from specloop.backends.drafting import DraftingStage

    class Recorder:
        def __init__(self):
            self.lengths, self.rates = [0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2], []

        def drafting(self, req_ids):
            return self.lengths.pop(0)

        def observe_rate(self, length, num_reqs, tokens, seconds, first=False):
            self.rates.append((length, num_reqs, tokens, first))

    policy = Recorder()
    stage = DraftingStage(SimpleNamespace(catches_up=True), policy,
                          EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}))
    def plan(i, n):
        new = [f"r{j}" for j in range(n)] if i == 3 else [f"r{n - 1}"] if i == 4 else []
        return SimpleNamespace(num_scheduled_tokens={f"r{j}": 1 for j in range(n)}, scheduled_spec_decode_tokens={},
                               scheduled_new_reqs=new, scheduled_resumed_reqs=[])

    plans = [plan(i, n) for i, n in enumerate((4, 4, 4, 4, 5, 5, 5, 5, 5, 6, 6))]
    records = []
    for n, plan in enumerate(plans):
        records.append(stage.begin_step(plan))
        if n >= 1:  # the previous step's tokens arrive while this one runs
            records[n - 1].tokens = 10 + n - 1
    # Steps 2 and 3 sat amid steps of length 0, but step 3 holds only new requests: the engine may
    # have idled before it, so step 2 is not reported; nor is step 3, which admitted them; step 4
    # ends the run of length 0; 5 is the first of length 2 (its time includes the switch; reported
    # two steps after it began, once its tokens came), 6 the second (not reported), 7 and 8 sat
    # amid length 2; 9's tokens come only after the last step began.
    assert policy.rates == [(2, 5, 15, True), (2, 5, 17, False), (2, 5, 18, False)]


def test_the_drafting_stage_does_not_measure_a_step_whose_next_one_admits():
    """A step's interval runs from its sampling to the next step's, and so holds the next step's
    forward: when that step admits a request, its prefill is in the interval, at whatever length
    both ran."""
    from types import SimpleNamespace

    from specloop.backends.drafting import DraftingStage

    class Recorder:
        def __init__(self):
            self.rates = []

        def drafting(self, req_ids):
            return 0

        def observe_rate(self, length, num_reqs, tokens, seconds, first=False):
            self.rates.append((num_reqs, tokens))

    policy = Recorder()
    stage = DraftingStage(SimpleNamespace(catches_up=True), policy,
                          EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}))
    sizes = (8, 8, 8, 8, 7, 8, 8, 8, 8, 8)  # step 4: a request finished; step 5 admits its replacement
    records = []
    for i, n in enumerate(sizes):
        plan = SimpleNamespace(num_scheduled_tokens={f"r{j}": 1 for j in range(n)}, scheduled_spec_decode_tokens={},
                               scheduled_new_reqs=["r7"] if i == 5 else [], scheduled_resumed_reqs=[])
        records.append(stage.begin_step(plan))
        if i >= 1:
            records[i - 1].tokens = 100 + i - 1
    # Steps 0 and 1 begin the run (not reported until two steps of it sat before); 4 precedes an
    # admission, 5 admits; 8's tokens come after the last step began, 9 has no next step.
    assert policy.rates == [(8, 102), (8, 103), (8, 106), (8, 107)]


def test_fixed_policy():
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    p = FixedPolicy(cfg)
    assert p.choose(["a", "b"], 3) == [3, 3] and p.choose(["a"], 1) == [1]
    assert all(p.drafting(["a"]) == 3 for _ in range(100))


@pytest.mark.parametrize("policy_name", ["adaptive", "fixed"])
def test_greedy_output_is_unchanged_by_the_policy(policy_name):
    prompts = ["def read(path):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, item):"] * 2
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = LLM(block_size=4, num_kv_blocks=60, max_model_len=96)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.core.shutdown()
    spec = LLM(block_size=4, num_kv_blocks=60, max_model_len=96,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "policy": policy_name})
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    metrics = spec.get_metrics()
    spec.core.shutdown()
    assert got == want and metrics["spec_num_drafts"] > 0


@pytest.mark.parametrize("alpha", [0.3, 0.8])
def test_controlled_proposer_accepts_at_alpha(alpha):
    prompts = ["def read(path):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, item):",
               "for key, value in", "    return self._", "if __name__ == '__main__':\n"]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    engine = dict(block_size=4, num_kv_blocks=150, max_model_len=96)
    plain = LLM(**engine)
    outs = plain.generate(prompts, params, use_tqdm=False)
    plain.core.shutdown()
    truth = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outs}
    spec = LLM(**engine, plugin_options={"controlled": {"continuations": truth}},
               speculative_config={"method": "controlled", "extra": {"wraps": "ngram", "alpha": alpha},
                                   "num_speculative_tokens": 3})
    got = spec.generate(prompts, params, use_tqdm=False)
    m = spec.get_metrics()
    diverged = spec.core.runner.drafter.proposer.diverged
    spec.core.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in outs]
    assert not diverged
    per_pos = [n / m["spec_num_drafts"] for n in m["spec_num_accepted_tokens_per_pos"]]
    assert m["spec_num_drafts"] > 60
    # Position i is accepted when it and every draft before it were right: alpha ** (i + 1).
    for i, rate in enumerate(per_pos[:2]):
        assert abs(rate - alpha ** (i + 1)) < 0.12, (i, rate)


def test_controlled_proposer_stops_drafting_a_request_off_its_continuation():
    """A request whose output leaves its recorded continuation gets no more drafts and is
    reported; the others draft on, and outputs are the target's."""
    prompts = ["def read(path):\n", "import os\nimport sys\n"]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = dict(block_size=4, num_kv_blocks=80, max_model_len=96)
    plain = LLM(**engine)
    outs = plain.generate(prompts, params, use_tqdm=False)
    plain.core.shutdown()
    truth = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in outs}
    wrong = tuple(outs[0].prompt_token_ids)
    truth[wrong][10] = (truth[wrong][10] + 1) % 100  # as if the recording run had picked another token
    spec = LLM(**engine, plugin_options={"controlled": {"continuations": truth}},
               speculative_config={"method": "controlled", "extra": {"wraps": "ngram", "alpha": 1.0},
                                   "num_speculative_tokens": 3})
    seen = []
    proposer = spec.core.runner.drafter.proposer
    propose = proposer.propose

    def recording(inputs):
        proposal = propose(inputs)
        seen.extend(zip(inputs.req_ids, [len(t) - int(n) for t, n in zip(inputs.token_ids, inputs.num_prompt_tokens)],
                        map(len, proposal.draft_token_ids)))
        return proposal

    proposer.propose = recording
    got = spec.generate(prompts, params, use_tqdm=False)
    diverged = set(proposer.diverged)
    spec.core.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in outs]
    first, second = (o.request_id for o in got)
    assert diverged == {first}
    assert all(n == 0 for rid, done, n in seen if rid == first and done > 11)  # past the bad token
    assert any(n > 0 for rid, done, n in seen if rid == second and done > 11)

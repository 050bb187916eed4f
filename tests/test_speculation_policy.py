"""Speculation policies: the adaptive policy's choices on scripted costs and acceptances, and greedy
outputs unchanged by whatever it chooses."""

from __future__ import annotations

import random

import pytest

from specloop import LLM, SamplingParams
from specloop.kernel.config import EngineConfig
from specloop.proposers.policy import AdaptivePolicy, FixedPolicy, StepObservation

K = 4


def policy(**kw) -> AdaptivePolicy:
    return AdaptivePolicy(EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                                           "policy": "adaptive"}), **kw)


def feed(p: AdaptivePolicy, acceptance: dict[str, float], a: float, b: float, draft_cost: float,
         steps: int = 40, seed: int = 0) -> None:
    """Steps where every request verifies K drafts, each accepted with its probability until the
    first rejection, and a step of T tokens costs a + b * T seconds."""
    rng = random.Random(seed)
    for n in range(steps):
        verified = []
        for rid, prob in acceptance.items():
            accepted = 0
            while accepted < K and rng.random() < prob:
                accepted += 1
            verified.append((rid, K, accepted))
        tokens = len(acceptance) * (K + 1) - (n % 3) * len(acceptance)  # vary T so b is identifiable
        p.observe(StepObservation(tokens, a + b * tokens, draft_cost * K * len(acceptance), K * len(acceptance),
                                  verified))


def test_until_warm_it_asks_for_the_limit():
    p = policy(warmup=8)
    assert p.choose(["a", "b"], K) == [K, K] and p.choose(["a"], 2) == [2]


def test_cheap_steps_and_high_acceptance_draft_fully():
    p = policy()
    feed(p, {"a": 0.9, "b": 0.85}, a=5e-3, b=2e-6, draft_cost=1e-5)
    assert p.choose(["a", "b"], K) == [K, K]


def test_low_acceptance_turns_speculation_off():
    p = policy(explore_every=1000)
    feed(p, {"a": 0.05}, a=5e-3, b=2e-4, draft_cost=2e-4)
    assert p.choose(["a"], K) == [0]


def test_each_request_gets_its_own_count():
    p = policy(explore_every=1000)
    feed(p, {"good": 0.9, "bad": 0.05}, a=5e-3, b=1e-4, draft_cost=1e-4)
    good, bad = p.choose(["good", "bad"], K)
    assert good >= 3 and bad == 0


def test_it_backs_off_when_the_step_is_compute_bound():
    # The same acceptance; tokens cost 50x more per token (a large, compute-bound batch).
    cheap, dear = policy(explore_every=1000), policy(explore_every=1000)
    rates = {f"r{i}": 0.6 for i in range(32)}
    feed(cheap, rates, a=5e-3, b=1e-6, draft_cost=1e-6)
    feed(dear, rates, a=5e-3, b=1e-3, draft_cost=1e-6)
    assert sum(cheap.choose(list(rates), K)) > 2 * sum(dear.choose(list(rates), K))
    assert sum(dear.choose(list(rates), K)) < len(rates)  # most requests stop speculating


def test_a_request_turned_off_is_explored_again():
    p = policy(explore_every=4)
    feed(p, {"a": 0.05}, a=5e-3, b=2e-4, draft_cost=2e-4)
    choices = [p.choose(["a"], K)[0] for _ in range(8)]
    assert choices.count(0) >= 5 and choices.count(1) >= 1


def test_fixed_policy():
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    p = FixedPolicy(cfg)
    assert p.choose(["a", "b"], 3) == [3, 3] and p.choose(["a"], 1) == [1]
    assert all(p.drafting(["a"]) for _ in range(100))


def _rated(with_drafts: float, without: float) -> AdaptivePolicy:
    """Warm, drafting paying by the cost model, and these measured tokens per second."""
    p = policy(explore_every=1000, probe_every=16, probe_len=4)
    feed(p, {"a": 0.9, "b": 0.85}, a=5e-3, b=2e-6, draft_cost=1e-5)
    for _ in range(10):
        p.observe_rate(True, 100, 100 / with_drafts)
        p.observe_rate(False, 100, 100 / without)
    return p


def test_it_drafts_nothing_while_steps_without_drafts_are_faster():
    """Steps with drafts run synchronously; when steps without them (overlapped) commit more
    tokens per second, the policy turns drafting off, probing it in short runs to notice a change."""
    p = _rated(with_drafts=1000.0, without=1500.0)
    assert not p.drafting_pays()
    decisions = []
    for _ in range(32):
        on = p.drafting(["a", "b"])
        decisions.append(on)
        assert p.choose(["a", "b"], K) == ([K, K] if on else [0, 0])  # a probe drafts what the plan says
    # Probes of steps with drafts: steps 1-3, 16-19 and 32 (phase < 4 of every 16).
    assert [i + 1 for i, on in enumerate(decisions) if on] == [1, 2, 3, 16, 17, 18, 19, 32]


def test_it_drafts_while_drafting_is_faster_and_probes_the_other_kind():
    p = _rated(with_drafts=2000.0, without=1000.0)
    assert p.drafting_pays()
    decisions = [p.drafting(["a", "b"]) for _ in range(32)]
    assert [i + 1 for i, on in enumerate(decisions) if not on] == [1, 2, 3, 16, 17, 18, 19, 32]
    # The measured rates follow the machine: steps without drafts get faster, drafting turns off.
    for _ in range(30):
        p.observe_rate(False, 100, 100 / 4000.0)
    assert not p.drafting_pays()


def test_a_probe_drafts_even_what_the_plan_would_not():
    p = policy(explore_every=1000, probe_every=16, probe_len=4)
    feed(p, {"a": 0.05}, a=5e-3, b=2e-4, draft_cost=2e-4)  # low acceptance: the plan drafts nothing
    p.observe_rate(True, 100, 1.0)
    p.observe_rate(False, 100, 0.5)
    decisions = [(p.drafting(["a"]), p.choose(["a"], K)[0]) for _ in range(17)]
    assert decisions[0] == (True, 1) and decisions[4] == (False, 0) and decisions[15] == (True, 1)


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

"""Speculative decoding end to end on tiny random checkpoints (the torch runner).

The oracle: greedy output with speculation is token-identical to greedy output without it, for the
n-gram proposer at K = 1..5 and for a draft model, under chunked prefill, prefix caching and forced
preemption; a draft model identical to the target accepts (nearly) everything; stops that fall
inside an accepted run cut tokens, text and logprobs exactly where decoding without drafts does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os

import hf_models
import numpy as np
import pytest
import torch
from tokenizer_helpers import build_tokenizer

from specloop import LLM, AsyncEngine, SamplingParams
from specloop.cli import build_parser, engine_kwargs
from specloop.kernel.config import EngineConfig
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.outputs import SpecDecodingStats
from specloop.kernel.plugins import PluginManager
from specloop.proposers.base import DraftProposal, ProposerInputs
from specloop.proposers.draft_model import DraftModelProposer
from specloop.proposers.policy import FixedPolicy
from specloop.plugins.spec_metrics import get_spec_metrics

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# Chunked prefill (budget 16 tokens a step), prefix caching, and a KV pool small enough that the
# batch cannot all fit: requests get preempted and recomputed.
STRESSED = dict(max_model_len=96, block_size=4, num_kv_blocks=30, max_num_batched_tokens=16,
                enable_prefix_caching=True, enable_chunked_prefill=True)
ROOMY = dict(max_model_len=256, block_size=8, num_kv_blocks=256)


@pytest.fixture(scope="module")
def target() -> hf_models.TinyModel:
    return hf_models.tiny("qwen3")


@pytest.fixture(scope="module")
def small_draft_hf(tmp_path_factory: pytest.TempPathFactory) -> hf_models.TinyModel:
    """A smaller Qwen3 (one layer, half the width) with the target's vocabulary."""
    import transformers

    config = transformers.Qwen3Config(**{**hf_models.COMMON, "hidden_size": 32, "intermediate_size": 64,
                                         "num_hidden_layers": 1, "num_attention_heads": 2,
                                         "num_key_value_heads": 1}, head_dim=16)
    torch.manual_seed(7)
    path = str(tmp_path_factory.mktemp("draft"))
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    model.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 3]}, f)
    return hf_models.TinyModel("draft", path, model)


@pytest.fixture(scope="module")
def small_draft(small_draft_hf: hf_models.TinyModel) -> str:
    return small_draft_hf.path


def prompt_set() -> list[list[int]]:
    """Random prompts, repetitive ones (where n-gram lookup hits), and prompts sharing prefixes."""
    base = hf_models.prompts(8, seed=11, min_len=3, max_len=30)
    repetitive = [[5, 6, 7, 8] * 6, [9, 10, 11] * 9, [40, 41] * 10 + [42]]
    shared = [base[0] + [100, 101, 102] * 4, base[0] + [7] * 5, base[1][:2] * 9]
    return base + repetitive + shared


def run(model_path: str, prompts: list[list[int]], params: SamplingParams, spec: dict | None = None,
        **engine: object) -> tuple[list, LLM]:
    llm = LLM(model_path, skip_tokenizer_init=True, speculative_config=spec, **{**ROOMY, **engine})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs, llm


@pytest.fixture(scope="module")
def reference(target: hf_models.TinyModel) -> list[list[int]]:
    outs, _ = run(target.path, prompt_set(), GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_ngram_greedy_is_identical(target, reference, k: int) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    outs, llm = run(target.path, prompt_set(), GREEDY, spec, **STRESSED)
    assert [o.outputs[0].token_ids for o in outs] == reference
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["prefix_cache_hits"] > 0
    assert metrics["spec_num_draft_tokens"] > 0 and metrics["spec_num_accepted_tokens"] > 0
    # Per-request counters add up to the engine's.
    assert sum(o.metrics.spec_num_draft_tokens for o in outs) == metrics["spec_num_draft_tokens"]
    assert sum(o.metrics.spec_num_accepted_tokens for o in outs) == metrics["spec_num_accepted_tokens"]


@pytest.mark.parametrize("k", [2, 4])
def test_draft_model_greedy_is_identical(target, small_draft, reference, k: int) -> None:
    spec = {"method": "draft_model", "model": small_draft, "num_speculative_tokens": k}
    outs, llm = run(target.path, prompt_set(), GREEDY, spec, **STRESSED)
    assert [o.outputs[0].token_ids for o in outs] == reference
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["spec_num_draft_tokens"] > 0


class SkippingPolicy(FixedPolicy):
    """Drafts in two steps of every five: the proposer (which catches up) skips the step that
    verifies its drafts and the ones after, so it learns of a rejection only from the tokens."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.steps = 0

    def drafting(self, req_ids) -> int:
        self.steps += 1
        return self.k if self.steps % 5 < 2 else 0

    def choose(self, req_ids, limit: int) -> list[int]:
        return [min(limit, self.k if self.steps % 5 < 2 else 0)] * len(req_ids)


@pytest.mark.parametrize("policy", ["fixed", "skipping"])
def test_draft_model_cache_follows_rollbacks(target, small_draft_hf, reference, policy: str) -> None:
    """Every greedy proposal equals transformers' greedy continuation of the draft model from the
    whole verified sequence: the draft's paged KV, rolled back after each rejection (also when the
    proposer skipped the steps since: ``skipping``) and rebuilt after each preemption, never serves
    a stale position."""
    checked: list[int] = []

    def hf_greedy(tokens: list[int], k: int) -> list[int]:
        ids = list(tokens)
        with torch.no_grad():
            for _ in range(k):
                ids.append(int(small_draft_hf.hf(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(tokens):]

    class CheckedDraftModel(DraftModelProposer):
        def propose(self, inputs: ProposerInputs) -> DraftProposal:
            proposal = super().propose(inputs)
            for tokens, drafts in zip(inputs.token_ids, proposal.draft_token_ids):
                if drafts:
                    assert drafts == hf_greedy(tokens.tolist(), len(drafts))
                    checked.append(len(drafts))
            return proposal

    class Plugin:
        @hookimpl
        def specloop_register_proposers(self, register) -> None:
            register("checked_draft", CheckedDraftModel)

        @hookimpl
        def specloop_register_speculation_policies(self, register) -> None:
            register("skipping", SkippingPolicy)

    spec = {"method": "checked_draft", "model": small_draft_hf.path, "num_speculative_tokens": 3,
            "policy": policy}
    llm = LLM(target.path, skip_tokenizer_init=True, speculative_config=spec,
              plugins=PluginManager([Plugin()], load_entrypoints=False), **{**ROOMY, **STRESSED})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_set()], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    metrics = llm.get_metrics()
    rejected = metrics["spec_num_draft_tokens"] - metrics["spec_num_accepted_tokens"]
    assert len(checked) > (50 if policy == "fixed" else 20) and rejected > 20
    assert metrics["num_preemptions"] > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_model_equal_to_target_accepts_everything(target, temperature: float) -> None:
    k = 3
    spec = {"method": "draft_model", "model": target.path, "num_speculative_tokens": k}
    params = SamplingParams(max_tokens=100, temperature=temperature, seed=5, ignore_eos=True)
    _, llm = run(target.path, prompt_set()[:6], params, spec)
    m = llm.get_metrics()
    assert m["spec_acceptance_rate"] >= 0.98
    assert m["spec_mean_acceptance_length"] >= 0.98 * (k + 1)
    stats = get_spec_metrics(llm.core)
    assert stats is not None and stats.total.num_draft_tokens == m["spec_num_draft_tokens"]
    assert stats.total.per_position_acceptance[0] >= 0.98


def test_seeded_sampling_with_drafts_is_reproducible(target, small_draft) -> None:
    spec = {"method": "draft_model", "model": small_draft, "num_speculative_tokens": 3}
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, seed=123, ignore_eos=True)
    first, _ = run(target.path, prompt_set()[:5], params, spec)
    # A different batch (one prompt alone) and other engine settings: same tokens for a seeded request.
    again, _ = run(target.path, prompt_set()[2:3], params, spec, **STRESSED)
    assert again[0].outputs[0].token_ids == first[2].outputs[0].token_ids
    unseeded, _ = run(target.path, prompt_set()[:5], SamplingParams(max_tokens=16, temperature=0.9,
                                                                    ignore_eos=True), spec)
    assert [o.outputs[0].token_ids for o in unseeded] != [o.outputs[0].token_ids for o in first]


def test_penalties_count_earlier_drafts(target, reference) -> None:
    """Repetition/frequency/presence penalties, logit bias and min_tokens see each earlier draft of
    a verification as generated output, exactly as plain decoding sees earlier tokens."""
    params = SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.8,
                            presence_penalty=0.3, logit_bias={7: 3.0, 50: -2.0}, min_tokens=10)
    prompts = prompt_set()
    plain, _ = run(target.path, prompts, params)
    spec = {"method": "draft_model", "model": target.path, "num_speculative_tokens": 4}
    fast, llm = run(target.path, prompts, params, spec)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].token_ids for o in plain] != [r[:20] for r in reference]  # the penalties bite
    assert llm.get_metrics()["spec_acceptance_rate"] > 0.9


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=hf_models.VOCAB)


def test_stops_inside_accepted_runs(target, tok_dir) -> None:
    """Draft == target, so whole runs are accepted; every stop must still cut exactly where plain
    decoding cuts: tokens, text, logprobs, finish and stop reasons."""
    prompts = hf_models.prompts(24, seed=21, min_len=4, max_len=12)

    def generate(params: list[SamplingParams], spec: dict | None) -> list:
        llm = LLM(target.path, tokenizer=tok_dir, speculative_config=spec, **ROOMY)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    probe = generate([SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * len(prompts), None)
    params = []
    for i, out in enumerate(probe):
        tokens, text = out.outputs[0].token_ids, out.outputs[0].text
        kind = i % 4
        if kind == 0:  # a stop token id in the middle of the run
            params.append(SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[tokens[9]], logprobs=2,
                                         ignore_eos=True))
        elif kind == 1:  # a stop string in the middle of the text
            params.append(SamplingParams(max_tokens=30, temperature=0.0, stop=[text[len(text) // 2:][:3]],
                                         logprobs=1, ignore_eos=True))
        elif kind == 2:  # max_tokens not at a verification boundary
            params.append(SamplingParams(max_tokens=7 + i % 3, temperature=0.0, logprobs=0, ignore_eos=True))
        else:  # EOS ids (the model's are 2 and 3, forced into the run through a logit bias)
            params.append(SamplingParams(max_tokens=30, temperature=0.0, logit_bias={2: 4.0}, logprobs=1))
    plain = generate(params, None)
    spec = {"method": "draft_model", "model": target.path, "num_speculative_tokens": 4}
    fast = generate(params, spec)
    reasons = set()
    for i, (a, b) in enumerate(zip(plain, fast)):
        x, y = a.outputs[0], b.outputs[0]
        assert (y.token_ids, y.text, y.finish_reason, y.stop_reason) == (x.token_ids, x.text, x.finish_reason,
                                                                          x.stop_reason), i
        assert len(y.logprobs) == len(x.logprobs) == len(x.token_ids)
        for pa, pb in zip(x.logprobs, y.logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)
        assert b.metrics.spec_num_accepted_tokens <= b.metrics.spec_num_draft_tokens
        reasons.add((i % 4, x.finish_reason))
    # Every kind of stop really happened, and stops fell past the first verification (prefill's
    # token + 4 drafts + 1), i.e. inside runs the draft model proposed.
    assert {(0, "stop"), (1, "stop"), (2, "length"), (3, "stop")} <= reasons
    for kind in (0, 1, 3):
        assert any(len(o.outputs[0].token_ids) > 6 and o.outputs[0].finish_reason == "stop"
                   for i, o in enumerate(plain) if i % 4 == kind), kind


async def test_async_engine_with_speculative_config(target, reference) -> None:
    engine = AsyncEngine.from_engine_args(target.path, skip_tokenizer_init=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3}, **ROOMY)
    try:
        async def one(i: int, prompt: list[int]) -> list[int]:
            last = None
            async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY, f"r{i}"):
                last = out
            return last.outputs[0].token_ids

        got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompt_set())))
        assert list(got) == reference
        assert engine.get_metrics()["spec_num_draft_tokens"] > 0
    finally:
        await engine.shutdown()


def test_cli_speculative_config_reaches_the_engine_config() -> None:
    for command in (["generate", "hi"], ["serve"]):
        args = build_parser().parse_args([*command, "--speculative-config",
                                          '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 5}'])
        config = EngineConfig(**engine_kwargs(args))
        spec = config.speculative_config
        assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 2, 5)
        assert config.num_lookahead_tokens == 2


@pytest.mark.parametrize("spec, message", [
    ({"method": "medusa2", "num_speculative_tokens": 2},
     "registered: .*draft_model, .*eagle, eagle3, medusa, mtp, ngram"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, "method"),
    ("{not json", "not valid JSON"),
    # A key the method does not read is refused, not ignored.
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/models/draft"},
     r"speculative_config.model does not apply to method 'ngram' \(it reads: prompt_lookup_max, prompt_lookup_min\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_dtype": "float16"}, "draft_dtype does not apply"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max does not"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "token_map": "ids.json"}, "token_map does not apply"),
    ({"method": "ngram", "num_speculative_tokens": 2, "extra": {"alpha": 0.5}}, "extra does not apply"),
    ({"method": "controlled", "num_speculative_tokens": 2, "extra": {"wraps": "ngram", "beta": 1}},
     "extra does not apply to method 'ngram'"),
])
def test_invalid_speculative_configs_are_clear_errors(target, spec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(target.path, skip_tokenizer_init=True, speculative_config=spec, **ROOMY)


def test_draft_model_must_share_the_vocabulary(target, tmp_path) -> None:
    import transformers

    config = transformers.Qwen3Config(**{**hf_models.COMMON, "vocab_size": 300, "num_hidden_layers": 1})
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(target.path, skip_tokenizer_init=True, **ROOMY,
            speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})


def test_metrics_plugin_logs_acceptance(target, caplog: pytest.LogCaptureFixture) -> None:
    spec = {"method": "draft_model", "model": target.path, "num_speculative_tokens": 2}
    with caplog.at_level(logging.INFO, logger="specloop.spec_decode"):
        _, llm = run(target.path, prompt_set()[:3], SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True), spec,
                     plugin_options={"spec_metrics": {"log_interval_s": 0.0}})
    lines = [r.getMessage() for r in caplog.records if r.name == "specloop.spec_decode"]
    assert lines and all(line.startswith("Speculative decoding: mean acceptance length 3.00, "
                                         "acceptance rate 100.0%") for line in lines)
    stats = SpecDecodingStats()
    stats.add(4, 12, 9, [4, 3, 2])
    assert stats.mean_acceptance_length == pytest.approx(1 + 9 / 4)
    assert stats.per_position_acceptance == [1.0, 0.75, 0.5]
    assert "acceptance rate 75.0% (9/12 draft tokens, 4 drafts)" in stats.format()
    # No plugin instance for an engine without speculation.
    _, plain = run(target.path, prompt_set()[:1], GREEDY)
    assert get_spec_metrics(plain.core) is None


def test_padded_drafts_keep_greedy_identical(target, reference) -> None:
    """With draft padding on (the GPU runner turns it on for its CUDA graphs of uniform batches),
    greedy output is unchanged through chunking, prefix hits and preemption. (n-gram drafts are
    ragged by nature; a draft model's always number K unless a limit cuts them.)"""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(target.path, skip_tokenizer_init=True, speculative_config=spec, **{**ROOMY, **STRESSED})
    drafter = llm.core.runner.drafter
    drafter.pad_drafts = True
    padded = []
    pad = drafter._pad

    def counting(inputs, drafts, probs):
        before = sum(map(len, drafts))
        pad(inputs, drafts, probs)
        padded.append(sum(map(len, drafts)) - before)

    drafter._pad = counting
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_set()], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(padded) > 0, "no step had drafts to pad"
    assert llm.get_metrics()["num_preemptions"] > 0


def test_draft_padding_respects_limits_and_probabilities() -> None:
    """Padding repeats the last draft (or the newest token), passes a request's max_tokens (the
    scheduler drops what lands past it) but never max_model_len, skips requests that sampled
    nothing, and gives padded positions one-hot probabilities."""
    import numpy as np

    from specloop.backends.drafting import DraftingStage
    from specloop.proposers.policy import FixedPolicy

    config = EngineConfig(model="unused", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                          max_model_len=46)
    proposer = type("P", (), {"num_speculative_tokens": 3})()
    stage = DraftingStage(proposer, FixedPolicy(config), config)
    params = [SamplingParams(max_tokens=100), SamplingParams(max_tokens=100), SamplingParams(max_tokens=7),
              SamplingParams(max_tokens=100), SamplingParams(max_tokens=100)]
    inputs = ProposerInputs(req_ids=["a", "b", "c", "d", "e"],
                            token_ids=[np.arange(10), np.arange(20, 25), np.arange(30, 35), np.arange(40, 44),
                                       np.arange(44)],
                            num_prompt_tokens=np.array([4, 3, 0, 4, 4]), num_sampled=np.array([1, 2, 1, 0, 1]),
                            num_rejected=np.zeros(5, dtype=np.int64), sampling_params=params,
                            seeds=np.zeros(5, dtype=np.int64), max_drafts=np.array([3, 0, 3, 3, 3]))
    q = torch.softmax(torch.randn(1, 16), -1)
    drafts, probs = [[7, 8, 9], [5], [], [], []], [None, q, None, None, None]
    stage._pad(inputs, drafts, probs)
    # b: padded past the policy's 0 with its last draft; c: 5 output tokens of 7, padded with its
    # newest token past max_tokens; d sampled nothing; e: 44 tokens of 46, room for one draft.
    assert drafts == [[7, 8, 9], [5, 5, 5], [34, 34, 34], [], [43]]
    assert probs[1].shape == (3, 16) and torch.equal(probs[1][0], q[0])
    assert torch.equal(probs[1][1:], torch.nn.functional.one_hot(torch.tensor([5, 5]), 16).float())


def test_token_arrays_follow_each_request_across_steps() -> None:
    """The drafting stage hands proposers each request's token ids as a read-only array kept across
    steps: new tokens appended, a placeholder (a token still on the device) copied again once
    resolved, a removed request's array dropped."""
    from specloop.backends.drafting import DraftingStage
    from specloop.backends.requests import PLACEHOLDER, CachedRequestState
    from specloop.proposers.policy import FixedPolicy

    config = EngineConfig(model="unused", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    proposer = type("P", (), {"num_speculative_tokens": 3, "remove_requests": lambda self, ids: None})()
    stage = DraftingStage(proposer, FixedPolicy(config), config)
    state = CachedRequestState("a", [1, 2, 3], [1, 2, 3], 3, SamplingParams(), [], 0, 0)
    assert stage._token_array(state).tolist() == [1, 2, 3]
    state.token_ids += [4, PLACEHOLDER, 6]
    assert stage._token_array(state).tolist() == [1, 2, 3, 4, PLACEHOLDER, 6]
    state.token_ids[4] = 5  # the placeholder's value arrived
    state.token_ids += list(range(7, 200))  # past the buffer's first size
    got = stage._token_array(state)
    assert got.tolist() == list(range(1, 200)) and got.dtype == np.int64
    with pytest.raises(ValueError):
        got[0] = 9  # read-only: one buffer serves every step
    stage.remove(frozenset({"a"}), frozenset())
    state.token_ids = [9, 8]  # a preempted request comes back with its tokens recomputed
    assert stage._token_array(state).tolist() == [9, 8]


def test_graph_sizes() -> None:
    from specloop.proposers.step_graphs import graph_sizes

    assert graph_sizes(40) == [1, 2, 4, 8, 16, 32, 40] and graph_sizes(3) == [1, 2, 3]


def _recording_graphs(cls, forward, **kwargs):
    """``cls`` with each "graph" run eagerly by ``forward(graphs, size)`` (no capture: CPU)."""

    class Replay:
        def __init__(self, graphs, size):
            self.graphs, self.size = graphs, size

        def replay(self):
            self.graphs.outputs[self.size] = forward(self.graphs, self.size)

    graphs = cls(**kwargs)
    graphs.graphs = {size: Replay(graphs, size) for size in graphs.sizes}
    return graphs


def test_draft_chain_computes_positions_slots_and_lengths_on_the_device() -> None:
    """The chain's steps see position newest + j + 1, the slot of that position in the request's
    block table (-1 past its blocks), a context of position + 1, and each step's token feeds the
    next; padding rows write nothing; drafts come back in request order, cut at each limit."""
    from specloop.proposers.chain_graphs import ChainGraphs, greedy_drafts

    seen = []

    def step(meta, tokens, positions, state):
        seen.append((positions.tolist(), meta.slot_mapping.tolist(), meta.seq_lens.tolist()))
        return state + 1, tokens * 10 + state[:, 0].long()

    chain = _recording_graphs(ChainGraphs, lambda g, size: g.chain(size), fn=step, device=torch.device("cpu"),
                              max_reqs=4, max_len=32, block_size=4, num_steps=3, state=((1,), torch.float32))
    # Request a: newest position 5 in blocks [7, 2] (slots up to 7); request b: newest 2 in [3].
    drafts = [[], [], []]
    greedy_drafts(chain, [0, 2], np.array([4, 0, 2]), np.array([5, 0, 2]), [[7, 2], [], [3]],
                  torch.zeros(2, 1), torch.tensor([1, 2]), drafts)
    assert chain.num_replays == 1
    assert seen == [
        ([6, 3], [2 * 4 + 2, 3 * 4 + 3], [7, 4]),
        ([7, 4], [2 * 4 + 3, -1], [8, 5]),  # b's position 4 is past its one block
        ([8, 5], [-1, -1], [9, 6]),
    ]
    assert drafts == [[1, 10, 101, 1012], [], [2, 20]]


def test_uniform_feed_graphs_pack_rows_of_consecutive_positions() -> None:
    """A first step over q rows a request: positions first..first+q-1, their slots, one context
    length per request; padding requests own q rows that write nothing."""
    from specloop.proposers.step_graphs import StepGraphs, feed_token_ids, uniform_feed

    seen = []

    def feed(meta, tokens, positions, hidden):
        seen.append((tokens.tolist(), positions.tolist(), meta.slot_mapping.tolist(), meta.seq_lens.tolist(),
                     meta.query_start_loc.tolist(), hidden[:, 0].tolist()))
        return (hidden * 2,)

    graphs = _recording_graphs(StepGraphs, lambda g, size: g.forward(size), fn=feed, device=torch.device("cpu"), max_reqs=4, max_len=32, block_size=4,
                               extra=[((1,), torch.float32)], rows_per_req=2)
    assert uniform_feed({2: graphs}, np.array([1, 1, 1]), np.array([0, 2, 4, 6])) is graphs
    assert uniform_feed({2: graphs}, np.array([1, 0, 1]), np.array([0, 2, 4, 6])) is None  # a partial prefill
    assert uniform_feed({2: graphs}, np.array([1, 1]), np.array([0, 2, 5])) is None  # ragged
    ids = feed_token_ids([np.arange(10, 20), np.arange(30, 34), np.arange(50, 57)], np.array([7, 2, 5]), 2)
    assert ids.tolist() == [18, 19, 33, 0, 56, 0]  # the token after each row's position, 0 past the known ones
    out, = graphs.run(torch.tensor(ids), np.array([7, 2, 5]), [[1, 6, 8], [4], [0, 9]], torch.arange(6.0)[:, None])
    tokens, positions, slots, lens, qsl, hidden = seen[0]
    assert positions == [7, 8, 2, 3, 5, 6, 0, 1]  # a padding request at 0, 1
    assert slots == [6 * 4 + 3, 8 * 4 + 0, 4 * 4 + 2, 4 * 4 + 3, 9 * 4 + 1, 9 * 4 + 2, -1, -1]
    assert lens == [9, 4, 7, 2] and qsl == [0, 2, 4, 6, 8]
    assert tokens[:6] == ids.tolist() and hidden[:6] == list(range(6))
    assert out[:6, 0].tolist() == [0, 2, 4, 6, 8, 10]  # (padded to the graph's size)
    with pytest.raises(RuntimeError, match="past the request's"):
        graphs.run(torch.tensor(ids[:2]), np.array([7]), [[1, 6]], torch.zeros(2, 1))  # position 8 has no block


def test_proposal_graphs_draft_from_each_requests_newest_accepted_row() -> None:
    """The whole greedy proposal in one graph: the first step over q rows a request, each
    request's output at its newest accepted row, its argmax, then the chain from that row's
    position with slots computed on the device (-1 past the request's blocks; padding requests
    write nothing)."""
    from specloop.proposers.chain_graphs import ProposalGraphs

    class Head:  # outputs carry (position, token) so the test can see what fed what
        def __init__(self):
            self.chain = []

        def feed(self, meta, tokens, positions, hidden):
            return (torch.stack([positions.float(), tokens.float() + hidden[:, 0]], dim=1),)

        def step(self, meta, tokens, positions, state):
            self.chain.append((positions.tolist(), meta.slot_mapping.tolist(), meta.seq_lens.tolist()))
            return state, tokens + 100

        def argmax(self, state):
            return state[:, 1].long()

    head = Head()
    graphs = _recording_graphs(ProposalGraphs, lambda g, size: g.forward(size), fn=head.feed, step=head.step,
                               argmax=head.argmax, device=torch.device("cpu"), max_reqs=4, max_len=32, block_size=4,
                               num_steps=2, extra=[((1,), torch.float32)], rows_per_req=3)
    # Request a: rows at positions 5, 6, 7 of blocks [7, 2], 2 accepted (newest 6); request b:
    # positions 1, 2, 3 of block [3], all 3 accepted (newest 3, its block's last slot); request c:
    # positions 0, 1, 2 of block [5], 1 accepted. A fourth, padding request fills the graph.
    ids = torch.tensor([10, 11, 12, 20, 21, 22, 30, 31, 32])
    out, drafts = graphs.propose(ids, np.array([5, 1, 0]), [[7, 2], [3], [5]], np.array([2, 3, 1]),
                                 torch.zeros(9, 1))
    assert out[:9, 0].tolist() == [5, 6, 7, 1, 2, 3, 0, 1, 2]
    assert drafts[:3].tolist() == [[11, 111, 211], [22, 122, 222], [30, 130, 230]]  # rows 1, 5, 6, then the chain
    assert head.chain == [
        ([7, 4, 1, 1], [2 * 4 + 3, -1, 5 * 4 + 1, -1], [8, 5, 2, 2]),  # b's position 4 is past its one block
        ([8, 5, 2, 2], [-1, -1, 5 * 4 + 2, -1], [9, 6, 3, 3]),
    ]
    assert graphs.num_replays == 1


def test_first_step_graphs_cover_every_draft_count_within_the_token_budget(monkeypatch) -> None:
    """One feed graph set per q = 1 .. K + 1, each for as many requests as q rows each fit in the
    step's token budget (at most max_num_seqs), all sharing one pool."""
    from types import SimpleNamespace

    from specloop.proposers import chain_graphs, step_graphs

    monkeypatch.setattr(step_graphs.StepGraphs, "capture", lambda self: None)  # capture needs CUDA
    config = SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=10)
    feeds = chain_graphs.capture_feeds(lambda *a: (), config, torch.device("cpu"), 64, 4, 3,
                                      [((8,), torch.float32)], pool="shared")
    assert {q: g.sizes[-1] for q, g in feeds.items()} == {1: 4, 2: 4, 3: 3, 4: 2}
    assert all(g.q == q and g.pool == "shared" for q, g in feeds.items())

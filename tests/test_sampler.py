"""The sampler: each parameter against transformers' logits processors or the definition it
implements, the sampled distribution against the processed one, seeds that ignore batch
composition, and raw logprobs."""

from __future__ import annotations

from typing import Any, Sequence

import pytest
import torch
from hf_models import prompts, tiny
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from specloop.sampling import sampler as S
from specloop.kernel.config import EngineConfig
from specloop.kernel.engine_core import EngineCore
from specloop.kernel.request import Request
from specloop.kernel.sampling_params import SamplingParams

V = 64
CPU = torch.device("cpu")


def rows(params: Sequence[SamplingParams], seed: int = 0, positions: Sequence[int] | None = None,
         prompt: Sequence[int] = (), outputs: Sequence[Sequence[int]] | None = None,
         stop: Sequence[int] = (2,)) -> S.SamplingMetadata:
    positions = positions if positions is not None else range(len(params))
    outputs = outputs if outputs is not None else [()] * len(params)
    return S.SamplingMetadata.build(
        [S.SamplingRow(p, seed, pos, prompt, out, stop) for p, pos, out in zip(params, positions, outputs)], V, CPU)


def random_logits(n: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale


def probs_of(logits: torch.Tensor, meta: S.SamplingMetadata) -> torch.Tensor:
    return S.probabilities(S.process_logits(logits, meta), meta)


def hf_probs(logits: torch.Tensor, *warpers: Any) -> torch.Tensor:
    for w in warpers:
        logits = w(None, logits.clone())
    return logits.softmax(-1)


def test_greedy_is_the_argmax() -> None:
    logits = random_logits(5)
    meta = rows([SamplingParams(temperature=0.0)] * 5)
    assert meta.all_greedy
    assert S.sample(logits, meta).tolist() == logits.argmax(-1).tolist()
    assert torch.equal(probs_of(logits, meta), torch.nn.functional.one_hot(logits.argmax(-1), V).float())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_matches_hf(temperature: float) -> None:
    logits = random_logits(4, seed=1)
    meta = rows([SamplingParams(temperature=temperature)] * 4)
    torch.testing.assert_close(probs_of(logits, meta), hf_probs(logits, TemperatureLogitsWarper(temperature)))


@pytest.mark.parametrize("k", [1, 5, 63, V + 10])
def test_top_k_matches_hf(k: int) -> None:
    logits = random_logits(4, seed=2)
    meta = rows([SamplingParams(temperature=0.8, top_k=k)] * 4)
    expected = hf_probs(logits, TemperatureLogitsWarper(0.8), TopKLogitsWarper(min(k, V)))
    torch.testing.assert_close(probs_of(logits, meta), expected)
    if k == 1:  # k = 1 is greedy, whatever the noise
        many = rows([SamplingParams(temperature=5.0, top_k=1)] * 200, positions=range(200))
        assert (S.sample(logits[:1].expand(200, V), many) == logits[0].argmax()).all()


@pytest.mark.parametrize("p", [1e-9, 0.3, 0.9, 1.0])
def test_top_p_matches_hf(p: float) -> None:
    logits = random_logits(4, seed=3)
    meta = rows([SamplingParams(temperature=1.0, top_p=p)] * 4)
    torch.testing.assert_close(probs_of(logits, meta), hf_probs(logits, TopPLogitsWarper(p)))
    if p < 1e-6:  # p -> 0 keeps only the most likely token
        assert (probs_of(logits, meta).argmax(-1) == logits.argmax(-1)).all()
        assert (probs_of(logits, meta).max(-1).values == 1.0).all()


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_matches_hf(min_p: float) -> None:
    logits = random_logits(4, seed=4)
    meta = rows([SamplingParams(temperature=1.3, min_p=min_p)] * 4)
    expected = hf_probs(logits, TemperatureLogitsWarper(1.3), MinPLogitsWarper(min_p))
    torch.testing.assert_close(probs_of(logits, meta), expected)


def test_min_p_then_top_p_order() -> None:
    """vLLM's order: min-p filters first, then top-p measures mass on the renormalised remainder."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04] + [1e-9] * (V - 5)]))
    meta = rows([SamplingParams(temperature=1.0, min_p=0.15, top_p=0.6)])
    # min_p keeps {0.5, 0.3, 0.1} -> renormalised 0.556, 0.333, 0.111; top_p 0.6 keeps the first two.
    probs = probs_of(logits, meta)[0]
    torch.testing.assert_close(probs[:3], torch.tensor([0.625, 0.375, 0.0]), atol=1e-5, rtol=0)


def test_repetition_penalty_matches_hf_over_prompt_and_output() -> None:
    logits = random_logits(1, seed=5)
    prompt, output = [3, 9, 17], [9, 40, 41]
    meta = rows([SamplingParams(temperature=0.0, repetition_penalty=1.8)], prompt=prompt, outputs=[output])
    expected = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(S.process_logits(logits, meta), expected)
    assert not torch.equal(expected, logits)


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = random_logits(1, seed=6)
    prompt, output = [5, 6], [6, 7, 7, 7]
    meta = rows([SamplingParams(frequency_penalty=0.5, presence_penalty=1.25)], prompt=prompt, outputs=[output])
    expected = logits.clone()
    for token, count in ((6, 1), (7, 3)):  # OpenAI: mu - c * alpha_freq - [c > 0] * alpha_presence
        expected[0, token] -= count * 0.5 + 1.25
    torch.testing.assert_close(S.process_logits(logits, meta), expected)


def test_penalties_and_bias_are_per_row() -> None:
    logits = random_logits(2, seed=7)
    meta = rows([SamplingParams(frequency_penalty=1.0, logit_bias={3: 4.0}), SamplingParams()],
                outputs=[[1, 1], [1, 1]])
    out = S.process_logits(logits, meta)
    assert out[0, 1] == logits[0, 1] - 2.0 and out[0, 3] == logits[0, 3] + 4.0
    torch.testing.assert_close(out[1], logits[1])


def test_logit_bias_forces_and_bans() -> None:
    logits = random_logits(3, seed=8)
    top = logits.argmax(-1)
    meta = rows([SamplingParams(temperature=0.0, logit_bias={11: 100.0}),
                 SamplingParams(temperature=1.0, logit_bias={11: 100.0}),
                 SamplingParams(temperature=0.0, logit_bias={int(top[2]): -100.0})])
    tokens = S.sample(logits, meta)
    assert tokens[:2].tolist() == [11, 11] and tokens[2] != top[2]


def test_min_tokens_bans_stop_and_eos_ids_until_reached() -> None:
    logits = random_logits(4, seed=9)
    params = SamplingParams(temperature=0.0, min_tokens=3, logit_bias={2: 100.0, 5: 90.0})
    meta = rows([params] * 4, outputs=[[], [8], [8, 8], [8, 8, 8]], stop=(2, 5))
    assert S.sample(logits, meta).tolist()[3] == 2
    assert not set(S.sample(logits, meta).tolist()[:3]) & {2, 5}


def test_samples_follow_the_processed_distribution() -> None:
    """Total variation between 20000 draws (distinct positions) and probabilities() is small, for
    plain temperature and for a truncated distribution."""
    n = 20000
    logits = random_logits(1, seed=10, scale=1.0).expand(n, V)
    for params in (SamplingParams(temperature=0.9), SamplingParams(temperature=1.2, top_k=20, top_p=0.8, min_p=0.02)):
        meta = rows([params] * n, seed=123, positions=range(n))
        target = probs_of(logits[:1], rows([params]))[0]
        freq = torch.bincount(S.sample(logits, meta), minlength=V).float() / n
        assert 0.5 * (freq - target).abs().sum() < 0.03
        assert freq[target == 0].sum() == 0


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = random_logits(6, seed=11, scale=0.5)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (7, 8, 9)]
    alone = [S.sample(logits[i:i + 1], S.SamplingMetadata.build(
        [S.SamplingRow(params[i], 7 + i, 30, (), (), ())], V, CPU)).item() for i in range(3)]
    batch = S.SamplingMetadata.build([S.SamplingRow(params[i], 7 + i, 30, (), (), ()) for i in (2, 0, 1)], V, CPU)
    assert S.sample(logits[[2, 0, 1]], batch).tolist() == [alone[2], alone[0], alone[1]]
    # Not vacuous: across positions the same row's samples vary.
    draws = {S.sample(logits[:1], S.SamplingMetadata.build([S.SamplingRow(params[0], 7, p, (), (), ())], V, CPU)).item()
             for p in range(40)}
    assert len(draws) > 5


def test_logprobs_are_raw_log_softmax_with_rank_and_top_k() -> None:
    logits = random_logits(3, seed=12)
    tokens = torch.tensor([int(logits[0].argmax()), int(logits[1].argmin()), 4])
    out = S.compute_logprobs(logits, tokens, [2, 0, None])
    ref = logits.log_softmax(-1)
    assert out[2] is None
    assert out[0].rank == 1 and out[1].rank == V
    assert abs(out[1].logprob - ref[1, tokens[1]].item()) < 1e-6
    assert out[0].top_token_ids == ref[0].topk(2).indices.tolist() and out[1].top_token_ids == []
    torch.testing.assert_close(torch.tensor(out[0].top_logprobs), ref[0].topk(2).values)


# --- seeds through the engine -----------------------------------------------------------------

def sample_through_engine(path: str, requests: list[tuple[str, list[int], SamplingParams]],
                          **config: Any) -> tuple[dict[str, list[int]], int]:
    """Outputs by request id, and how many preemptions the scheduler made."""
    core = EngineCore(EngineConfig(model=path, block_size=4, max_model_len=64, **config))
    outs: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    preemptions = 0
    try:
        core.add_requests([Request(rid, p, params) for rid, p, params in requests])
        while core.has_unfinished_requests():
            step = core.step()
            for o in step.outputs:
                outs[o.req_id].extend(o.new_token_ids)
            preemptions += step.scheduler_stats.num_preemptions
            core.post_step()
    finally:
        core.shutdown()
    return outs, preemptions


def test_seeded_requests_reproduce_across_batch_compositions() -> None:
    model = tiny("qwen2")
    ps = prompts(4, seed=30)
    hot = dict(temperature=1.5, max_tokens=12, ignore_eos=True)
    target = ("x", ps[0], SamplingParams(seed=1234, **hot))
    alone = sample_through_engine(model.path, [target])[0]["x"]
    others = [(f"o{i}", p, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True))
              for i, p in enumerate(ps[1:])]
    crowded, _ = sample_through_engine(model.path, others[:1] + [target] + others[1:], max_num_batched_tokens=9)
    preempted, num_preemptions = sample_through_engine(model.path, others + [target], num_kv_blocks=18)
    assert crowded["x"] == alone and preempted["x"] == alone and num_preemptions > 0
    other_seed = sample_through_engine(model.path, [("x", ps[0], SamplingParams(seed=4321, **hot))])[0]["x"]
    greedy = model.greedy(ps[0], 12)
    assert other_seed != alone and alone != greedy  # the comparison is of genuinely random outputs

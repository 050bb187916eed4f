"""Prompt-lookup proposer: match rules, caps, and agreement with a brute-force search."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specloop.kernel.config import EngineConfig
from specloop.kernel.plugins import PluginManager
from specloop.kernel.sampling_params import SamplingParams
from specloop.proposers.base import ProposerInputs
from specloop.proposers.ngram import NgramProposer, find_ngram_continuation, find_ngram_continuations


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(0, len(tokens) - n):
            if tokens[start:start + n] == suffix:
                follows = tokens[start + n:]  # repeated when it runs into the end
                return [follows[j % len(follows)] for j in range(k)]
    return []


def propose(tokens: list[list[int]], k: int = 4, min_n: int = 1, max_n: int = 3, max_model_len: int = 1000,
            max_tokens: list[int | None] | None = None, num_prompt: list[int] | None = None) -> list[list[int]]:
    config = EngineConfig(max_model_len=max_model_len, speculative_config={
        "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": min_n, "prompt_lookup_max": max_n})
    b = len(tokens)
    params = [SamplingParams(max_tokens=m) for m in (max_tokens or [None] * b)]
    inputs = ProposerInputs(req_ids=[str(i) for i in range(b)], token_ids=[np.array(t) for t in tokens],
                            num_prompt_tokens=np.array(num_prompt or [len(t) for t in tokens]),
                            num_sampled=np.ones(b, np.int64), num_rejected=np.zeros(b, np.int64),
                            sampling_params=params, seeds=np.zeros(b, np.int64))
    return NgramProposer(config).propose(inputs).draft_token_ids


def test_longest_match_wins_over_earlier_shorter_one() -> None:
    # "3" alone occurs first (followed by 8), but "1 2 3" occurs later (followed by 4 5).
    tokens = [3, 8, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert find_ngram_continuation(np.array(tokens), 1, 3, 2).tolist() == [4, 5]
    # With the 3-gram out of reach, the 2-gram "2 3" and then the 1-gram decide.
    assert find_ngram_continuation(np.array(tokens), 1, 2, 2).tolist() == [4, 5]
    assert find_ngram_continuation(np.array(tokens), 1, 1, 2).tolist() == [8, 9]


def test_tie_goes_to_the_earliest_occurrence() -> None:
    tokens = [7, 1, 2, 10, 11, 0, 1, 2, 20, 21, 1, 2]
    assert find_ngram_continuation(np.array(tokens), 2, 2, 2).tolist() == [10, 11]


def test_a_continuation_that_reaches_the_end_repeats() -> None:
    tokens = [5, 6, 5, 6, 5, 6]
    assert find_ngram_continuation(np.array(tokens), 1, 2, 5).tolist() == [5, 6, 5, 6, 5]
    # "1 2" first ends at index 2, followed by "c a b": the pattern goes on c a b c ...
    assert find_ngram_continuation(np.array([9, 1, 2, 3, 1, 2]), 2, 2, 5).tolist() == [3, 1, 2, 3, 1]
    assert find_ngram_continuation(np.array([7, 7]), 1, 3, 3).tolist() == [7, 7, 7]


def test_min_n_ignores_shorter_matches_and_no_match_is_empty() -> None:
    assert find_ngram_continuation(np.array([1, 2, 3, 9, 3]), 2, 3, 3).tolist() == []
    assert find_ngram_continuation(np.array([1, 2, 3, 9, 3]), 1, 3, 3).tolist() == [9, 3, 9]
    assert find_ngram_continuation(np.array([1, 2, 3, 4]), 1, 3, 3).tolist() == []
    assert find_ngram_continuation(np.array([4]), 1, 3, 3).tolist() == []
    assert propose([[1, 2, 3, 4, 5]]) == [[]]


def test_k_cap() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert propose([tokens], k=3) == [[3, 4, 5]]
    assert propose([tokens], k=1) == [[3]]


def test_max_model_len_and_max_tokens_caps() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]  # 10 tokens; the next step emits drafts + 1
    assert propose([tokens], k=5, max_model_len=14) == [[3, 4, 5]]
    assert propose([tokens], k=5, max_model_len=11) == [[]]
    # 10 tokens of which 4 are output; max_tokens=7 leaves 3 more tokens, i.e. 2 drafts.
    assert propose([tokens], k=5, max_tokens=[7], num_prompt=[6]) == [[3, 4]]
    assert propose([tokens, tokens], k=5, max_tokens=[5, None], num_prompt=[6, 6]) == [[], [3, 4, 5, 6, 7]]


def test_matches_brute_force_on_random_sequences() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 6)
        got = find_ngram_continuation(np.array(tokens), lo, hi, k).tolist()
        assert got == brute_force(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_the_batched_search_equals_the_per_request_one() -> None:
    """The proposer's batched search (one padded array for the whole batch) finds what the
    per-request search finds, row for row, with rows of different lengths and limits."""
    rng = random.Random(1)
    for _ in range(200):
        batch = [np.array([rng.randrange(5) for _ in range(rng.randrange(1, 60))]) for _ in range(rng.randint(1, 9))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        limits = [rng.randint(0, 6) for _ in batch]
        got = [d.tolist() for d in find_ngram_continuations(batch, lo, hi, limits)]
        assert got == [find_ngram_continuation(t, lo, hi, k).tolist() for t, k in zip(batch, limits)], \
            (batch, lo, hi, limits)


def test_registered_as_ngram() -> None:
    pm = PluginManager(load_entrypoints=False)
    assert pm.proposers.get("ngram") is NgramProposer


@pytest.mark.parametrize("bad", [{"prompt_lookup_min": 0}, {"prompt_lookup_min": 4, "prompt_lookup_max": 2}])
def test_invalid_lookup_bounds_are_clear_errors(bad: dict) -> None:
    with pytest.raises(ValueError, match="prompt_lookup"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, **bad})

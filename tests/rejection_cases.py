"""Deterministic inputs for the rejection-sampler tests, shared with the interpreted-kernel worker.

A *distribution case* is a batch of ``n`` identical requests verifying ``k`` drafts over a small
vocabulary: position ``j`` has target distribution ``target[j]`` (``j = k`` is the bonus position)
and drafts drawn from ``draft_dist[j]``. Since the targets do not depend on earlier tokens, the
token emitted at position ``j`` by every request that reaches ``j`` must follow ``target[j]``.
``n`` is chosen so that at least ``MIN_SAMPLES`` requests are expected to reach the bonus position
(with a 15% margin).

Running ``python rejection_cases.py OUT.pt`` under ``TRITON_INTERPRET=1`` samples every case with
the Triton kernel and saves the outputs; the tests run it in a subprocess so that the interpreter
setting never leaks into other tests.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import numpy as np
import torch

VOCAB = 8
MIN_SAMPLES = 200_000


@dataclass(frozen=True)
class Params:
    """Sampling parameters of a processed case (applied to logits by the normal sampler)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


@dataclass(frozen=True)
class DistCase:
    k: int
    one_hot: bool  # drafts without probabilities (q one-hot), else drafts sampled from q
    params: Params | None = None  # None: the targets are given as probabilities
    seed: int = 0

    @property
    def name(self) -> str:
        kind = "onehot" if self.one_hot else "probs"
        proc = "raw" if self.params is None else (f"T{self.params.temperature}-k{self.params.top_k}"
                                                 f"-p{self.params.top_p}-minp{self.params.min_p}")
        return f"K{self.k}-{kind}-{proc}"


RAW_CASES = [DistCase(k, one_hot, seed=10 * k + one_hot) for k in (1, 3, 5) for one_hot in (False, True)]
PROCESSED_CASES = [
    DistCase(1, False, Params(temperature=0.7, top_k=5), seed=101),
    DistCase(3, True, Params(temperature=1.3, top_p=0.8), seed=103),
    DistCase(5, False, Params(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05), seed=105),
]
ALL_CASES = RAW_CASES + PROCESSED_CASES


def oracle_probs(logits: np.ndarray, params: Params) -> np.ndarray:
    """The processed target distribution, written independently of ``backends/sampler.py``:
    temperature, then min-p, then the top-k tokens, then the fewest most likely of those whose
    probability reaches top-p, renormalised."""
    out = np.zeros_like(logits, dtype=np.float64)
    for j, row in enumerate(logits.astype(np.float64)):
        p = np.exp(row / params.temperature - (row / params.temperature).max())
        p /= p.sum()
        keep = p >= params.min_p * p.max()
        order = [v for v in np.argsort(-p, kind="stable") if keep[v]]
        if params.top_k:
            order = order[:params.top_k]
        mass = p[order] / p[order].sum()
        n = int(np.searchsorted(np.cumsum(mass), params.top_p - 1e-12)) + 1
        chosen = order[:n]
        out[j, chosen] = p[chosen] / p[chosen].sum()
    return out


@dataclass
class Batch:
    """A distribution case laid out for ``rejection_sample``."""

    case: DistCase
    n: int
    target: np.ndarray  # [k + 1, V] the distribution each position must follow
    draft_dist: np.ndarray  # [k, V] what the drafts were drawn from
    alpha: np.ndarray  # [k] exact acceptance probability per position
    logits: torch.Tensor | None  # [k + 1, V] for processed cases
    draft_token_ids: torch.Tensor  # [n, k]
    args: dict = field(default_factory=dict)


def build(case: DistCase) -> Batch:
    """Build a case. A processed case's kernel arguments hold what the normal sampler's processing
    (``backends/sampler.py``) makes of its logits, and ``Batch.target`` the oracle's."""
    g = torch.Generator().manual_seed(case.seed)
    k = case.k
    logits = torch.randn(k + 1, VOCAB, generator=g, dtype=torch.float64) * (0.8 if case.one_hot else 1.5)
    if case.one_hot:  # a dominant token per position, which the proposer usually guesses
        logits[torch.arange(k + 1), torch.randint(0, VOCAB, (k + 1,), generator=g)] += 4.5
    if case.params is None:
        target = torch.softmax(logits, -1).numpy()
    else:
        target = oracle_probs(logits.numpy(), case.params)
    t = torch.from_numpy(target[:k])
    if case.one_hot:
        draft_dist = 0.05 / VOCAB + 0.95 * torch.nn.functional.one_hot(t.argmax(-1), VOCAB).double()
        alpha = (draft_dist * t).sum(-1)
    else:
        draft_dist = torch.softmax(torch.log(t) + 0.3 * torch.randn(k, VOCAB, generator=g, dtype=torch.float64), -1)
        alpha = torch.minimum(draft_dist, t).sum(-1)
    n = math.ceil(1.15 * MIN_SAMPLES / float(alpha.prod()))
    cdf = draft_dist.cumsum(-1)
    u = torch.rand(n, k, generator=g, dtype=torch.float64)
    drafts = torch.searchsorted(cdf.contiguous(), u.T.contiguous()).T.clamp_max(VOCAB - 1)
    batch = Batch(case, n, target, draft_dist.numpy(), alpha.numpy(),
                  logits.float() if case.params is not None else None, drafts)
    probs = torch.from_numpy(target).float() if case.params is None else processed_target(logits.float(), case.params)
    rows = k + 1
    batch.args = dict(
        target_probs=probs.float().repeat(n, 1),
        target_argmax=probs.argmax(-1).repeat(n),
        draft_token_ids=torch.cat([drafts, torch.zeros(n, 1, dtype=torch.int64)], 1).flatten().to(torch.int32),
        draft_probs=None if case.one_hot else torch.cat(
            [draft_dist.float(), torch.zeros(1, VOCAB)]).repeat(n, 1),
        cu_num_logits=torch.arange(0, (n + 1) * rows, rows, dtype=torch.int32),
        greedy=torch.zeros(n, dtype=torch.bool),
        seeds=torch.arange(n, dtype=torch.int64) * 7919 + case.seed,
        positions=torch.full((n,), 3 + case.seed, dtype=torch.int64),
        max_spec_len=k,
    )
    return batch


def processed_target(batch_logits: torch.Tensor, params: Params) -> torch.Tensor:
    """What ``backends/sampler.py`` makes of a processed case's logits."""
    from specloop.sampling import sampler as sampling
    from specloop.kernel.sampling_params import SamplingParams

    sp = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                        min_p=params.min_p)
    rows = [sampling.SamplingRow(sp, 0, j, [], [], []) for j in range(batch_logits.shape[0])]
    meta = sampling.SamplingMetadata.build(rows, batch_logits.shape[1], batch_logits.device)
    return sampling.probabilities(sampling.process_logits(batch_logits, meta), meta)


def mixed_batch(seed: int, num_reqs: int = 3000, vocab: int = 37, max_k: int = 5) -> dict:
    """Ragged drafts (0..max_k), greedy and sampled requests, a vocabulary spanning several kernel
    blocks, zeros in the targets (as after top-k), and seeds over the whole int64 range."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(0, max_k + 1, (num_reqs,), generator=g)
    cu = torch.zeros(num_reqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(n + 1, 0)
    rows = int(cu[-1])
    logits = torch.randn(rows, vocab, generator=g) * 2
    logits[torch.rand(rows, vocab, generator=g) < 0.3] = float("-inf")
    logits[:, 0] = 0.0  # every row keeps at least one token
    target = torch.softmax(logits, -1)
    draft_probs = torch.softmax(torch.randn(rows, vocab, generator=g) * 2, -1)
    return dict(target_probs=target, target_argmax=target.argmax(-1),
                draft_token_ids=torch.multinomial(draft_probs, 1, generator=g).squeeze(1).to(torch.int32),
                draft_probs=draft_probs, cu_num_logits=cu, greedy=torch.rand(num_reqs, generator=g) < 0.3,
                seeds=torch.randint(-2**63, 2**63 - 1, (num_reqs,), generator=g),
                positions=torch.randint(0, 1 << 20, (num_reqs,), generator=g), max_spec_len=max_k)


# name -> mixed-batch arguments: with draft probabilities, one-hot drafts, all greedy (no probs).
def mixed_cases() -> dict[str, dict]:
    with_probs = mixed_batch(seed=1)
    one_hot = {**mixed_batch(seed=1), "draft_probs": None}
    greedy = {**mixed_batch(seed=2), "draft_probs": None, "target_probs": None}
    greedy["greedy"][:] = True
    return {"probs": with_probs, "one_hot": one_hot, "greedy": greedy}


def main(out_path: str) -> None:
    from specloop.kernels.rejection_sample import rejection_sample

    torch.set_num_threads(1)  # a two-thread pool stalls on a busy machine; these ops are small

    results = {}
    for case in ALL_CASES:
        results[case.name] = rejection_sample(**build(case).args, rows_per_program=65536)
    for name, args in mixed_cases().items():
        results[name] = rejection_sample(**args, rows_per_program=1024)
    torch.save(results, out_path)


if __name__ == "__main__":
    main(sys.argv[1])

"""Drawing drafts from a proposer's logits the way the target samples, for proposers whose drafts
come from a distribution (a draft model, MTP): the request's own sampling processing (penalties,
bias, min_tokens with the earlier drafts counted as output, temperature, top-k/top-p/min-p), and the
distribution ``q`` each draft came from, which the rejection sampler needs to stay exact."""

from __future__ import annotations

import torch

from specloop.kernel.sampling_params import SamplingParams
from specloop.sampling import sampler as sampling
from specloop.sampling.noise import exponential_race, position_key

from .base import ProposerInputs

# Draft noise must be independent of the target's (same seed and position), or the recovery
# sample after a rejection would be correlated with the rejected draft.
DRAFT_SEED_SALT = 0x5DEECE66D


def sample_drafts(inputs: ProposerInputs, live: list[int], logits: torch.Tensor, drafts: list[list[int]]
                  ) -> tuple[list[int], torch.Tensor | None]:
    """Each live request's next draft from ``logits`` (row ``k`` is ``live[k]``'s; ``drafts[i]`` are
    its drafts so far), and the distributions they were drawn from (one-hot rows for greedy
    requests; None when every request is greedy without logit processing: the argmax, no more)."""
    if all(_plain_greedy(inputs.sampling_params[i]) for i in live):
        return logits.argmax(dim=-1).tolist(), None
    rows = []
    for i in live:
        params = inputs.sampling_params[i]
        tokens = inputs.token_ids[i]
        num_prompt = int(inputs.num_prompt_tokens[i])
        stop_ids = sampling.stop_token_ids(params, inputs.eos_token_ids[i])
        rows.append(sampling.SamplingRow(params, int(inputs.seeds[i]) ^ DRAFT_SEED_SALT,
                                         len(tokens) + len(drafts[i]), tokens[:num_prompt].tolist(),
                                         tokens[num_prompt:].tolist() + drafts[i], stop_ids))
    meta = sampling.SamplingMetadata.build(rows, logits.shape[1], logits.device)
    q = sampling.probabilities(sampling.process_logits(logits, meta), meta)
    tokens = q.argmax(dim=-1)
    if not meta.all_greedy:
        drawn = exponential_race(q, position_key(meta.seeds, meta.positions))
        tokens = torch.where(meta.greedy, tokens, drawn)
    return tokens.tolist(), q


def _plain_greedy(params: SamplingParams) -> bool:
    return (params.greedy and params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0 and not params.logit_bias and params.min_tokens == 0)

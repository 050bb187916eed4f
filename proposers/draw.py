"""Drawing drafts from a proposer's logits with the request's own sampling processing, so that the
rejection sampler can correct them exactly (``specloop.sampling.rejection``)."""

from __future__ import annotations

import torch

from specloop.sampling import sampler as sampling
from specloop.sampling.noise import exponential_race, position_key

from .base import ProposerInputs

# Draft noise must be independent of the target's (same seed and position), or the recovery
# sample after a rejection would be correlated with the rejected draft.
DRAFT_SEED_SALT = 0x5DEECE66D


def processed_logits(inputs: ProposerInputs, live: list[int], logits: torch.Tensor, drafts: list[list[int]]
                     ) -> tuple[torch.Tensor, sampling.SamplingMetadata]:
    """``logits`` [len(live), V] float32 after each live request's logit bias, min_tokens and
    penalties, its drafts so far counting as output; rows a request's processing masks entirely
    (a reduced draft vocabulary whose every token is banned) become uniform."""
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
    processed = sampling.process_logits(logits, meta)
    masked = ~torch.isfinite(processed).any(dim=-1, keepdim=True)
    return torch.where(masked, torch.zeros_like(processed), processed), meta


def plain_greedy(inputs: ProposerInputs, live: list[int]) -> bool:
    """Whether every live request decodes greedily with no logit processing: its next draft is
    then simply the argmax of the proposer's logits, and one-hot."""
    for i in live:
        p = inputs.sampling_params[i]
        if not p.greedy or p.logit_bias or p.min_tokens or p.repetition_penalty != 1.0 \
                or p.frequency_penalty or p.presence_penalty:
            return False
    return True


def draw(inputs: ProposerInputs, live: list[int], logits: torch.Tensor, drafts: list[list[int]]
         ) -> tuple[list[int], torch.Tensor | None]:
    """Each live request's next draft, drawn with the target's sampling processing, and the
    distribution it was drawn from (one-hot for greedy requests; None when every request is
    :func:`plain_greedy`)."""
    if plain_greedy(inputs, live):
        return logits.argmax(dim=-1).tolist(), None
    processed, meta = processed_logits(inputs, live, logits, drafts)
    q = sampling.probabilities(processed, meta)
    tokens = q.argmax(dim=-1)
    if not meta.all_greedy:
        drawn = exponential_race(q, position_key(meta.seeds, meta.positions))
        tokens = torch.where(meta.greedy, tokens, drawn)
    return tokens.tolist(), q

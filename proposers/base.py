"""The proposer seam: what a model runner hands every speculative proposer, and what it gets back.

A step's ``sample_tokens`` first verifies last step's drafts, then calls ``propose`` once for the
whole batch (seed 000, ``propose_draft`` at the end of ``sample_tokens``). The drafts go back to the
scheduler in ``post_step`` and are verified by the target in the next step.

``ProposerInputs`` carries what any proposer needs, even where one ignores it: n-gram reads only
the token ids; a draft model adds its own KV cache over the target's block table; EAGLE and MTP
read the target's hidden states (all positions of the step, and the one each request sampled
from) plus the tokens sampled after them (seed 000: previous hidden state + next token embedding,
one step per draft); EAGLE-3 also reads the hidden states of ``hidden_state_layers``; Medusa reads
the sampled positions' hidden states only. A proposer declares its needs as class attributes so
the runner computes and keeps only what is asked for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterable

import numpy as np

if TYPE_CHECKING:
    import torch

    from specloop.kernel.config import EngineConfig
    from specloop.kernel.outputs import SchedulerOutput
    from specloop.kernel.sampling_params import SamplingParams


@dataclass(slots=True)
class ProposerInputs:
    """One step's verified state, for the requests that sampled this step. Set by the model runner
    in ``sample_tokens``, after rejection sampling; request ``i`` is ``req_ids[i]`` throughout."""

    req_ids: list[str]
    # Prompt + committed output + this step's accepted tokens (the last one is the newest sample,
    # whose KV nobody has computed yet).
    token_ids: list[np.ndarray]
    num_prompt_tokens: np.ndarray  # [B]
    # Tokens emitted this step (accepted drafts + the target's token) and drafts rejected.
    num_sampled: np.ndarray  # [B]
    num_rejected: np.ndarray  # [B]
    sampling_params: list[SamplingParams]
    # Per-request sampling seed for draft sampling (the runner's, derived from SamplingParams.seed
    # or its own generator), so seeded requests draft reproducibly.
    seeds: np.ndarray  # [B] int64
    # The target's block table per request (proposers with their own KV cache index it too).
    block_ids: list[list[int]] = field(default_factory=list)
    # The target's forward this step: rows ``query_start_loc[i]:query_start_loc[i + 1]`` of the
    # hidden states belong to request ``i`` (their last ``num_rejected[i]`` rows held rejected
    # drafts). Filled only for proposers with ``needs_hidden_states``.
    query_start_loc: np.ndarray | None = None  # [B + 1]
    positions: np.ndarray | None = None  # [num_step_tokens] position of each hidden-state row
    hidden_states: torch.Tensor | None = None  # [num_step_tokens, H] final states (after the final norm)
    # One [num_step_tokens, H] per hidden_state_layers: the residual stream entering that layer.
    aux_hidden_states: tuple[torch.Tensor, ...] = ()
    # Row of ``hidden_states`` whose logits produced each request's newest token.
    sampled_rows: np.ndarray | None = None  # [B]
    plan: SchedulerOutput | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def sampled_hidden_states(self) -> torch.Tensor | None:
        """``[B, H]``: the hidden state each request's newest token was sampled from (Medusa's
        and MTP's first-step input)."""
        if self.hidden_states is None or self.sampled_rows is None:
            return None
        import torch

        return self.hidden_states[torch.as_tensor(self.sampled_rows, device=self.hidden_states.device)]


@dataclass(slots=True)
class DraftProposal:
    """Next-step drafts, in ``ProposerInputs`` order. Set by the proposer."""

    draft_token_ids: list[list[int]]
    # Per request ``[len(drafts), V]`` float32 probabilities each draft was sampled from, for
    # proposers with ``returns_draft_probs``; None rows (and greedy requests) mean one-hot.
    draft_probs: list[torch.Tensor | None] | None = None


def draft_limits(config: EngineConfig, inputs: ProposerInputs, k: int) -> np.ndarray:
    """How many drafts each request may take: ``k``, less where the next step's ``drafts + 1``
    tokens would pass ``max_model_len`` or the request's ``max_tokens``."""
    max_model_len = config.max_model_len or 1 << 62
    lengths = np.array([len(t) for t in inputs.token_ids], dtype=np.int64)
    num_output = lengths - inputs.num_prompt_tokens
    max_tokens = np.array([p.max_tokens if p.max_tokens is not None else 1 << 62 for p in inputs.sampling_params],
                          dtype=np.int64)
    room = np.minimum(max_model_len - lengths, max_tokens - num_output) - 1
    return np.clip(room, 0, k)


class Proposer(ABC):
    """A speculative proposer. Built by ``factory(config, runner)`` from the proposer registry,
    then called directly by the runner once per step.

    Class attributes tell the runner what to provide and reserve.
    """

    # Fill ProposerInputs.hidden_states / sampled_rows / query_start_loc / positions.
    needs_hidden_states: ClassVar[bool] = False
    # Target layers whose outputs go to ProposerInputs.aux_hidden_states (EAGLE-3).
    hidden_state_layers: tuple[int, ...] = ()
    # The proposer keeps a paged KV cache indexed by the target's block table; the runner sizes the
    # block pool with ``kv_cache_bytes_per_block`` added to its own.
    has_kv_cache: ClassVar[bool] = False
    # ``DraftProposal.draft_probs`` is filled; the rejection sampler then uses min(1, p/q).
    returns_draft_probs: ClassVar[bool] = False

    def __init__(self, config: EngineConfig, runner: Any = None) -> None:
        spec = config.speculative_config
        if spec is None or isinstance(spec, (dict, str)):
            raise ValueError("a proposer needs a resolved speculative_config")
        self.config = config
        self.runner = runner
        self.num_speculative_tokens = spec.num_speculative_tokens

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of this proposer's KV cache per block of the target's pool (0: none)."""
        return 0

    def initialize(self, num_kv_blocks: int) -> None:
        """Allocate device state once the block pool is sized."""

    @abstractmethod
    def propose(self, inputs: ProposerInputs) -> DraftProposal:
        """Drafts for the next step: at most ``num_speculative_tokens`` per request and never
        past :func:`draft_limits`."""

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Forget finished and preempted requests (a preempted one is recomputed from scratch)."""

"""An acceptance-controlled proposer, for benchmarks: it runs a real proposer (so every step pays
that proposer's real drafting cost) and then replaces its drafts with the target's known greedy
continuation, each position right with probability ``alpha`` and otherwise a token the target is
known not to choose. Acceptance then follows ``alpha`` exactly, on any model, random weights
included, and speedup can be charted against acceptance for every method.

``speculative_config={"method": "controlled", "num_speculative_tokens": K, "extra": {"wraps": "ngram",
"alpha": 0.8}, ...the wrapped method's own keys}`` with ``plugin_options["controlled"] =
{"continuations": {tuple(prompt ids): [greedy output ids, ...]}}`` (a greedy run without speculation
gives them). Greedy requests only: a sampled target has no known continuation. A request whose
output departs from its known continuation (in bf16 the run with drafts can pick another token at
a near-tie than the run that recorded it) gets no more drafts, since the continuation no longer
tells what the target will choose; its id goes to ``diverged``, which a benchmark must report.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Iterable

import numpy as np
import torch

from specloop.plugins.options import options_of
from specloop.kernel.config import EngineConfig

from .base import DraftProposal, LaunchInputs, Proposer, ProposerContext, ProposerInputs, draft_limits


class ControlledProposer(Proposer):
    config_fields = None  # the wrapped method's, checked when it is built

    def __init__(self, config: EngineConfig, context: ProposerContext | None = None) -> None:
        super().__init__(config, context)
        spec = config.speculative_config
        extra = dict(spec.extra)
        wraps = extra.pop("wraps", None)
        if not wraps or wraps == "controlled":
            raise ValueError("speculative_config.method='controlled' needs 'wraps': the method whose cost it pays")
        self.alpha = float(extra.pop("alpha", 0.8))
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"speculative_config.alpha must be in [0, 1], got {self.alpha}")
        self.seed = int(extra.pop("seed", 0))
        options = options_of(config, "controlled", ("continuations",))
        self.continuations: dict[tuple[int, ...], list[int]] = dict(options.get("continuations", {}))
        inner = copy.copy(config)
        # Every other key is the wrapped method's (which refuses what it does not read).
        inner.speculative_config = dataclasses.replace(spec, method=wraps, extra=extra)
        if context is None or context.proposers is None:
            raise ValueError("speculative_config.method='controlled' needs the engine's proposer registry")
        self.inner: Proposer = context.proposers.create(wraps, config=inner, context=context)
        self.needs_hidden_states = self.inner.needs_hidden_states
        self.runs_on_prefill_chunks = self.inner.runs_on_prefill_chunks
        self.catches_up, self.launches = self.inner.catches_up, self.inner.launches
        self.records_hidden_states = self.inner.records_hidden_states
        self.hidden_state_layers = self.inner.hidden_state_layers
        self.vocab_size = context.vocab_size
        self.diverged: set[str] = set()

    def kv_cache_bytes_per_block(self) -> int:
        return self.inner.kv_cache_bytes_per_block()

    def initialize(self, num_kv_blocks: int) -> None:
        self.inner.device_step = self.device_step  # its graphs read the step; the drafts are ours
        self.inner.initialize(num_kv_blocks)

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        self.inner.remove_requests(req_ids)

    def record(self, hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor],
               slot_mapping: torch.Tensor) -> None:
        self.inner.record(hidden_states, aux_hidden_states, slot_mapping)

    def skip(self) -> None:
        self.inner.skip()

    def propose(self, inputs: ProposerInputs) -> DraftProposal:
        self.inner.propose(inputs)  # its cost is what is being measured
        limits = draft_limits(self.config, inputs, self.num_speculative_tokens)
        drafts = [self._drafts(rid, tokens.tolist(), int(inputs.num_prompt_tokens[i]), int(limits[i]))
                  for i, (rid, tokens) in enumerate(zip(inputs.req_ids, inputs.token_ids))]
        return DraftProposal(drafts)

    def launch(self, step: LaunchInputs) -> torch.Tensor | None:
        """The wrapped proposer's launch (its real device cost), its drafts replaced by the
        controlled ones. Those follow the tokens the step will commit, which the host predicts
        from the known continuation: the drafts the step verifies up to the first one off it, then
        the continuation's next token. Where the target departs from it instead, the request
        diverged (the next launch or proposal sees it), and its drafts only lose acceptance."""
        drafts = self.inner.launch(step)
        if drafts is None:
            return None
        step.drafts_written = False  # the runner writes the controlled drafts instead
        k = drafts.shape[1]
        rows = np.zeros((len(step.req_ids), k), dtype=np.int64)
        for i, rid in enumerate(step.req_ids):
            tokens, num_prompt = list(step.token_ids[i]), step.num_prompt_tokens[i]
            truth = self._truth(rid, tokens, num_prompt)
            done = len(tokens) - num_prompt
            for draft in step.drafts[i]:
                if done >= len(truth) or draft != truth[done]:
                    break
                tokens.append(draft)
                done += 1
            if done < len(truth):
                tokens.append(truth[done])
            row = self._drafts(rid, tokens, num_prompt, k)
            rows[i, :len(row)] = row
        return torch.from_numpy(rows).pin_memory().to(drafts.device, non_blocking=True) if drafts.is_cuda \
            else torch.from_numpy(rows)

    def _truth(self, rid: str, tokens: list[int], num_prompt: int) -> list[int]:
        truth = self.continuations.get(tuple(tokens[:num_prompt]))
        if truth is None:
            raise KeyError(f"no known continuation for request {rid!r}'s prompt")
        return truth

    def _drafts(self, rid: str, tokens: list[int], num_prompt: int, limit: int) -> list[int]:
        """Up to ``limit`` controlled drafts after ``tokens``: none once the request has left its
        known continuation."""
        truth = self._truth(rid, tokens, num_prompt)
        done = len(tokens) - num_prompt  # output tokens so far; the drafts continue from there
        if rid in self.diverged or tokens[num_prompt:] != list(truth[:done]):
            self.diverged.add(rid)
            return []
        rng = np.random.default_rng([self.seed, num_prompt, done, *tokens[:4]])
        row = []
        for j in range(limit):
            if done + j >= len(truth):
                break
            right = truth[done + j]
            row.append(right if rng.random() < self.alpha else (right + 1) % self.vocab_size)
        return row

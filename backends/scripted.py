"""A torch-free model runner whose "model" is a deterministic function of the token history.

It exists to drive the microkernel in tests and demos without a model: it follows plans exactly
like a real runner (resident per-request state, partial prefills produce nothing, drafts are
verified greedily against the scripted target), and can propose drafts that are right with a
given probability.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from specloop.plugins.options import options_of
from specloop.kernel.config import EngineConfig
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.outputs import DraftTokenIds, ModelRunnerOutput, SchedulerOutput


def scripted_next_token(token_ids: list[int], vocab_size: int) -> int:
    """The scripted target: the token that follows ``token_ids``."""
    a = token_ids[-1] if token_ids else 0
    b = token_ids[-2] if len(token_ids) > 1 else 0
    return (a * 7 + b * 3 + len(token_ids) * 5 + 1) % vocab_size


def scripted_continuation(token_ids: list[int], num_tokens: int, vocab_size: int) -> list[int]:
    """The ``num_tokens`` tokens the scripted target generates after ``token_ids``."""
    history, out = list(token_ids), []
    for _ in range(num_tokens):
        out.append(scripted_next_token(history, vocab_size))
        history.append(out[-1])
    return out


@dataclass
class _ReqState:
    token_ids: list[int]
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)


class ScriptedModelRunner:
    """Options (``config.plugin_options["scripted"]``): ``vocab_size`` (1000), ``num_kv_blocks``
    (from the config, else 1024), ``draft_accuracy`` (probability a proposed draft is right, 1.0),
    ``model_max_len`` (4096)."""

    # Read by the frontend: no model directory (and so no default model) is needed.
    requires_model = False
    async_scheduling = False  # every plan is committed before the next is scheduled

    def __init__(self, config: EngineConfig, plugins: Any = None) -> None:
        opts = dict(options_of(config, "scripted", ("vocab_size", "model_max_len", "draft_accuracy")))
        self.config = config
        self.vocab_size = int(opts.get("vocab_size", 1000))
        self.model_max_len = int(opts.get("model_max_len", 4096))
        self.draft_accuracy = float(opts.get("draft_accuracy", 1.0))
        self._rng = random.Random(config.seed)
        self._reqs: dict[str, _ReqState] = {}
        self._plan: SchedulerOutput | None = None
        self._drafts: DraftTokenIds | None = None
        self.num_executed = 0

    def initialize(self) -> int:
        return self.config.num_kv_blocks or 1024

    def execute_model(self, plan: SchedulerOutput) -> None:
        for rid in plan.finished_req_ids | plan.preempted_req_ids:
            self._reqs.pop(rid, None)
        for new in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs):
            self._reqs[new.req_id] = _ReqState(list(new.prompt_token_ids) + list(new.output_token_ids),
                                               new.num_computed_tokens, list(new.block_ids))
        for cached in plan.scheduled_running_reqs:
            state = self._reqs[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed = cached.num_computed_tokens
        self._plan = plan
        self.num_executed += 1

    def sample_tokens(self, grammar: Any = None) -> ModelRunnerOutput:
        """Scripted tokens; a grammar is ignored (this runner has no logits to mask)."""
        plan, self._plan = self._plan, None
        assert plan is not None, "sample_tokens without execute_model"
        req_ids, sampled = [], []
        drafts = DraftTokenIds([], [])
        k = self.config.num_lookahead_tokens
        for rid, n in plan.num_scheduled_tokens.items():
            state = self._reqs[rid]
            spec = plan.scheduled_spec_decode_tokens.get(rid, [])
            end = state.num_computed + n
            req_ids.append(rid)
            if end < len(state.token_ids) + len(spec):  # partial prefill: nothing to sample yet
                sampled.append([])
                continue
            history = list(state.token_ids)
            out: list[int] = []
            for d in spec:
                t = scripted_next_token(history, self.vocab_size)
                out.append(t)
                if t != d:
                    break
                history.append(t)
            else:
                out.append(scripted_next_token(history, self.vocab_size))
            sampled.append(out)
            if k:
                history = list(state.token_ids) + out
                proposal = []
                for _ in range(k):
                    t = scripted_next_token(history, self.vocab_size)
                    if self._rng.random() >= self.draft_accuracy:
                        t = (t + 1) % self.vocab_size
                    proposal.append(t)
                    history.append(t)
                drafts.req_ids.append(rid)
                drafts.draft_token_ids.append(proposal)
        self._drafts = drafts if drafts.req_ids else None
        return ModelRunnerOutput(req_ids, sampled)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        drafts, self._drafts = self._drafts, None
        return drafts

    def shutdown(self) -> None:
        self._reqs.clear()


@hookimpl
def specloop_register_model_runners(register):
    register("scripted", ScriptedModelRunner)

"""The runner's side of speculative decoding: after sampling, hand the requests that sampled (and,
to a proposer with ``runs_on_prefill_chunks``, those that computed a prefill chunk) to the proposer
(``specloop.proposers``) with what it declared it needs, keep its drafts for
``take_draft_token_ids`` and the probabilities they were drawn from for the next verification.

With ``pad_drafts`` (set when the executor replays CUDA graphs of uniform batches), every request
that sampled gets as many drafts as the longest in the batch, where ``max_model_len`` allows (not
``max_tokens``: the scheduler drops tokens past a stop): a request with fewer repeats its last
draft (or its newest token); after a proposal launched from the device it verifies that
proposal's own later drafts instead (they are on the device already, and the host does not
know the drafts it would repeat). A padded draft is a deterministic proposal like any other, so
verification stays exact (greedy output is unchanged; sampled output still follows the target);
it costs a few more verified tokens and turns a ragged decode batch, which would run eagerly, into
one a graph replays. Padded drafts count as drafts in the metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from specloop.kernel.config import EngineConfig
from specloop.kernel.outputs import DraftTokenIds, SchedulerOutput
from specloop.proposers.base import DraftProposal, LaunchInputs, Proposer, ProposerInputs, draft_limits
from specloop.proposers.policy import SpeculationPolicy, StepObservation

from .batch import InputBatch
from .parts import DeviceRows
from .requests import PLACEHOLDER, CachedRequestState
from .step_rates import StepRates, StepRecord


@dataclass(slots=True)
class DeviceDrafts:
    """A launched proposal's drafts, left on the device: the host's copy (``[n, K]``, in one of two
    pinned buffers used in turn), valid once ``copied`` has passed, and the requests that took
    placeholders for them (request id, row)."""

    host: torch.Tensor
    copied: torch.cuda.Event | None
    rows: list[tuple[str, int]] = field(default_factory=list)


class DraftingStage:
    def __init__(self, proposer: Proposer, policy: SpeculationPolicy, config: EngineConfig) -> None:
        # Every rank runs the proposer and asks the policy; their calls must agree step by step.
        if config.tensor_parallel_size > 1 and not getattr(policy, "same_on_every_rank", False):
            name = getattr(config.speculative_config, "policy", type(policy).__name__)
            raise ValueError(f"speculative_config.policy={name!r} decides from timings each rank measures for "
                             f"itself, so the ranks would draft differently; with tensor_parallel_size > 1 use "
                             f"'fixed'")
        self.proposer = proposer
        self.policy = policy
        self.config = config
        self.pad_drafts = False
        # Per request, the probabilities its pending drafts were sampled from (None: one-hot).
        self.draft_probs: dict[str, torch.Tensor | None] = {}
        self.rates = StepRates(policy)  # each step's record; steady steps' rates to the policy
        # Per request, its token ids as an array kept across steps (buffer, tokens valid in it):
        # a step appends its few new tokens instead of converting the whole list again.
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}
        # Launching proposals from the device (``launcher``): where their drafts go, this step's
        # launch, the last one until its host copy is read, and per request the values its
        # placeholder drafts stand for.
        self.device_rows: DeviceRows | None = None
        self._launched: DeviceDrafts | None = None  # this step's launch
        self._unread: DeviceDrafts | None = None  # the last step's, until its copy is read
        self._on_device: dict[str, list[int]] = {}  # per request, its placeholders' values
        self._host_drafts: list[torch.Tensor] = []

    def attach(self, executor: object, device_rows: DeviceRows | None) -> None:
        """Pad drafts when the executor replays uniform batches; launch proposals from the device
        when the platform supplies ``device_rows`` (one rank: all would have to launch alike)."""
        self.pad_drafts = getattr(executor, "replays_uniform_batches", False)
        self.device_rows = device_rows if self.config.tensor_parallel_size == 1 else None
        if self.proposer.launches:
            self.proposer.device_step = self.device_rows

    def begin_step(self, plan: SchedulerOutput) -> StepRecord:
        """Called as a step starts sampling: whether to propose after it (the policy's
        ``drafting``; always for a proposer that cannot skip steps). Reports the previous steps'
        tokens per second to the policy (``StepRates.add``)."""
        num_reqs = len(plan.num_scheduled_tokens)
        length = int(self.policy.drafting(list(plan.num_scheduled_tokens)))
        wanted, admitted = length > 0, len(plan.scheduled_new_reqs) + len(plan.scheduled_resumed_reqs)
        record = StepRecord(wanted or not self.proposer.catches_up,
                            wanted or any(plan.scheduled_spec_decode_tokens.values()), time.perf_counter(), length,
                            num_reqs, admitted >= num_reqs, admitted > 0)
        self.rates.add(record)
        return record

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.proposer.hidden_state_layers)

    def remove(self, req_ids: frozenset[str], finished: frozenset[str]) -> None:
        for rid in req_ids:
            for kept in (self.draft_probs, self._arrays, self._on_device):
                kept.pop(rid, None)
        if req_ids:
            self.proposer.remove_requests(req_ids)
            if self._unread is not None:
                self._unread.rows = [(rid, row) for rid, row in self._unread.rows if rid not in req_ids]
        if finished:
            self.policy.forget(list(finished))

    def before_sampling(self, batch: InputBatch, hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor],
                        requests: dict[str, CachedRequestState], grammar: object,
                        propose: bool) -> Callable[[torch.Tensor], None] | None:
        """Resolve the drafts the step verifies (:meth:`resolve`); for a step to propose after,
        the :meth:`launcher` the sampler may call."""
        self._launched = None
        self.resolve(batch)
        return self.launcher(batch, hidden_states, aux_hidden_states, requests, grammar) if propose else None

    def resolve(self, batch: InputBatch) -> None:
        """Before a step samples: the values of the placeholder drafts it verifies (copied to the
        host a step ago, while that step's proposal ran)."""
        launched, self._unread = self._unread, None
        if launched is not None:  # read once, whole: its buffer takes the launch after next
            if launched.copied is not None:
                launched.copied.synchronize()
            values = launched.host.tolist()
            for rid, row in launched.rows:
                self._on_device[rid] = values[row]
        if not self._on_device:
            return
        specs = batch.spec_token_ids
        for i, rid in enumerate(batch.req_ids):
            if specs[i] and specs[i][0] == PLACEHOLDER:
                specs[i] = self._on_device.pop(rid)[:len(specs[i])]

    def launcher(self, batch: InputBatch, hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor],
                 requests: dict[str, CachedRequestState], grammar: object) -> Callable[[torch.Tensor], None] | None:
        """For a step the stage will propose after: when it is a uniform verification (``q`` rows
        a request, all sampled) with no structured output (``grammar``: the step's bitmask), a
        function the sampler calls with the target's greedy tokens still on the device. It
        computes each request's accepted rows
        there, launches the proposer's whole proposal from them (``Proposer.launch``), writes the
        drafts into the device token rows and starts their copy to the host. ``propose`` then
        returns placeholders, and :meth:`resolve` their values at the next step."""
        n = len(batch.req_ids)
        q = batch.num_tokens // n if n else 0
        rows = self.device_rows
        if (rows is None or not self.proposer.launches or grammar is not None or q < 2
                or batch.num_tokens != n * q
                or any(count != q for _, count in batch.sample_rows)
                or any(requests[rid].sampling_params.structured_outputs is not None for rid in batch.req_ids)):
            return None

        def launch(top: torch.Tensor) -> None:
            reqs = [requests[rid] for rid in batch.req_ids]
            step = LaunchInputs(
                list(batch.req_ids), q, np.asarray(batch.layout.starts, dtype=np.int64), [r.block_ids for r in reqs],
                top[:n * q], hidden_states[:n * q],
                accept_rows=lambda: rows.accept(batch.input_ids, top[:n * q], batch.positions, q),
                aux_hidden_states=tuple(a[:n * q] for a in aux_hidden_states),
                # the step's tensors at fixed addresses, when the sampler left the argmax where they are
                device=rows if top.data_ptr() == rows.top.data_ptr() else None, rows=batch.rows,
                token_ids=[r.token_ids for r in reqs], num_prompt_tokens=[r.num_prompt_tokens for r in reqs],
                drafts=batch.spec_token_ids)
            drafts = self.proposer.launch(step)
            if drafts is None:
                return
            if not step.drafts_written:
                rows.write_drafts(drafts, step.accept(), batch.positions, q)
            if not self._host_drafts:
                self._host_drafts = [torch.empty((self.config.max_num_seqs, drafts.shape[1]), dtype=torch.int64,
                                                 pin_memory=drafts.is_cuda) for _ in range(2)]
            self._host_drafts.reverse()
            host = self._host_drafts[0][:n]
            host.copy_(drafts, non_blocking=True)
            copied = torch.cuda.Event() if drafts.is_cuda else None
            if copied is not None:
                copied.record()
            self._launched = DeviceDrafts(host, copied)

        return launch

    @property
    def launched(self) -> bool:  # this step's proposal was launched from the device
        return self._launched is not None

    def propose(self, plan: SchedulerOutput, batch: InputBatch, hidden_states: torch.Tensor,
                aux_hidden_states: list[torch.Tensor], sampled: list[list[int]] | None,
                requests: dict[str, CachedRequestState], step_seconds: float
                ) -> tuple[DraftTokenIds | None, StepObservation]:
        """The drafts, and what the step showed the policy's cost model (``step_seconds``: what its
        forward and sampling took). ``sampled`` None: a launched proposal after a verification not
        read yet; its observation's ``verified`` waits for :meth:`observe`."""
        start = time.perf_counter()
        if self._launched is not None:
            drafts = self._placeholders(plan, batch, sampled, requests)
        else:
            assert sampled is not None
            drafts = self._propose(plan, batch, hidden_states, aux_hidden_states, sampled, requests)
        step = StepObservation(batch.num_tokens, step_seconds, time.perf_counter() - start,
                               sum(map(len, drafts.draft_token_ids)) if drafts else 0, [])
        if sampled is not None:
            self.observe(step, batch, sampled)
        return drafts, step

    def observe(self, step: StepObservation, batch: InputBatch, sampled: list[list[int]]) -> None:
        """Tell the policy what the step verified and accepted."""
        step.verified = [(rid, len(spec), len(out) - 1)
                         for rid, spec, out in zip(batch.req_ids, batch.spec_token_ids, sampled) if spec and out]
        self.policy.observe(step)

    def after(self, record: StepRecord | None) -> bool:
        """Whether the proposer is called after this step's sampling; if not, it is told it
        skipped the step (``Proposer.skip``)."""
        propose = record is None or record.propose
        if not propose:
            self.proposer.skip()
        return propose

    def _placeholders(self, plan: SchedulerOutput, batch: InputBatch, sampled: list[list[int]] | None,
                      requests: dict[str, CachedRequestState]) -> DraftTokenIds | None:
        """The launched proposal's drafts as placeholders, as many per request as ``propose``
        would keep (:func:`draft_limits`, then padding), each standing for its row of the launch.
        ``sampled`` None: the verification is not read yet; the requests' token ids end in one
        placeholder per row it computed (as if it accepted every draft), which bounds the limits."""
        launched, self._launched = self._launched, None
        self.draft_probs.clear()
        if sampled is None:
            sampled = [[PLACEHOLDER] * count for _, count in batch.sample_rows]
        inputs = self._inputs(plan, batch, sampled, requests, list(range(len(batch.req_ids))))
        k = self.proposer.num_speculative_tokens
        inputs.max_drafts = np.array(self.policy.choose(inputs.req_ids, k), dtype=np.int64)
        drafts = [[PLACEHOLDER] * int(m) for m in draft_limits(self.config, inputs, k)]
        if self.pad_drafts:
            self._pad(inputs, drafts, [None] * len(drafts))
        keep = [i for i, d in enumerate(drafts) if d]
        for i in keep:
            self.draft_probs[inputs.req_ids[i]] = None
            if drafts[i][0] == PLACEHOLDER:
                launched.rows.append((inputs.req_ids[i], i))
        self._unread = launched
        if not keep:
            return None
        return DraftTokenIds([inputs.req_ids[i] for i in keep], [drafts[i] for i in keep])

    def _inputs(self, plan: SchedulerOutput, batch: InputBatch, sampled: list[list[int]],
                requests: dict[str, CachedRequestState], idx: list[int]) -> ProposerInputs:
        """The proposer's inputs for batch requests ``idx``, less the hidden states."""
        reqs = [requests[batch.req_ids[i]] for i in idx]
        num_drafts = [len(batch.spec_token_ids[i]) for i in idx]
        return ProposerInputs(
            req_ids=[r.req_id for r in reqs],
            token_ids=[self._token_array(r) for r in reqs],  # this step's tokens included
            num_prompt_tokens=np.array([r.num_prompt_tokens for r in reqs], dtype=np.int64),
            num_sampled=np.array([len(sampled[i]) for i in idx], dtype=np.int64),
            # A request that verified d drafts and emitted s tokens accepted s - 1 of them.
            num_rejected=np.array([d - (len(sampled[i]) - 1) if d else 0 for d, i in zip(num_drafts, idx)],
                                  dtype=np.int64),
            sampling_params=[r.sampling_params for r in reqs],
            seeds=np.array([r.seed for r in reqs], dtype=np.int64),
            eos_token_ids=[r.eos_token_ids for r in reqs],
            block_ids=[r.block_ids for r in reqs],
            plan=plan,
        )

    def _propose(self, plan: SchedulerOutput, batch: InputBatch, hidden_states: torch.Tensor,
                 aux_hidden_states: list[torch.Tensor], sampled: list[list[int]],
                 requests: dict[str, CachedRequestState]) -> DraftTokenIds | None:
        chunks = self.proposer.runs_on_prefill_chunks
        idx = [i for i, s in enumerate(sampled) if s or chunks]
        self.draft_probs.clear()
        if not idx:
            return None
        inputs = self._inputs(plan, batch, sampled, requests, idx)
        k = self.proposer.num_speculative_tokens
        inputs.max_drafts = np.array(self.policy.choose(inputs.req_ids, k), dtype=np.int64)
        if self.proposer.needs_hidden_states:
            _add_hidden_states(inputs, batch, hidden_states, aux_hidden_states, sampled, idx,
                               states=not self.proposer.records_hidden_states)
        proposal: DraftProposal = self.proposer.propose(inputs)
        drafts = [list(map(int, d)) for d in proposal.draft_token_ids]
        probs = list(proposal.draft_probs) if proposal.draft_probs else [None] * len(drafts)
        if self.pad_drafts:
            self._pad(inputs, drafts, probs)
        # A request in the middle of its prompt takes no drafts, whatever a proposer returns for it.
        keep = [k for k, d in enumerate(drafts) if d and inputs.num_sampled[k]]
        for k in keep:
            self.draft_probs[inputs.req_ids[k]] = probs[k]
            self._on_device.pop(inputs.req_ids[k], None)
        if not keep:
            return None
        return DraftTokenIds([inputs.req_ids[k] for k in keep], [drafts[k] for k in keep])

    def _token_array(self, state: CachedRequestState) -> np.ndarray:
        """``state.token_ids`` as an int64 array (a view of a buffer kept for the request; read
        only). A resident request's token ids only grow, and a position keeps its value once it is
        no longer a placeholder, so only the tokens since the last call are copied."""
        ids = state.token_ids
        total = len(ids)
        buffer, valid = self._arrays.get(state.req_id, (None, 0))
        if buffer is None or valid > total:
            buffer, valid = None, 0
        if buffer is None or total > len(buffer):
            grown = np.empty(max(2 * total, 64), dtype=np.int64)
            if buffer is not None:
                grown[:valid] = buffer[:valid]
            buffer = grown
        if total > valid:
            buffer[valid:total] = ids[valid:total]
        # A placeholder (a token still on the device) is copied again next time.
        resolved = total if PLACEHOLDER not in ids[valid:total] else ids.index(PLACEHOLDER, valid)
        self._arrays[state.req_id] = (buffer, resolved)
        view = buffer[:total]
        view.flags.writeable = False
        return view

    def _pad(self, inputs: ProposerInputs, drafts: list[list[int]], probs: list[torch.Tensor | None]) -> None:
        """Pad every sampling request's drafts towards the longest (module docstring), in place:
        past the policy's choice and the request's ``max_tokens`` (the scheduler drops what a
        verification commits past a stop, so near its end a request still rides the batch's
        graph), never past ``max_model_len``."""
        sampling = [k for k in range(len(drafts)) if inputs.num_sampled[k]]
        longest = max((len(drafts[k]) for k in sampling), default=0)
        if not longest or all(len(drafts[k]) == longest for k in sampling):
            return
        max_model_len = self.config.max_model_len or 1 << 62
        for k in sampling:
            room = max_model_len - len(inputs.token_ids[k]) - 1
            missing = min(longest, room) - len(drafts[k])
            if missing <= 0:
                continue
            fill = drafts[k][-1] if drafts[k] else int(inputs.token_ids[k][-1])
            drafts[k].extend([fill] * missing)
            if probs[k] is not None:
                one_hot = torch.zeros(missing, probs[k].shape[-1], dtype=probs[k].dtype, device=probs[k].device)
                one_hot[:, fill] = 1.0
                probs[k] = torch.cat([probs[k][:len(drafts[k]) - missing], one_hot])


def _add_hidden_states(inputs: ProposerInputs, batch: InputBatch, hidden: torch.Tensor, aux: list[torch.Tensor],
                       sampled: list[list[int]], idx: list[int], states: bool = True) -> None:
    """The hidden-state rows of the requests in ``inputs``, made contiguous when partial prefills
    (which sample nothing) sit between them; without ``states`` (a proposer that reads the states
    it recorded during the forward) only their layout: query starts, positions, sampled rows."""
    qsl = batch.query_start_loc
    rows = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in idx])
    lengths = np.array([qsl[i + 1] - qsl[i] for i in idx], dtype=np.int64)
    sub_qsl = np.concatenate([[0], np.cumsum(lengths)])
    positions = batch.positions.cpu().numpy()
    inputs.query_start_loc = sub_qsl
    inputs.positions = positions[rows]
    if states:
        hidden = hidden[:batch.num_tokens]
        if len(idx) != len(batch.req_ids):
            index = torch.as_tensor(rows, device=hidden.device)
            hidden, aux = hidden[index], [a[index] for a in aux]
        inputs.hidden_states = hidden
        inputs.aux_hidden_states = tuple(aux)
    # The newest token came from the row of the last accepted draft (or the bonus row).
    inputs.sampled_rows = np.array([sub_qsl[k + 1] - batch.sample_rows[i][1] + len(sampled[i]) - 1
                                    if sampled[i] else -1 for k, i in enumerate(idx)], dtype=np.int64)


"""The torch model runner: resident request state, paged KV cache, forward, sampling, proposing.

One step (seed 004 §10, seed 000's ``sample_tokens``)::

    execute_model(plan)   update_states -> prepare_inputs -> forward      (hidden states kept)
    sample_tokens()       compute_logits -> sample | verify drafts -> logprobs -> propose

Each stage is its own method so a device-specific runner can subclass this one and replace only
what it accelerates (input packing, the forward, the sampler).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from specloop.kernel.config import EngineConfig
from specloop.kernel.outputs import DraftTokenIds, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from specloop.proposers.base import DraftProposal, ProposerInputs
from specloop.proposers.verify import RejectionSampler

from . import sampler as sampling
from .attention import ForwardContext
from .input_batch import InputBatch, RequestState, prepare_inputs

CPU_KV_CACHE_BYTES = 512 << 20  # the CPU default when neither num_kv_blocks nor kv_cache_memory is set


@dataclass(slots=True)
class ExecutedStep:
    """What ``execute_model`` leaves for ``sample_tokens`` (``runner.executed`` in between)."""

    plan: SchedulerOutput
    batch: InputBatch | None
    hidden_states: torch.Tensor | None
    aux_hidden_states: list[torch.Tensor]


class TorchModelRunner:
    """Runs a Hugging Face-format checkpoint with plain PyTorch on any device.

    Seams for other components:

    * ``proposer``: a :class:`specloop.proposers.base.Proposer` built from
      ``config.speculative_config`` through the ``proposers`` registry; :meth:`propose` calls it
      after sampling with :class:`ProposerInputs`, and its class attributes decide what the
      runner keeps (hidden states, ``hidden_state_layers``) and reserves (its own KV cache).
    * ``rejection_sampler``: when set, verifies drafts instead of the built-in exact-match check
      (see :meth:`sample` and :meth:`verify`); it receives the previous proposal's draft
      probabilities.
    """

    def __init__(self, config: EngineConfig, plugins: Any) -> None:
        from specloop.plugins.models.loader import load_model, resolve_device

        if not config.model:
            raise ValueError("the torch model runner needs a model: pass model=PATH to a local "
                             "Hugging Face-format directory")
        self.config = config
        self.plugins = plugins
        self.device = resolve_device(config.device)
        self.model, self.model_config = load_model(config.model, plugins.models, self.device, config.dtype)
        self.dtype = next(self.model.parameters()).dtype
        self.vocab_size = self.model_config.vocab_size
        self.model_max_len = self.model_config.max_position_embeddings
        self.eos_token_ids = self.model_config.eos_token_ids  # generation_config.json's, for the frontend
        self.attn_backend = plugins.attention_backends.create(config.attention_backend or "torch", config=config)
        self.block_size = config.block_size
        self.requests: dict[str, RequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.proposer: Any = None
        self.rejection_sampler: Callable[..., list[list[int]]] | None = None
        self.aux_layers: tuple[int, ...] = ()
        self.executed: ExecutedStep | None = None
        self._drafts: DraftTokenIds | None = None
        # Per request, the probabilities its pending drafts were sampled from (None: one-hot).
        self.draft_probs: dict[str, torch.Tensor | None] = {}
        # Per request, prompt-logprob entries already reported; survives preemption so that a
        # recomputed prefill does not report them twice.
        self.prompt_logprobs_sent: dict[str, int] = {}

    # --- setup --------------------------------------------------------------------------------

    def initialize(self) -> int:
        spec = self.config.speculative_config
        if spec is not None:
            self.proposer = self.plugins.proposers.create(spec.method, config=self.config, runner=self)
            self.aux_layers = tuple(self.proposer.hidden_state_layers)
            self.rejection_sampler = RejectionSampler()
        num_blocks = self.determine_num_kv_blocks()
        mc = self.model_config
        shape = self.attn_backend.kv_cache_shape(num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)]
        if self.proposer is not None:
            self.proposer.initialize(num_blocks)
        return num_blocks

    def kv_bytes_per_block(self) -> int:
        """Bytes one block costs across the target's layers and the proposer's, if it keeps a cache."""
        size = self.model_config.kv_bytes_per_block(self.block_size, self.dtype.itemsize)
        if self.proposer is not None:
            size += self.proposer.kv_cache_bytes_per_block()
        return size

    def determine_num_kv_blocks(self) -> int:
        """``num_kv_blocks`` if given; else ``kv_cache_memory`` bytes; else on CUDA what
        ``gpu_memory_utilization`` leaves after weights and a profiled peak step; else a CPU
        default of 512 MiB, capped at what ``max_num_seqs`` full-length sequences need."""
        c = self.config
        if c.num_kv_blocks:
            return c.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if c.kv_cache_memory:
            budget = c.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            blocks_per_seq = -(-(c.max_model_len or 2048) // self.block_size)
            budget = min(CPU_KV_CACHE_BYTES, per_block * (c.max_num_seqs * blocks_per_seq + 1))
        num_blocks = int(budget // per_block)
        if num_blocks < 1:
            raise ValueError(f"the KV-cache budget ({budget} bytes) is smaller than one block "
                             f"({per_block} bytes); raise kv_cache_memory or gpu_memory_utilization")
        return num_blocks

    def _cuda_kv_budget(self) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory this process's allocator does not own belongs to other processes or the CUDA context.
        others = total - free - torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        return int(total * self.config.gpu_memory_utilization - others - peak)

    def _profile_run(self) -> None:
        """One forward over ``max_num_batched_tokens`` tokens plus logits for ``max_num_seqs`` rows,
        so the allocator's peak covers the largest step."""
        from .attention import AttentionMetadata

        mc = self.model_config
        n = int(min(self.config.max_num_batched_tokens or 8192, self.config.max_model_len or 8192))
        blocks = -(-n // self.block_size)
        shape = self.attn_backend.kv_cache_shape(blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            slot_mapping=torch.arange(n, device=dev),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None],
            max_query_len=n, max_seq_len=n, query_start_loc_cpu=[0, n], seq_lens_cpu=[n])
        with torch.inference_mode():
            hidden, _ = self.model(torch.zeros(n, dtype=torch.int64, device=dev), torch.arange(n, device=dev),
                                   ForwardContext(self.attn_backend, meta, caches), aux_layers=self.aux_layers)
            rows = min(n, self.config.max_num_seqs)
            self.model.compute_logits(hidden[:rows]).float().softmax(-1)
        del caches, hidden
        torch.cuda.synchronize(self.device)

    # --- execute_model ------------------------------------------------------------------------

    def execute_model(self, plan: SchedulerOutput) -> None:
        self.update_states(plan)
        if plan.total_num_scheduled_tokens == 0:
            self.executed = ExecutedStep(plan, None, None, [])
            return
        batch = prepare_inputs(plan, self.requests, self.block_size, self.device)
        hidden, aux = self.forward(batch)
        self.executed = ExecutedStep(plan, batch, hidden, aux)

    def update_states(self, plan: SchedulerOutput) -> None:
        """Apply the plan's changes to the resident per-request state."""
        for rid in plan.finished_req_ids:
            self.prompt_logprobs_sent.pop(rid, None)
        gone = plan.finished_req_ids | plan.preempted_req_ids
        for rid in gone:
            self.requests.pop(rid, None)
            self.draft_probs.pop(rid, None)
        if gone and self.proposer is not None:
            self.proposer.remove_requests(gone)
        for new in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs):
            params = new.sampling_params
            self.requests[new.req_id] = RequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                eos_token_ids=tuple(new.eos_token_ids),
                # Any int a client sends (or the derived one) fits int64 tensors from here on.
                seed=sampling.seed_to_int64(params.seed if params.seed is not None
                                            else self._derived_seed(new.req_id)),
            )
        for cached in plan.scheduled_running_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _derived_seed(self, req_id: str) -> int:
        # Stable across processes (unlike hash()) and across preemption, so an engine seed makes
        # unseeded requests reproducible too.
        return (self.config.seed << 32) ^ zlib.crc32(req_id.encode())

    def forward(self, batch: InputBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ctx = ForwardContext(self.attn_backend, batch.attn_metadata, self.kv_caches)
        with torch.inference_mode():
            return self.model(batch.input_ids, batch.positions, ctx, aux_layers=self.aux_layers)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.compute_logits(hidden_states).float()

    # --- sample_tokens ------------------------------------------------------------------------

    def sample_tokens(self) -> ModelRunnerOutput:
        step, self.executed = self.executed, None
        if step is None:
            raise RuntimeError("sample_tokens called without execute_model")
        self._drafts = None
        batch = step.batch
        if batch is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        logits = self.compute_logits(step.hidden_states[batch.logits_indices])
        meta, sample_logits = self.sampling_inputs(batch, logits)
        sampled, logprobs = self.sample(batch, meta, sample_logits)
        num_drafts = [len(s) for s in batch.spec_token_ids]
        num_accepted = [max(len(t) - 1, 0) if d else 0 for t, d in zip(sampled, num_drafts)]
        if self.proposer is not None:
            self._drafts = self.propose(batch, step, sampled, num_drafts, num_accepted)
        return ModelRunnerOutput(
            req_ids=list(batch.req_ids),
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs(batch, logits),
        )

    def sampling_inputs(self, batch: InputBatch, logits: torch.Tensor) -> tuple[sampling.SamplingMetadata,
                                                                                torch.Tensor]:
        """Sampling metadata and logits of every sampled row. Row ``j`` of a request verifying
        drafts sees the drafts before it as generated output (penalties, min_tokens)."""
        rows: list[sampling.SamplingRow] = []
        indices: list[int] = []
        eos = self.model_config.eos_token_ids
        for i, rid in enumerate(batch.req_ids):
            first, count = batch.sample_rows[i]
            if not count:
                continue
            state = self.requests[rid]
            params = state.sampling_params
            stop_ids = list(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids += [t for t in (*eos, *state.eos_token_ids) if t not in stop_ids]
            output = state.output_token_ids
            spec = batch.spec_token_ids[i]
            for j in range(count):
                rows.append(sampling.SamplingRow(params, state.seed, len(state.token_ids) + j,
                                                 state.prompt_token_ids, output + spec[:j], stop_ids))
                indices.append(first + j)
        meta = sampling.SamplingMetadata.build(rows, self.vocab_size, self.device)
        return meta, logits[torch.tensor(indices, dtype=torch.int64, device=logits.device)]

    def sample(self, batch: InputBatch, meta: sampling.SamplingMetadata, logits: torch.Tensor,
               ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None]:
        """Sample every row, verify drafts, and gather logprobs of the emitted tokens."""
        counts = [count for _, count in batch.sample_rows]
        if self.rejection_sampler is not None and any(batch.spec_token_ids):
            sampled = self.rejection_sampler(logits=logits, metadata=meta, spec_token_ids=batch.spec_token_ids,
                                             num_rows=counts,
                                             draft_probs=[self.draft_probs.get(r) for r in batch.req_ids])
        else:
            tokens = sampling.sample(logits, meta)
            sampled = self.verify(tokens.tolist(), batch.spec_token_ids, counts)
        if all(k is None for k in meta.num_logprobs):
            return sampled, None
        # Logprobs of the emitted tokens, each at the row that produced it.
        row_ids, emitted, first = [], [], 0
        for out, count in zip(sampled, counts):
            row_ids.extend(range(first, first + len(out)))
            emitted.extend(out)
            first += count
        index = torch.tensor(row_ids, dtype=torch.int64, device=logits.device)
        entries = sampling.compute_logprobs(logits[index], torch.tensor(emitted, dtype=torch.int64,
                                                                        device=logits.device),
                                            [meta.num_logprobs[r] for r in row_ids])
        logprobs: list[list[TokenLogprobs] | None] = []
        pos = 0
        for out in sampled:
            chunk = entries[pos:pos + len(out)]
            pos += len(out)
            logprobs.append(chunk if chunk and chunk[0] is not None else None)
        return sampled, logprobs

    @staticmethod
    def verify(tokens: list[int], spec_token_ids: list[list[int]], counts: list[int]) -> list[list[int]]:
        """Per request, accept drafts while they equal the target's own sample at their position;
        the first mismatch emits the target's token, full acceptance adds the bonus token. Exact for
        greedy decoding and for deterministic drafts (a point-mass draft distribution), where it is
        what rejection sampling reduces to."""
        out: list[list[int]] = []
        pos = 0
        for spec, count in zip(spec_token_ids, counts):
            target = tokens[pos:pos + count]
            pos += count
            accepted: list[int] = []
            for j, t in enumerate(target):
                accepted.append(t)
                if j >= len(spec) or t != spec[j]:
                    break
            out.append(accepted)
        return out

    def prompt_logprobs(self, batch: InputBatch, logits: torch.Tensor) -> dict[str, list[TokenLogprobs | None]]:
        """For requests with ``prompt_logprobs``: entries for prompt tokens ``s + 1 .. e`` scored by
        positions ``s .. e - 1`` computed this step, with a leading ``None`` (token 0 has no
        logprob) when the step starts at position 0. Concatenated over steps they cover the prompt
        once, in order, even when a preempted request recomputes its prefill."""
        out: dict[str, list[TokenLogprobs | None]] = {}
        for i, rid in enumerate(batch.req_ids):
            state = self.requests[rid]
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            first, count = batch.prompt_rows[i]
            start = batch.num_computed_tokens[i]
            entries: list[TokenLogprobs | None] = [None] if start == 0 else []
            if count:
                targets = torch.tensor(state.prompt_token_ids[start + 1:start + 1 + count], dtype=torch.int64,
                                       device=logits.device)
                entries.extend(sampling.compute_logprobs(logits[first:first + count], targets, [k] * count))
            # entries[j] is prompt token first_token + j
            first_token = 0 if start == 0 else start + 1
            sent = self.prompt_logprobs_sent.get(rid, 0)
            self.prompt_logprobs_sent[rid] = max(sent, first_token + len(entries))
            out[rid] = entries[max(0, sent - first_token):]
        return out

    # --- proposing ----------------------------------------------------------------------------

    def propose(self, batch: InputBatch, step: ExecutedStep, sampled: list[list[int]], num_drafts: list[int],
                num_accepted: list[int]) -> DraftTokenIds | None:
        """Hand the requests that sampled this step to the proposer; keep its drafts for
        :meth:`take_draft_token_ids` and their probabilities for the next verification."""
        idx = [i for i, s in enumerate(sampled) if s]
        self.draft_probs.clear()
        if not idx:
            return None
        reqs = [self.requests[batch.req_ids[i]] for i in idx]
        inputs = ProposerInputs(
            req_ids=[r.req_id for r in reqs],
            token_ids=[np.array(r.token_ids + sampled[i], dtype=np.int64) for r, i in zip(reqs, idx)],
            num_prompt_tokens=np.array([r.num_prompt_tokens for r in reqs], dtype=np.int64),
            num_sampled=np.array([len(sampled[i]) for i in idx], dtype=np.int64),
            num_rejected=np.array([num_drafts[i] - num_accepted[i] for i in idx], dtype=np.int64),
            sampling_params=[r.sampling_params for r in reqs],
            seeds=np.array([r.seed for r in reqs], dtype=np.int64),
            block_ids=[r.block_ids for r in reqs],
            plan=step.plan,
        )
        if self.proposer.needs_hidden_states:
            self._add_hidden_states(inputs, batch, step, sampled, idx)
        proposal: DraftProposal = self.proposer.propose(inputs)
        keep = [(k, d) for k, d in enumerate(proposal.draft_token_ids) if len(d)]
        for k, _ in keep:
            self.draft_probs[inputs.req_ids[k]] = proposal.draft_probs[k] if proposal.draft_probs else None
        if not keep:
            return None
        return DraftTokenIds([inputs.req_ids[k] for k, _ in keep], [list(map(int, d)) for _, d in keep])

    @staticmethod
    def _add_hidden_states(inputs: ProposerInputs, batch: InputBatch, step: ExecutedStep, sampled: list[list[int]],
                           idx: list[int]) -> None:
        """The hidden-state rows of the requests in ``inputs``, made contiguous when partial
        prefills (which sample nothing) sit between them."""
        qsl = batch.query_start_loc
        rows = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in idx])
        lengths = np.array([qsl[i + 1] - qsl[i] for i in idx], dtype=np.int64)
        sub_qsl = np.concatenate([[0], np.cumsum(lengths)])
        hidden, aux = step.hidden_states, step.aux_hidden_states
        positions = batch.positions.cpu().numpy()
        if len(idx) != len(batch.req_ids):
            index = torch.as_tensor(rows, device=hidden.device)
            hidden, aux = hidden[index], [a[index] for a in aux]
        inputs.query_start_loc = sub_qsl
        inputs.positions = positions[rows]
        inputs.hidden_states = hidden
        inputs.aux_hidden_states = tuple(aux)
        # The newest token came from the row of the last accepted draft (or the bonus row).
        inputs.sampled_rows = np.array([sub_qsl[k + 1] - batch.sample_rows[i][1] + len(sampled[i]) - 1
                                        for k, i in enumerate(idx)], dtype=np.int64)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        drafts, self._drafts = self._drafts, None
        return drafts

    def shutdown(self) -> None:
        self.requests.clear()
        self.kv_caches = []
        self.executed = None

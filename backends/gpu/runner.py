"""The ``"gpu"`` model runner: the torch runner with its hot path replaced.

One step::

    execute_model(plan)   update_states -> persistent batch (device) -> CUDA graph replay | fused forward
    sample_tokens()       plain batch: Gumbel-max kernel on per-slot device parameters, token written
                          back on the device, one small D2H; otherwise the reference path (logprobs,
                          penalties, top-k/top-p through ``backends.gpu.sampler``, drafts through the
                          rejection-sampling kernel, proposers)

Everything the torch runner offers (prefix hits, chunked prefill, preemption, speculative decoding,
prompt logprobs) keeps its semantics; ``TorchModelRunner`` stays the oracle for every stage
replaced here.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from specloop.backends.attention import ForwardContext
from specloop.backends.input_batch import InputBatch
from specloop.backends.sampler import SamplingMetadata
from specloop.backends.torch_runner import ExecutedStep, TorchModelRunner
from specloop.kernel.config import EngineConfig
from specloop.kernel.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from specloop.kernels.sampling import gumbel_sample

from . import sampler as gpu_sampler
from .attention import TritonAttentionBackend
from .cuda_graphs import DecodeGraphs
from .forward import RopeTables, fused_forward, supports
from .input_batch import PersistentBatch

logger = logging.getLogger("specloop")


class GpuModelRunner(TorchModelRunner):
    """Options (``config.plugin_options["gpu"]``): ``cuda_graphs`` (default: on unless
    ``enforce_eager``), ``fused`` (the fused-kernel forward, default on for Llama-family models)."""

    def __init__(self, config: EngineConfig, plugins: Any) -> None:
        super().__init__(config, plugins)
        self.attn_backend = plugins.attention_backends.create(config.attention_backend or "triton", config=config)
        opts = dict(config.plugin_options.get("gpu", {}))
        self.use_fused = bool(opts.get("fused", True)) and supports(self.model)
        self.use_graphs = (bool(opts.get("cuda_graphs", not config.enforce_eager)) and self.device.type == "cuda"
                           and self.use_fused)
        self.batch_state: PersistentBatch | None = None
        self.rope: RopeTables | None = None
        self.graphs: DecodeGraphs | None = None
        self._graph_logits: torch.Tensor | None = None
        self._host_tokens: torch.Tensor | None = None

    # --- setup --------------------------------------------------------------------------------

    def initialize(self) -> int:
        c = self.config
        max_len = (c.max_model_len or 2048) + c.num_lookahead_tokens + 1
        max_tokens = max(c.max_num_batched_tokens or 8192, c.max_num_seqs * (c.num_lookahead_tokens + 1))
        # Persistent buffers first, so the KV budget (profiled by the base class) sees them.
        self.batch_state = PersistentBatch(c.max_num_seqs, max_len, self.block_size, max_tokens, self.device)
        if self.use_fused:
            self.rope = RopeTables.build(self.model.layers[0].self_attn.rotary.inv_freq, max_len, self.device)
        self._host_tokens = torch.zeros(max_tokens, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        num_blocks = super().initialize()
        if self.device.type == "cuda" and isinstance(self.attn_backend, TritonAttentionBackend):
            mc = self.model_config
            self.attn_backend.tune_decode(self.kv_caches[0], mc.num_heads, c.max_num_seqs, min(max_len, 1024))
            logger.info("decode attention tile: %s (%s)", self.attn_backend.decode_config,
                        self.attn_backend.decode_tuning)
        if self.use_graphs and not self.aux_layers:
            q_lens = [1] + ([c.num_lookahead_tokens + 1] if c.num_lookahead_tokens else [])
            self.graphs = DecodeGraphs(self, q_lens)
            self.graphs.capture()
        return num_blocks

    # --- execute_model ------------------------------------------------------------------------

    def update_states(self, plan: SchedulerOutput) -> None:
        super().update_states(plan)
        pb = self.batch_state
        for rid in plan.finished_req_ids | plan.preempted_req_ids:
            pb.remove(rid)
        for new in (*plan.scheduled_new_reqs, *plan.scheduled_resumed_reqs):
            pb.add(self.requests[new.req_id])
        for cached in plan.scheduled_running_reqs:
            pb.update(self.requests[cached.req_id])

    def execute_model(self, plan: SchedulerOutput) -> None:
        self.update_states(plan)
        self._graph_logits = None
        if plan.total_num_scheduled_tokens == 0:
            self.executed = ExecutedStep(plan, None, None, [])
            return
        key = self.graphs.lookup(plan) if self.graphs is not None else None
        batch = self.batch_state.prepare(plan, self.requests, pad_to=key[1] if key else None,
                                         num_splits=self.graphs.splits[key] if key else 0)
        if key is not None:
            hidden, self._graph_logits = self.graphs.replay(key, batch.num_tokens)
            aux: list[torch.Tensor] = []
        else:
            hidden, aux = self.forward(batch)
        self.executed = ExecutedStep(plan, batch, hidden, aux)

    def forward(self, batch: InputBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if not self.use_fused:
            return super().forward(batch)
        ctx = ForwardContext(self.attn_backend, batch.attn_metadata, self.kv_caches)
        with torch.inference_mode():
            return fused_forward(self.model, batch.input_ids, batch.positions, ctx, self.rope, self.aux_layers)

    # --- sample_tokens ------------------------------------------------------------------------

    def sample_tokens(self) -> ModelRunnerOutput:
        step = self.executed
        if step is None or step.batch is None or self.proposer is not None or not self._plain(step.batch):
            return super().sample_tokens()
        self.executed, self._drafts = None, None
        return self._sample_plain(step.batch, step.hidden_states)

    def _plain(self, batch: InputBatch) -> bool:
        plain = self.batch_state.plain
        return all(plain[rid] for rid in batch.req_ids) and not any(batch.spec_token_ids)

    def _sample_plain(self, batch: InputBatch, hidden: torch.Tensor) -> ModelRunnerOutput:
        """Temperature / min-p / seed only: parameters gathered on the device by slot, one kernel,
        the tokens written back into the device token rows, one D2H of the tokens."""
        pb = self.batch_state
        num_rows = batch.logits_indices.shape[0]
        empty = [[] for _ in batch.req_ids]
        if num_rows == 0:
            return ModelRunnerOutput(list(batch.req_ids), empty)
        with torch.inference_mode():
            if self._graph_logits is not None:
                logits = (self._graph_logits[:num_rows] if num_rows == batch.num_tokens
                          else self._graph_logits.index_select(0, batch.logits_indices))
            else:
                logits = self.compute_logits(hidden.index_select(0, batch.logits_indices))
            rows = pb.sample_req_rows[:num_rows].long()
            slots = pb.req_slots.index_select(0, rows).long()
            any_min_p = any(self.requests[r].sampling_params.min_p > 0 for r in batch.req_ids)
            tokens = gumbel_sample(logits, pb.temperature.index_select(0, slots), pb.seeds.index_select(0, slots),
                                   pb.seq_lens.index_select(0, rows).long(),
                                   min_p=pb.min_p.index_select(0, slots) if any_min_p else None)
            pb.write_sampled(tokens)
            host = self._host_tokens[:num_rows]
            host.copy_(tokens, non_blocking=True)
            if tokens.is_cuda:
                torch.cuda.current_stream(tokens.device).synchronize()
        values = host.tolist()
        sampled = empty
        for i, (first, count) in enumerate(batch.sample_rows):
            if count:
                token = values[first]
                sampled[i] = [token]
                pb.note_sampled(batch.req_ids[i], batch.attn_metadata.seq_lens_cpu[i], token)
        return ModelRunnerOutput(list(batch.req_ids), sampled)

    def sample(self, batch: InputBatch, meta: SamplingMetadata, logits: torch.Tensor,
               ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None]:
        """Without drafts or logprobs: the reference's processing with the race on the Triton
        kernel. Drafts go to the rejection sampler (its Triton kernel on CUDA) and logprobs to the
        reference path."""
        if any(batch.spec_token_ids) or any(k is not None for k in meta.num_logprobs):
            return super().sample(batch, meta, logits)
        tokens = gpu_sampler.sample(logits, meta)
        return self.verify(tokens.tolist(), batch.spec_token_ids, [c for _, c in batch.sample_rows]), None

    def shutdown(self) -> None:
        self.graphs = None
        super().shutdown()

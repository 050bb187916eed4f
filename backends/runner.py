"""The model runner: one class, composed of parts a platform supplies.

One step::

    execute_model(plan)   apply the plan to the resident request state
                          -> batch builder: packed inputs      (host lists | device-resident rows)
                          -> executor: the model's forward    (eager | CUDA-graph replay)
    sample_tokens()       -> sampling stage: logits, sample or verify drafts, logprobs
                          -> drafting stage: the proposer's drafts for the next step

The ``"torch"`` runner composes the reference parts (any torch device); the ``"gpu"`` runner
(``backends.gpu.platform``) composes a device-resident batch, CUDA graphs, fused Triton ops and a
fast sampling path around the same reference parts, which stay the oracle for each of them.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from specloop.kernel.config import EngineConfig
from specloop.kernel.outputs import DraftTokenIds, ModelRunnerOutput, SchedulerOutput
from specloop.kernel.plugins import PluginManager
from specloop.models.attention import AttentionBackend
from specloop.models.config import ModelConfig
from specloop.models.loader import load_model, resolve_device
from specloop.models.ops import TORCH_OPS, Ops
from specloop.models.parallel import SINGLE, TensorParallel
from specloop.proposers.base import ProposerContext
from specloop.sampling.structured_outputs import GrammarBitmask

from . import kv_memory
from .batch import HostBatchBuilder, InputBatch
from .drafting import DraftingStage
from .step_rates import StepRecord
from .executor import EagerExecutor, ForwardOutput, GraphKey, Recorder
from .parts import BatchBuilder, Executor, RunnerParts, Sampler  # noqa: F401 (re-exported)
from .pending import DeviceClock, PendingOutput, provisional, read_later, rebase
from .requests import CachedRequestState, apply_plan
from .sampling_stage import SampleResult, SamplingStage, compute_logits


class Platform(Protocol):
    """Supplies a runner's parts. Called by :class:`ModelRunner` in this order."""

    default_attention_backend: str
    # How a step overlaps the host's next plan with asynchronous scheduling: "thread" (the step runs
    # on a worker thread) or "device" (launched work runs on while its sampled tokens, still on the
    # device, feed the next step's inputs).
    overlap: str
    # Optional: whether a verification whose next proposal launched from the device may be read a
    # step late (``backends.pending.read_later``); absent means False.
    late_verification: bool

    def ops(self, config: EngineConfig) -> Ops: ...

    def parts(self, runner: ModelRunner) -> RunnerParts:
        """Before the KV cache is sized (what the parts allocate counts against the budget)."""

    def kv_allocated(self, runner: ModelRunner) -> None:
        """After the KV cache is allocated (tuning, CUDA-graph capture)."""


class TorchPlatform:
    default_attention_backend = "torch"
    overlap = "thread"
    late_verification = False

    def ops(self, config: EngineConfig) -> Ops:
        return TORCH_OPS

    def parts(self, runner: ModelRunner) -> RunnerParts:
        return RunnerParts(HostBatchBuilder(runner.block_size, runner.device),
                           EagerExecutor(runner.model, runner.ops, runner.attn_backend, runner.aux_layers,
                                         runner.recorder),
                           SamplingStage(runner.model, runner.vocab_size, runner.device))

    def kv_allocated(self, runner: ModelRunner) -> None:
        pass


@dataclass(slots=True)
class ExecutedStep:
    """What ``execute_model`` leaves for ``sample_tokens`` (``runner.executed`` in between)."""

    plan: SchedulerOutput
    batch: InputBatch | None
    hidden_states: torch.Tensor | None
    aux_hidden_states: list[torch.Tensor]
    device_start: torch.cuda.Event | None = None  # for the timeline, when asked for
    host_start: float = 0.0  # time.perf_counter() when the step's inputs began


class ModelRunner:
    """Runs a Hugging Face-format checkpoint; implements :class:`specloop.kernel.protocols.ModelRunner`."""

    def __init__(self, config: EngineConfig, plugins: PluginManager, platform: Platform,
                 tp: TensorParallel = SINGLE) -> None:
        if not config.model:
            raise ValueError("the model runner needs a model: pass model=PATH to a local Hugging Face-format "
                             "directory")
        self.config = config
        self.plugins = plugins
        self.platform = platform
        self.tp = tp  # this runner's rank of a tensor-parallel group (backends.distributed), or the only one
        self.device = resolve_device(config.device)
        # Overlapping on a thread, all torch work runs on the worker, loading included: a second
        # thread with parallel CPU work gets intra-op threads of its own (steps ~3x slower).
        overlaps = self._resolve_async_scheduling() and platform.overlap == "thread"
        self._worker: ThreadPoolExecutor | None = ThreadPoolExecutor(1, "specloop-runner") if overlaps else None
        # What this process held before this engine: another engine of the same process is not ours.
        self.memory_baseline = kv_memory.allocated(self.device)
        self.model, self.model_config = self._on_worker(load_model, config.model, plugins.models, self.device,
                                                        config.dtype, tp)
        self.dtype: torch.dtype = next(self.model.parameters()).dtype
        self.vocab_size = self.model_config.vocab_size
        mc: ModelConfig = self.model_config
        self.model_max_len: int | None = mc.max_position_embeddings or getattr(self.model, "max_positions", None)
        self.block_size = config.block_size
        self.attention_backend_name = config.attention_backend or platform.default_attention_backend
        self.attn_backend: AttentionBackend = self._new_attention_backend()
        self.ops = platform.ops(config)
        self.requests: dict[str, CachedRequestState] = {}
        self.drafter: DraftingStage | None = None
        self.parts: RunnerParts | None = None
        self.executed: ExecutedStep | None = None
        self._drafts: DraftTokenIds | None = None
        # Asynchronous scheduling: the next step is planned and launched before this one's tokens
        # are committed (EngineConfig.async_scheduling); a CPU runner overlaps on the worker thread,
        # a CUDA one through the device's stream.
        self.async_scheduling = False
        self._executing: Future[None] | None = None
        self._pending: PendingOutput | None = None
        self._launched: SchedulerOutput | None = None  # the plan execute_model launched last
        # The requests of the last verification left on the device (``_verify_later``): None until
        # its outcome is read, then the drafts each rejected.
        self._lagging: dict[str, int | None] = {}
        self.device_clock: DeviceClock | None = None  # times device work for a timeline

    def _new_attention_backend(self) -> AttentionBackend:
        return self.plugins.attention_backends.create(self.attention_backend_name, config=self.config)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.drafter.aux_layers if self.drafter is not None else ()

    @property
    def recorder(self) -> Recorder | None:
        """The proposer's ``record``, for the executor to call inside every forward."""
        proposer = self.drafter.proposer if self.drafter is not None else None
        return proposer.record if proposer is not None and proposer.records_hidden_states else None

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.parts.executor.kv_caches if self.parts is not None else []

    def proposer_context(self) -> ProposerContext:
        model = self.model
        return ProposerContext(device=self.device, dtype=self.dtype, model_config=self.model_config,
                               vocab_size=self.vocab_size, block_size=self.block_size, models=self.plugins.models,
                               attention_backend=self._new_attention_backend, ops=self.ops,
                               embed_tokens=model.embed_tokens, lm_head=model.compute_logits, target=model,
                               proposers=self.plugins.proposers, tp=self.tp)

    # --- setup --------------------------------------------------------------------------------

    def _on_worker(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._worker.submit(fn, *args).result() if self._worker is not None else fn(*args)

    def initialize(self) -> int:
        """Build the proposer and the parts, size and allocate the KV cache; returns its blocks."""
        return self._on_worker(self._initialize)

    def _initialize(self) -> int:
        spec = self.config.speculative_config
        if spec is not None:
            proposer = self.plugins.proposers.create(spec.method, config=self.config, context=self.proposer_context())
            # A proposer with a cache over the target's hidden states needs a prefix hit's last block
            # recomputed: its entry at a shared block's last position pairs it with the next token.
            spec.reads_target_hidden_states = proposer.runs_on_prefill_chunks or proposer.records_hidden_states
            policy = self.plugins.speculation_policies.create(spec.policy, config=self.config)
            self.drafter = DraftingStage(proposer, policy, self.config)
        self.parts = self.platform.parts(self)
        if self.drafter is not None:
            self.drafter.attach(self.parts.executor, self.parts.device_rows)
        executor = self.parts.executor
        c = self.config
        n = int(min(c.max_num_batched_tokens or 8192, c.max_model_len or 8192))

        def profile() -> None:
            mc = self.model_config
            shape = mc.kv_cache_shape(self.attn_backend, -(-n // self.block_size), self.block_size)
            scratch = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)]
            executor.profile(n, min(n, c.max_num_seqs), scratch, self.block_size, self.device)

        # Every rank's cache holds the same blocks: the scheduler on rank 0 hands out block ids for all.
        num_blocks = self.tp.agree_min(kv_memory.num_kv_blocks(c, self.device, self.kv_bytes_per_block(),
                                                               self.block_size, profile, self.memory_baseline))
        mc = self.model_config
        shape = mc.kv_cache_shape(self.attn_backend, num_blocks, self.block_size)
        executor.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)]
        if self.drafter is not None:
            self.drafter.proposer.initialize(num_blocks)
        self.platform.kv_allocated(self)
        self.async_scheduling = self._resolve_async_scheduling()
        if self.device.type == "cuda" and c.plugin_options.get("gpu", {}).get("device_timeline"):
            self.device_clock = DeviceClock(self.device)
        return num_blocks

    def _resolve_async_scheduling(self) -> bool:
        """On by default on CUDA with one rank (tensor-parallel ranks step in lockstep). With drafts,
        a step that neither verifies nor proposes overlaps as any; a greedy verification on a
        platform with ``late_verification`` too, read a step late (:meth:`_sample`); other steps
        with drafts are committed before the next is planned, which needs their accepted counts."""
        wanted = self.config.async_scheduling
        return self.device.type == "cuda" and self.tp.size == 1 if wanted is None else bool(wanted)

    def kv_bytes_per_block(self) -> int:
        """Bytes one block costs across the target's layers and the proposer's, if it keeps a cache."""
        size = self.model_config.kv_bytes_per_block(self.block_size, self.dtype.itemsize)
        if self.drafter is not None:
            size += self.drafter.proposer.kv_cache_bytes_per_block()
        return size

    # --- one step -----------------------------------------------------------------------------

    def execute_model(self, plan: SchedulerOutput) -> None:
        self._launched = plan
        if self._worker is not None:
            self._executing = self._worker.submit(self._execute, plan)
        else:
            self._execute(plan)

    def _execute(self, plan: SchedulerOutput) -> None:
        self.update_states(plan)
        if plan.total_num_scheduled_tokens == 0:
            self.executed = ExecutedStep(plan, None, None, [])
            return
        t0 = time.perf_counter()
        batch, key = self.prepare_inputs(plan)
        started = self.device_clock.mark() if self.device_clock is not None else None
        out = self.forward(batch, key)
        self.executed = ExecutedStep(plan, batch, out.hidden_states, out.aux_hidden_states, started, t0)

    def update_states(self, plan: SchedulerOutput) -> None:
        """Apply the plan to the resident request state and every part that mirrors it."""
        parts = self.parts
        changes = apply_plan(self.requests, plan, self.config.seed)
        parts.builder.update(changes)
        parts.sampler.forget(changes.finished)
        if self.drafter is not None:
            self.drafter.remove(changes.removed, changes.finished)
        for rid in changes.removed:
            self._lagging.pop(rid, None)

    def prepare_inputs(self, plan: SchedulerOutput) -> tuple[InputBatch, GraphKey | None]:
        """The step's inputs, padded for the CUDA graph that will run it, if one will. A request
        whose last verification is still unread was planned as if it accepted every draft: the
        device pulls it back by the drafts it rejected (``lagged``)."""
        reqs = self.requests
        key = self.parts.executor.graph_for(plan, lambda: max(reqs[rid].num_computed_tokens + n
                                                              for rid, n in plan.num_scheduled_tokens.items()))
        lagging = self._lagging
        lagged = ([i for i, rid in enumerate(plan.num_scheduled_tokens) if rid in lagging and lagging[rid] is None]
                  if lagging else [])
        batch = self.parts.builder.prepare(plan, self.requests, pad_to=key.size if key else None,
                                           num_splits=key.num_splits if key else 0, lagged=lagged)
        return batch, key

    def forward(self, batch: InputBatch, key: GraphKey | None = None) -> ForwardOutput:
        out = self.parts.executor.run(batch, key)
        batch.precomputed_logits = out.logits
        batch.presampled = out.sampled
        batch.greedy = out.greedy
        return out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return compute_logits(self.model, hidden_states)

    def sample_tokens(self, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput | PendingOutput:
        """The last executed plan's tokens, ``grammar`` masking its structured rows. With
        asynchronous scheduling a :class:`PendingOutput` whose ``result()`` waits for them: on a
        worker thread (CPU), or for the device-to-host copy of tokens that already feed the next
        step on the device (CUDA)."""
        plan, self._launched = self._launched, None
        record = self.drafter.begin_step(plan) if self.drafter is not None and plan is not None else None
        if self._worker is not None:
            executing, self._executing = self._executing, None
            sampling = self._worker.submit(self._sample_after, executing, grammar, record)
            return PendingOutput(sampling.result, overlaps=record is None or record.overlaps)
        out = self._sample(grammar, record)
        if self.async_scheduling and not isinstance(out, PendingOutput) and record is not None and not record.overlaps:
            return PendingOutput(lambda: out, overlaps=False)  # resolved: a step with drafts
        return out

    def _sample_after(self, executing: Future[None] | None, grammar: GrammarBitmask | None,
                      record: StepRecord | None) -> ModelRunnerOutput:
        if executing is not None:
            executing.result()  # re-raise what went wrong while executing
        out = self._sample(grammar, record)
        return out.result() if isinstance(out, PendingOutput) else out

    def _sample(self, grammar: GrammarBitmask | None = None,
                record: StepRecord | None = None) -> ModelRunnerOutput | PendingOutput:
        step, self.executed = self.executed, None
        if step is None:
            raise RuntimeError("sample_tokens called without execute_model")
        self._drafts = None
        batch = step.batch
        if batch is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        sampler = self.parts.sampler
        propose = self.drafter.after(record) if self.drafter is not None else False
        defer = self.async_scheduling and not propose and not batch.lagged and sampler.can_defer(batch)
        if not defer:
            self._resolve_pending()  # the paths below read every request's tokens on the host
        if batch.lagged:
            rebase(batch, self.requests, self._lagging)
        self._lagging = {}
        drafter = self.drafter
        launch = (drafter.before_sampling(batch, step.hidden_states, step.aux_hidden_states, self.requests, grammar,
                                          propose) if drafter is not None else None)
        # A verification whose next proposal launches from the device may be read a step late.
        later = (self.async_scheduling and launch is not None and getattr(self.platform, "late_verification", False)
                 and getattr(self.attn_backend, "device_lengths", False))
        result = sampler.sample(batch, step.hidden_states, self.requests, drafter.draft_probs if drafter else {},
                                defer=defer or later, grammar=grammar, launch=launch)
        span = self._device_span(step.device_start)
        if later and result.wait is not None:
            if drafter.launched:
                return self._read_later(step, batch, result, record, span)
            result.sampled, result.wait = result.wait(), None
        if result.wait is not None:
            self._pending = provisional(self.requests, batch, result, span)
            if record is not None:
                record.tokens = sum(1 for _, count in batch.sample_rows if count)
            return self._pending
        for rid, tokens in zip(batch.req_ids, result.sampled):
            self.requests[rid].token_ids.extend(tokens)  # provisional until the next plan commits them
        if record is not None:
            record.tokens = sum(map(len, result.sampled))
        if propose:
            self._drafts, _ = self.drafter.propose(step.plan, batch, step.hidden_states, step.aux_hidden_states,
                                                   result.sampled, self.requests, time.perf_counter() - step.host_start)
        elif self.drafter is not None:
            self.drafter.draft_probs.clear()  # this step's drafts (if any) are verified
        return ModelRunnerOutput(req_ids=list(batch.req_ids), sampled_token_ids=result.sampled,
                                 logprobs=result.logprobs, prompt_logprobs=result.prompt_logprobs,
                                 device_span=span() if span is not None else None)

    def _read_later(self, step: ExecutedStep, batch: InputBatch, result: SampleResult, record: StepRecord | None,
                    span: Callable[[], tuple[float, float]] | None) -> PendingOutput:
        """A verification whose next proposal was launched from the device, read a step late
        (:func:`read_later`); its placeholder drafts go to the scheduler now."""
        observation = None

        def after_read(sampled: list[list[int]]) -> None:
            self.drafter.observe(observation, batch, sampled)
            if record is not None:
                record.tokens = sum(map(len, sampled))

        self._lagging = {rid: None for rid in batch.req_ids}
        self._pending = read_later(self.requests, self.parts.builder, batch, result, self._lagging, span, after_read)
        self._drafts, observation = self.drafter.propose(step.plan, batch, step.hidden_states, step.aux_hidden_states,
                                                         None, self.requests, time.perf_counter() - step.host_start)
        return self._pending

    def _device_span(self, started: torch.cuda.Event | None) -> Callable[[], tuple[float, float]] | None:
        if started is None or self.device_clock is None:
            return None
        ended, clock = self.device_clock.mark(), self.device_clock
        return lambda: (clock.time_of(started), clock.time_of(ended))

    def _resolve_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        drafts, self._drafts = self._drafts, None
        return drafts

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self.requests.clear()
        if self.parts is not None:
            self.parts.executor.release()
        self.executed = None


def auto_model_runner(config: EngineConfig, plugins: PluginManager) -> ModelRunner:
    """The default: the ``"gpu"`` runner when the device is CUDA, else the ``"torch"`` runner."""
    name = "gpu" if resolve_device(config.device).type == "cuda" else "torch"
    return plugins.model_runners.create(name, config=config, plugins=plugins)

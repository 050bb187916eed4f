"""The parts a platform composes a model runner from (``backends.runner``), as protocols: the batch
builder (packed inputs; on the GPU also the device token rows a verification's outcome goes to),
the executor (the model's forward) and the sampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from specloop.kernel.outputs import SchedulerOutput
from specloop.proposers.base import DeviceStep
from specloop.sampling.structured_outputs import GrammarBitmask

from .batch import InputBatch
from .executor import ForwardOutput, GraphKey
from .requests import CachedRequestState, PlanChanges
from .sampling_stage import SampleResult


class DeviceRows(DeviceStep, Protocol):
    """Device token rows a uniform greedy verification's outcome and drafts go to (``PersistentBatch``);
    as a :class:`DeviceStep`, the step's tensors a proposal graph reads."""

    def accept(self, input_ids: torch.Tensor, top: torch.Tensor, positions: torch.Tensor, q: int) -> torch.Tensor:
        """The rows each request accepted; writes its next token and its rejected count."""

    def write_drafts(self, drafts: torch.Tensor, accepted: torch.Tensor, positions: torch.Tensor, q: int) -> None:
        """Each request's drafts after its next token."""


class BatchBuilder(Protocol):
    def update(self, changes: PlanChanges) -> None: ...

    def mark_on_device(self, req_id: str, length: int) -> None:
        """The request's first ``length`` tokens are on the device (it wrote them itself)."""

    def prepare(self, plan: SchedulerOutput, requests: dict[str, CachedRequestState], pad_to: int | None = None,
                num_splits: int = 0, lagged: Sequence[int] = ()) -> InputBatch: ...


class Executor(Protocol):
    kv_caches: list[torch.Tensor]
    # Whether uniform batches (every request computing the same number of tokens) run faster,
    # replayed from CUDA graphs: the drafting stage then pads drafts to make them uniform.
    replays_uniform_batches: bool

    def graph_for(self, plan: SchedulerOutput) -> GraphKey | None: ...

    def run(self, batch: InputBatch, key: GraphKey | None = None) -> ForwardOutput: ...

    def profile(self, num_tokens: int, num_logit_rows: int, kv_caches: list[torch.Tensor], block_size: int,
                device: torch.device) -> None: ...

    def release(self) -> None: ...


class Sampler(Protocol):
    def forget(self, finished: frozenset[str]) -> None: ...

    def can_defer(self, batch: InputBatch) -> bool:
        """Whether :meth:`sample` can leave this batch's tokens on the device (``defer=True``)."""

    def sample(self, batch: InputBatch, hidden_states: torch.Tensor, requests: dict[str, CachedRequestState],
               draft_probs: dict[str, torch.Tensor | None], defer: bool = False, grammar: GrammarBitmask | None = None,
               launch: Callable[[torch.Tensor], None] | None = None) -> SampleResult: ...


@dataclass(slots=True)
class RunnerParts:
    builder: BatchBuilder
    executor: Executor
    sampler: Sampler
    # Device-resident token rows that a verification's outcome and drafts proposed on the device go
    # to, when the builder keeps them: proposals may then be launched from the device
    # (``DraftingStage.launcher``).
    device_rows: DeviceRows | None = None

"""One step's packed ragged inputs, and how they are laid out.

Request ``r``'s scheduled tokens are positions ``[num_computed, num_computed + n)`` of
``token_ids + scheduled_spec_decode_tokens[r]``. They are laid end to end: request ``i`` owns token
rows ``query_start_loc[i]:query_start_loc[i+1]``. :class:`BatchLayout` works out, on the host,
everything that follows from the plan (rows, positions' ranges, which rows need logits);
a batch builder then materialises the tensors: :class:`HostBatchBuilder` from host lists (any
device), ``backends.gpu.persistent_batch.PersistentBatch`` from device-resident token rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specloop.kernel.outputs import SchedulerOutput
from specloop.models.attention import AttentionMetadata

from .requests import CachedRequestState, PlanChanges


@dataclass(slots=True)
class BatchLayout:
    """The host-side shape of one step. Built by :meth:`from_plan`."""

    req_ids: list[str]  # the plan's order
    num_scheduled_tokens: list[int]
    starts: list[int]  # first position computed per request
    specs: list[list[int]]  # drafts verified this step, per request
    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # context length of each request after this step
    # Token rows whose logits are computed, in this order: logits row j is token row token_rows[j].
    token_rows: list[int]
    # Per request, (first logits row, count): rows sampled this step (len(spec) + 1 when the
    # request reaches the end of its known tokens, else 0) ...
    sample_rows: list[tuple[int, int]]
    # ... and rows whose logits score the next prompt token (prompt_logprobs only).
    prompt_rows: list[tuple[int, int]]
    sample_req_rows: list[int]  # the request index of each sampled row

    @classmethod
    def from_plan(cls, plan: SchedulerOutput, requests: dict[str, CachedRequestState], block_size: int
                  ) -> BatchLayout:
        lay = cls(list(plan.num_scheduled_tokens), [], [], [], [0], [], [], [], [], [])
        for i, rid in enumerate(lay.req_ids):
            state = requests[rid]
            n = plan.num_scheduled_tokens[rid]
            start = state.num_computed_tokens
            spec = list(plan.scheduled_spec_decode_tokens.get(rid, ()))
            end, known = start + n, len(state.token_ids)
            if end > known + len(spec):
                raise ValueError(f"plan schedules request {rid!r} past its known tokens "
                                 f"({end} > {known} + {len(spec)} drafts)")
            if end > len(state.block_ids) * block_size:
                raise ValueError(f"plan schedules request {rid!r} past its KV blocks "
                                 f"({end} > {len(state.block_ids)} * {block_size})")
            first_row = lay.query_start_loc[-1]
            if state.sampling_params.prompt_logprobs is not None:
                # Position p's logits score prompt token p + 1.
                count = max(0, min(end, state.num_prompt_tokens - 1) - start)
                lay.prompt_rows.append((len(lay.token_rows), count))
                lay.token_rows.extend(range(first_row, first_row + count))
            else:
                lay.prompt_rows.append((len(lay.token_rows), 0))
            # Partial prefill chunks sample nothing; otherwise every draft position plus the bonus.
            num_sample = len(spec) + 1 if end == known + len(spec) else 0
            lay.sample_rows.append((len(lay.token_rows), num_sample))
            lay.token_rows.extend(range(first_row + n - num_sample, first_row + n))
            lay.sample_req_rows.extend([i] * num_sample)
            lay.num_scheduled_tokens.append(n)
            lay.starts.append(start)
            lay.specs.append(spec)
            lay.query_start_loc.append(first_row + n)
            lay.seq_lens.append(end)
        return lay

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def max_query_len(self) -> int:
        return max(self.num_scheduled_tokens, default=0)


@dataclass(slots=True)
class InputBatch:
    """One step's inputs. Built by a batch builder; read by the executor, the sampler and the
    proposer."""

    layout: BatchLayout
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [R] int64: layout.token_rows on the device
    # Filled by whoever computed them already (a CUDA graph computes logits for every row).
    precomputed_logits: torch.Tensor | None = field(default=None)
    # Each row's plain draw, when a decode graph drew them (``backends.gpu.graphs``).
    presampled: torch.Tensor | None = field(default=None)
    # Each row's greedy token (the argmax of its logits), when a verification graph took it.
    greedy: torch.Tensor | None = field(default=None)
    # Rows of requests whose last verification's outcome the plan did not know yet: it assumed every
    # draft accepted, the device pulled their starts back by the rejected counts, and the runner
    # does the same to ``layout`` once it reads them (``ModelRunner._rebase``).
    lagged: list[int] = field(default_factory=list)
    # Request rows prepared on the device, padding for a CUDA graph included (0: not on the device).
    rows: int = 0

    @property
    def req_ids(self) -> list[str]:
        return self.layout.req_ids

    @property
    def spec_token_ids(self) -> list[list[int]]:
        return self.layout.specs

    @property
    def sample_rows(self) -> list[tuple[int, int]]:
        return self.layout.sample_rows

    @property
    def prompt_rows(self) -> list[tuple[int, int]]:
        return self.layout.prompt_rows

    @property
    def query_start_loc(self) -> list[int]:
        return self.layout.query_start_loc

    @property
    def num_computed_tokens(self) -> list[int]:
        return self.layout.starts

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens


def scheduled_token_ids(state: CachedRequestState, spec: list[int], start: int, n: int) -> list[int]:
    """Positions ``[start, start + n)`` of ``state.token_ids + spec`` without copying the history."""
    known = len(state.token_ids)
    if start + n <= known:
        return state.token_ids[start:start + n]
    return state.token_ids[start:] + spec[max(0, start - known):start + n - known]


class HostBatchBuilder:
    """Builds every step's tensors from host lists: the reference builder, any device."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device

    def update(self, changes: PlanChanges) -> None:
        """Nothing is resident between steps."""

    def mark_on_device(self, req_id: str, length: int) -> None:
        """Nothing is resident between steps."""

    def prepare(self, plan: SchedulerOutput, requests: dict[str, CachedRequestState], pad_to: int | None = None,
                num_splits: int = 0, lagged: Sequence[int] = ()) -> InputBatch:
        if lagged:
            raise ValueError("the host batch builder builds from the host's tokens: it cannot follow drafts "
                             "rejected on the device (lagged rows)")
        lay = BatchLayout.from_plan(plan, requests, self.block_size)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for i, rid in enumerate(lay.req_ids):
            state, start, n = requests[rid], lay.starts[i], lay.num_scheduled_tokens[i]
            input_ids.extend(scheduled_token_ids(state, lay.specs[i], start, n))
            blocks = state.block_ids
            positions.extend(range(start, start + n))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
        meta = AttentionMetadata.build(lay.query_start_loc, lay.seq_lens, slots,
                                       [requests[r].block_ids for r in lay.req_ids], self.device)

        def to_device(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

        return InputBatch(lay, to_device(input_ids), to_device(positions), meta, to_device(lay.token_rows))

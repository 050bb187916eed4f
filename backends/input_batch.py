"""The model runner's resident per-request state and one step's packed ragged inputs.

:func:`prepare_inputs` turns a plan plus the resident state into an :class:`InputBatch`: the
scheduled tokens of every request laid end to end (request ``i`` owns rows
``query_start_loc[i]:query_start_loc[i+1]``), their positions and cache slots, the attention
metadata, and which rows need logits. Request ``r``'s scheduled tokens are positions
``[num_computed, num_computed + n)`` of ``token_ids + scheduled_spec_decode_tokens[r]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specloop.kernel.outputs import SchedulerOutput
from specloop.kernel.sampling_params import SamplingParams

from .attention import AttentionMetadata


@dataclass(slots=True)
class RequestState:
    """The runner's copy of one request. Created from ``NewRequestData`` (first admission or
    resumption), updated from ``CachedRequestData``; the scheduler's plan is the only writer."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + committed output
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # first position computed in the current step
    seed: int  # effective sampling seed
    eos_token_ids: tuple[int, ...] = ()  # the request's own EOS ids, besides the model's

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]


@dataclass(slots=True)
class InputBatch:
    """One step's inputs. Built by :func:`prepare_inputs`; read by the forward pass, the sampler
    and the proposer."""

    req_ids: list[str]  # the plan's order
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int]  # first position computed per request
    spec_token_ids: list[list[int]]  # drafts verified this step, per request
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    query_start_loc: list[int]  # [B + 1], host copy
    # Token rows whose logits are computed, in this order: logits row j is token row logits_indices[j].
    logits_indices: torch.Tensor  # [R] int64
    # Per request, (first logits row, count): rows sampled this step (len(spec) + 1 when the
    # request reaches the end of its known tokens, else 0) ...
    sample_rows: list[tuple[int, int]] = field(default_factory=list)
    # ... and rows whose logits score the next prompt token (prompt_logprobs only).
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


def scheduled_token_ids(state: RequestState, spec: list[int], start: int, n: int) -> list[int]:
    """Positions ``[start, start + n)`` of ``state.token_ids + spec`` without copying the history."""
    known = len(state.token_ids)
    if start + n <= known:
        return state.token_ids[start:start + n]
    return state.token_ids[start:] + spec[max(0, start - known):start + n - known]


def prepare_inputs(plan: SchedulerOutput, requests: dict[str, RequestState], block_size: int,
                   device: torch.device) -> InputBatch:
    req_ids = list(plan.num_scheduled_tokens)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    starts: list[int] = []
    specs: list[list[int]] = []
    token_rows: list[int] = []  # logits rows, as token rows
    sample_rows: list[tuple[int, int]] = []
    prompt_rows: list[tuple[int, int]] = []
    for rid in req_ids:
        state = requests[rid]
        n = plan.num_scheduled_tokens[rid]
        start = state.num_computed_tokens
        spec = list(plan.scheduled_spec_decode_tokens.get(rid, ()))
        end = start + n
        if end > len(state.token_ids) + len(spec):
            raise ValueError(f"plan schedules request {rid!r} past its known tokens "
                             f"({end} > {len(state.token_ids)} + {len(spec)} drafts)")
        if end > len(state.block_ids) * block_size:
            raise ValueError(f"plan schedules request {rid!r} past its KV blocks "
                             f"({end} > {len(state.block_ids)} * {block_size})")
        first_row = qsl[-1]
        input_ids.extend(scheduled_token_ids(state, spec, start, n))
        pos = range(start, end)
        positions.extend(pos)
        blocks = state.block_ids
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
        if state.sampling_params.prompt_logprobs is not None:
            # Position p's logits score prompt token p + 1.
            last = min(end, state.num_prompt_tokens - 1)
            prompt_rows.append((len(token_rows), max(0, last - start)))
            token_rows.extend(range(first_row, first_row + max(0, last - start)))
        else:
            prompt_rows.append((len(token_rows), 0))
        # Partial prefill chunks sample nothing; otherwise every draft position plus the bonus.
        num_sample = len(spec) + 1 if end == len(state.token_ids) + len(spec) else 0
        sample_rows.append((len(token_rows), num_sample))
        token_rows.extend(range(first_row + n - num_sample, first_row + n))
        qsl.append(first_row + n)
        seq_lens.append(end)
        starts.append(start)
        specs.append(spec)

    max_blocks = max((len(requests[r].block_ids) for r in req_ids), default=0)
    block_tables = torch.zeros(len(req_ids), max(max_blocks, 1), dtype=torch.int32)
    for i, rid in enumerate(req_ids):
        blocks = requests[rid].block_ids
        block_tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    def to_device(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    meta = AttentionMetadata(
        query_start_loc=to_device(qsl, torch.int32),
        seq_lens=to_device(seq_lens, torch.int32),
        slot_mapping=to_device(slots),
        block_tables=block_tables.to(device, non_blocking=True),
        max_query_len=max(plan.num_scheduled_tokens.values(), default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return InputBatch(
        req_ids=req_ids,
        num_scheduled_tokens=[plan.num_scheduled_tokens[r] for r in req_ids],
        num_computed_tokens=starts,
        spec_token_ids=specs,
        input_ids=to_device(input_ids),
        positions=to_device(positions),
        attn_metadata=meta,
        query_start_loc=qsl,
        logits_indices=to_device(token_rows),
        sample_rows=sample_rows,
        prompt_rows=prompt_rows,
    )

"""Running the model's forward over one step's batch.

:class:`EagerExecutor` calls the model with a :class:`ForwardContext` of the runner's attention
backend, KV caches and op set. The GPU runner composes a CUDA-graph executor around it
(``backends.gpu.graphs``) that replays captured decode steps and falls back to it for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from specloop.kernel.outputs import SchedulerOutput
from specloop.models.attention import AttentionBackend, AttentionMetadata
from specloop.models.context import ForwardContext
from specloop.models.ops import Ops

from .batch import InputBatch


# A proposer's ``record(hidden_states, aux_hidden_states, slot_mapping)`` (``Proposer.record``).
Recorder = Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor], None]


@dataclass(frozen=True, slots=True)
class GraphKey:
    """A captured graph: ``q`` tokens per request, ``size`` request rows (live + padding), and the
    flash-decoding split count fixed at capture. A ragged graph (any mix of prompt chunks, decodes
    and verifications) has ``q = 0`` and holds ``tokens`` token rows."""

    q: int
    size: int
    num_splits: int
    tokens: int = 0
    long: bool = False  # a decode graph's long-context variant (more splits)


@dataclass(slots=True)
class ForwardOutput:
    hidden_states: torch.Tensor  # [T, H] final (post-norm) states of the live tokens
    aux_hidden_states: list[torch.Tensor]  # the residual stream entering each tapped layer
    logits: torch.Tensor | None = None  # [T, V] float32 of every live row, when a graph computed them
    sampled: torch.Tensor | None = None  # [T] int64: each row's draw, when a decode graph drew them
    greedy: torch.Tensor | None = None  # [T] int64: each row's argmax, when a verification graph took it


class EagerExecutor:
    replays_uniform_batches = False
    SHORT_PROMPTS = (2, 16, 48)  # new tokens per sequence spanning the attention kernel's tile heights

    def __init__(self, model: nn.Module, ops: Ops, attn_backend: AttentionBackend,
                 aux_layers: Sequence[int] = (), record: Recorder | None = None) -> None:
        self.model = model
        self.ops = ops
        self.attn_backend = attn_backend
        self.aux_layers = tuple(aux_layers)
        self.record = record  # a proposer's ``record``, called inside every forward
        self.kv_caches: list[torch.Tensor] = []

    def graph_for(self, plan: SchedulerOutput, max_context: Callable[[], int] | None = None) -> GraphKey | None:
        return None

    def context(self, meta: AttentionMetadata, kv_caches: list[torch.Tensor] | None = None) -> ForwardContext:
        return ForwardContext(self.attn_backend, meta, self.kv_caches if kv_caches is None else kv_caches, self.ops)

    def run(self, batch: InputBatch, key: GraphKey | None = None) -> ForwardOutput:
        with torch.inference_mode():
            hidden, aux = self.model(batch.input_ids, batch.positions, self.context(batch.attn_metadata),
                                     aux_layers=self.aux_layers)
            if self.record is not None:
                self.record(hidden, aux, batch.attn_metadata.slot_mapping)
        return ForwardOutput(hidden, aux)

    def profile(self, num_tokens: int, num_logit_rows: int, kv_caches: list[torch.Tensor], block_size: int,
                device: torch.device) -> None:
        """One forward over ``num_tokens`` tokens of one sequence plus logits and softmax over
        ``num_logit_rows`` rows, on scratch caches: the largest step's memory, for sizing. Then
        short prompts of one sequence, which take other attention tiles than the largest step: each
        tile is a kernel compile of its own (most of a second on a GPU), paid here rather than in
        the first short request's step."""
        for tokens, rows in [(num_tokens, num_logit_rows)] + [(n, 1) for n in self.SHORT_PROMPTS if n < num_tokens]:
            blocks = -(-tokens // block_size)
            meta = AttentionMetadata.build([0, tokens], [tokens], range(tokens), [list(range(blocks))], device)
            with torch.inference_mode():
                hidden, _ = self.model(torch.zeros(tokens, dtype=torch.int64, device=device),
                                       torch.arange(tokens, device=device), self.context(meta, kv_caches),
                                       aux_layers=self.aux_layers)
                self.model.compute_logits(hidden[:rows]).float().softmax(-1)

    def release(self) -> None:
        self.kv_caches = []

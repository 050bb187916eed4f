"""CUDA graphs of the forward for uniform batches ("full graphs").

A batch is *uniform* when every request computes the same number ``q`` of tokens: ``q = 1`` for
plain decode, ``q = k + 1`` for verifying k drafts (every k up to K: a proposer may find fewer, a
speculation policy may ask for fewer, and the drafting stage pads a batch's drafts to its longest,
so a decode batch with drafts is uniform). One graph per (q, padded request count) is captured at
start-up, largest first, sharing one memory pool; it reads the persistent batch's step tensors
(fixed addresses) and writes the final hidden states (and the residual streams of the layers a
proposer taps), plus the logits of every row when ``q = 1``. A live batch of ``B`` requests replays
the smallest graph of at least ``B`` requests; the rows past ``B`` are padding that owns no tokens
and writes no KV. Anything else runs eagerly.

Replay removes the per-kernel launch cost (~300 launches for a 28-layer model), which dominates
small decode batches; it does not reduce FLOPs or bytes moved.
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch

from specloop.kernel.outputs import SchedulerOutput
from specloop.proposers.step_graphs import graph_sizes

from ..batch import InputBatch
from ..executor import EagerExecutor, ForwardOutput, GraphKey
from .persistent_batch import PersistentBatch
from .triton_attention import GpuAttentionMetadata

logger = logging.getLogger("specloop")


class GraphExecutor:
    """The eager executor plus captured graphs, keyed by (q, padded request count)."""

    replays_uniform_batches = True

    def __init__(self, eager: EagerExecutor, batch: PersistentBatch, q_lens: list[int], hidden_size: int,
                 vocab_size: int, choose_splits: Callable[[int, int], int]) -> None:
        self.eager = eager
        self.batch = batch
        self.q_lens = q_lens
        self.choose_splits = choose_splits  # (requests, max context) -> flash-decoding splits
        self.sizes = graph_sizes(batch.max_reqs)
        self.max_tokens = min(batch.max_tokens, max(self.sizes) * max(q_lens))
        dtype = next(eager.model.parameters()).dtype
        self.hidden = torch.zeros(self.max_tokens, hidden_size, dtype=dtype, device=batch.device)
        self.aux = [torch.zeros_like(self.hidden) for _ in eager.aux_layers]
        self.logits = torch.zeros(max(self.sizes), vocab_size, dtype=torch.float32, device=batch.device) \
            if 1 in q_lens else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.splits: dict[tuple[int, int], int] = {}
        self.num_replays = 0

    # The eager executor's interface, shared.
    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.eager.kv_caches

    @kv_caches.setter
    def kv_caches(self, caches: list[torch.Tensor]) -> None:
        self.eager.kv_caches = caches

    def profile(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.eager.profile(*args, **kwargs)

    def release(self) -> None:
        self.graphs.clear()
        self.eager.release()

    def capture(self) -> None:
        pool = None
        device = self.batch.device
        for q in self.q_lens:
            for size in sorted(self.sizes, reverse=True):
                if size * q > self.max_tokens:
                    continue
                graph = torch.cuda.CUDAGraph()
                run = self._body(q, size)
                with torch.inference_mode():
                    run()  # warm-up outside the graph: compiles kernels, sets up cuBLAS
                    torch.cuda.synchronize(device)
                    with torch.cuda.graph(graph, pool=pool):
                        run()
                pool = graph.pool()
                self.graphs[(q, size)] = graph
        torch.cuda.synchronize(device)
        logger.info("captured %d CUDA graphs (q in %s, up to %d requests)", len(self.graphs), self.q_lens,
                    max(self.sizes))

    def _body(self, q: int, size: int) -> Callable[[], None]:
        pb, eager = self.batch, self.eager
        tokens = size * q
        # Placeholder step: every request owns q tokens of block 0 and writes no KV. Replays read
        # the live values the persistent batch writes to the same addresses.
        pb.query_start_loc[:size + 1].copy_(torch.arange(size + 1, device=pb.device, dtype=torch.int32) * q)
        pb.seq_lens[:size].fill_(q)
        pb.block_tables[:size].zero_()
        pb.slot_mapping[:tokens].fill_(-1)
        splits = self.choose_splits(size, pb.max_len)
        self.splits[(q, size)] = splits
        meta = GpuAttentionMetadata(
            query_start_loc=pb.query_start_loc[:size + 1], seq_lens=pb.seq_lens[:size],
            slot_mapping=pb.slot_mapping[:tokens], block_tables=pb.block_tables[:size],
            max_query_len=q, max_seq_len=pb.max_len,
            query_start_loc_cpu=[i * q for i in range(size + 1)], seq_lens_cpu=[q] * size, num_splits=splits)
        ctx = eager.context(meta)
        model = eager.model

        def run() -> None:
            hidden, aux = model(pb.input_ids[:tokens], pb.positions[:tokens], ctx, aux_layers=eager.aux_layers)
            if eager.record is not None:
                eager.record(hidden, aux, pb.slot_mapping[:tokens])
            self.hidden[:tokens].copy_(hidden)
            for buffer, tapped in zip(self.aux, aux):
                buffer[:tokens].copy_(tapped)
            if q == 1 and self.logits is not None:
                self.logits[:tokens].copy_(model.compute_logits(hidden))
        return run

    def graph_for(self, plan: SchedulerOutput) -> GraphKey | None:
        """The graph for this plan, or None when it is not uniform or too large."""
        counts = plan.num_scheduled_tokens
        if not counts:
            return None
        q = next(iter(counts.values()))
        if q not in self.q_lens or plan.total_num_scheduled_tokens != q * len(counts):
            return None
        if any(n != q for n in counts.values()):
            return None
        i = bisect.bisect_left(self.sizes, len(counts))
        if i == len(self.sizes) or (q, self.sizes[i]) not in self.graphs:
            return None
        return GraphKey(q, self.sizes[i], self.splits[(q, self.sizes[i])])

    def run(self, batch: InputBatch, key: GraphKey | None = None) -> ForwardOutput:
        if key is None:
            return self.eager.run(batch)
        self.graphs[(key.q, key.size)].replay()
        self.num_replays += 1
        n = batch.num_tokens
        logits = self.logits[:n] if key.q == 1 and self.logits is not None else None
        return ForwardOutput(self.hidden[:n], [a[:n] for a in self.aux], logits)

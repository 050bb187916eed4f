"""CUDA graphs of the fused forward for uniform batches (seed 004 §10.4, "full graph").

A batch is *uniform* when every request computes the same number ``q`` of tokens: ``q = 1`` for
plain decode, ``q = K + 1`` for verifying K drafts. One graph per (q, padded request count) is
captured at start-up, largest first, sharing one memory pool; it reads the persistent batch's step
tensors (fixed addresses) and writes the final hidden states, plus the logits of every row when
``q = 1``. A live batch of ``B`` requests replays the smallest graph of at least ``B`` requests;
the rows past ``B`` are padding that owns no tokens and writes no KV. Anything else runs eagerly.

Replay removes the per-kernel launch cost (~300 launches for a 28-layer model), which dominates
small decode batches; it does not reduce FLOPs or bytes moved.
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import torch

from specloop.backends.attention import ForwardContext
from specloop.kernel.outputs import SchedulerOutput
from specloop.kernels.paged_attention import choose_num_splits

from .attention import GpuAttentionMetadata
from .forward import fused_forward

logger = logging.getLogger("specloop")


def capture_sizes(max_reqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_reqs`` (and ``max_reqs`` itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_reqs] + list(range(16, max_reqs + 1, 16))
    return sorted(set(sizes + [max_reqs]))


class DecodeGraphs:
    """Captured graphs of one runner, keyed by (q, padded request count)."""

    def __init__(self, runner: Any, q_lens: list[int]) -> None:
        self.runner = runner
        self.q_lens = q_lens
        pb = runner.batch_state
        self.sizes = capture_sizes(pb.max_reqs)
        hidden_size = runner.model_config.hidden_size
        self.max_tokens = min(pb.max_tokens, max(self.sizes) * max(q_lens))
        self.hidden = torch.zeros(self.max_tokens, hidden_size, dtype=runner.dtype, device=runner.device)
        self.logits = torch.zeros(max(self.sizes), runner.vocab_size, dtype=torch.float32, device=runner.device) \
            if 1 in q_lens else None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.splits: dict[tuple[int, int], int] = {}
        self.num_replays = 0

    def capture(self) -> None:
        pool = None
        for q in self.q_lens:
            for size in sorted(self.sizes, reverse=True):
                if size * q > self.max_tokens:
                    continue
                graph = torch.cuda.CUDAGraph()
                run = self._body(q, size)
                with torch.inference_mode():
                    run()  # warm-up outside the graph: compiles kernels, sets up cuBLAS
                    torch.cuda.synchronize(self.runner.device)
                    with torch.cuda.graph(graph, pool=pool):
                        run()
                pool = graph.pool()
                self.graphs[(q, size)] = graph
        torch.cuda.synchronize(self.runner.device)
        logger.info("captured %d CUDA graphs (q in %s, up to %d requests)", len(self.graphs), self.q_lens,
                    max(self.sizes))

    def _body(self, q: int, size: int):
        r = self.runner
        pb = r.batch_state
        tokens = size * q
        # Placeholder step: every request owns q tokens of block 0 and writes no KV. Replays read
        # the live values the persistent batch writes to the same addresses.
        pb.query_start_loc[:size + 1].copy_(torch.arange(size + 1, device=r.device, dtype=torch.int32) * q)
        pb.seq_lens[:size].fill_(q)
        pb.block_tables[:size].zero_()
        pb.slot_mapping[:tokens].fill_(-1)
        splits = choose_num_splits(size, r.model_config.num_kv_heads, pb.max_len, r.attn_backend.num_sms)
        self.splits[(q, size)] = splits
        meta = GpuAttentionMetadata(
            query_start_loc=pb.query_start_loc[:size + 1], seq_lens=pb.seq_lens[:size],
            slot_mapping=pb.slot_mapping[:tokens], block_tables=pb.block_tables[:size],
            max_query_len=q, max_seq_len=pb.max_len,
            query_start_loc_cpu=[i * q for i in range(size + 1)], seq_lens_cpu=[q] * size, num_splits=splits)
        ctx = ForwardContext(r.attn_backend, meta, r.kv_caches)

        def run() -> None:
            hidden, _ = fused_forward(r.model, pb.input_ids[:tokens], pb.positions[:tokens], ctx, r.rope)
            self.hidden[:tokens].copy_(hidden)
            if q == 1 and self.logits is not None:
                self.logits[:tokens].copy_(r.model.compute_logits(hidden))
        return run

    def lookup(self, plan: SchedulerOutput) -> tuple[int, int] | None:
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
        return q, self.sizes[i]

    def replay(self, key: tuple[int, int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the graph; returns views of the hidden states and (q = 1) logits of the live rows."""
        self.graphs[key].replay()
        self.num_replays += 1
        logits = self.logits[:num_tokens] if key[0] == 1 and self.logits is not None else None
        return self.hidden[:num_tokens], logits

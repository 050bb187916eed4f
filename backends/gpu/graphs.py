"""CUDA graphs of the forward: uniform batches, and ragged steps of up to 2,048 tokens.

A batch is *uniform* when every request computes the same number ``q`` of tokens: ``q = 1`` for
plain decode, ``q = k + 1`` for verifying k drafts (every k up to K: a proposer may find fewer, a
speculation policy may ask for fewer, and the drafting stage pads a batch's drafts to its longest,
so a decode batch with drafts is uniform). One graph per (q, padded request count) is captured at
start-up, largest first, sharing one memory pool; it reads the persistent batch's step tensors
(fixed addresses) and writes the final hidden states (and the residual streams of the layers a
proposer taps), plus, when ``q = 1``, the logits of every row and (``sample_in_graph``) each row's
draw by the fast sampler's kernel with the row's slot parameters, stored into its token row at
``write_at`` (``PersistentBatch``): a plain decode step then launches no sampling work of its own
(``FastSamplingStage``), and a step that needs another draw (min-p, a grammar mask, penalties,
logprobs) draws again over it. A verification graph (``q > 1``) whose rows fit the logits buffer
(as many as the largest decode graph's, and at least ``LOGIT_ROWS``) computes every row's logits
and their argmax too: a greedy
verification then launches nothing before its bookkeeping, a sampled one starts from the logits.
A live batch of ``B`` requests replays
the smallest graph of at least ``B`` requests; the rows past ``B`` are padding that owns no tokens
and writes no KV.

A *ragged* step mixes prompt chunks with decodes (a request admitted into a running batch, a
prompt split by chunked prefill, a proposer's first step after it). The attention kernel sizes its
grid from the token and sequence counts alone (``kernels.paged_attention``), so one graph per
padded token count (``RAGGED_TOKENS``: every 128 up to 1,024, then 1,536 and 2,048), over every
request row, replays any such step: the token rows past the step's own compute values nobody reads
and write no KV. They are captured for dense-attention models outside batch-invariant mode; larger
steps, whose launches the device time covers anyway, run eagerly, as does everything else.

Replay removes the per-kernel launch cost (~300 launches for a 28-layer model), which dominates
small steps; it does not reduce FLOPs or bytes moved.
"""

from __future__ import annotations

import bisect
import logging
from typing import Callable

import torch

from specloop.kernel.outputs import SchedulerOutput
from specloop.kernels.sampling import argmax_rows, gumbel_sample
from specloop.proposers.step_graphs import graph_sizes

from ..batch import InputBatch
from ..executor import EagerExecutor, ForwardOutput, GraphKey
from .persistent_batch import PersistentBatch
from .triton_attention import GpuAttentionMetadata

logger = logging.getLogger("specloop")

RAGGED_TOKENS = (128, 256, 384, 512, 640, 768, 896, 1024, 1536, 2048)
# The attention tile a ragged graph fixes at capture: the tallest (as for any prompt of 128+ tokens).
RAGGED_QUERY_LEN = 128


class GraphExecutor:
    """The eager executor plus captured graphs, keyed by (q, padded request count)."""

    replays_uniform_batches = True
    LOGIT_ROWS = 64  # verification graphs of up to this many tokens compute their logits (at least)
    # A decode graph's long-context variant (``long_splits``, :meth:`long_variants`): where it splits
    # 4 ways or more, replayed (graph_for) when each split gets 128 keys of the longest context.
    LONG_MIN_SPLITS, LONG_SPLIT_KEYS = 4, 128

    def __init__(self, eager: EagerExecutor, batch: PersistentBatch, q_lens: list[int], hidden_size: int,
                 vocab_size: int, choose_splits: Callable[[int, int], int], ragged: bool = True,
                 sample_in_graph: bool = False, long_splits: Callable[[int], int] | None = None) -> None:
        self.eager = eager
        self.batch = batch
        self.q_lens = q_lens
        self.choose_splits = choose_splits  # (requests, max context) -> flash-decoding splits
        # (requests) -> the splits of a second decode graph, replayed over long contexts only
        self.long_splits = long_splits
        self.long: dict[int, int] = {}  # padded requests -> its long-context decode graph's splits
        self.sizes = graph_sizes(batch.max_reqs)
        # Ragged token counts: no more than the step holds, nor than the request rows' contexts
        # (the capture spreads its tokens over them).
        self.ragged = [t for t in RAGGED_TOKENS if t <= min(batch.max_tokens, batch.max_reqs * batch.max_len)] \
            if ragged else []
        self.max_tokens = max([min(batch.max_tokens, max(self.sizes) * max(q_lens)), *self.ragged])
        dtype = next(eager.model.parameters()).dtype
        self.hidden = torch.zeros(self.max_tokens, hidden_size, dtype=dtype, device=batch.device)
        self.aux = [torch.zeros_like(self.hidden) for _ in eager.aux_layers]
        # Every row of the largest decode graph, and of verification graphs up to LOGIT_ROWS tokens.
        rows = max(max(self.sizes), min(self.max_tokens, self.LOGIT_ROWS))
        self.logits = torch.zeros(rows, vocab_size, dtype=torch.float32, device=batch.device) \
            if 1 in q_lens else None
        self.sampled = torch.zeros(max(self.sizes), dtype=torch.int64, device=batch.device) \
            if sample_in_graph and self.logits is not None else None
        self.greedy = batch.top if self.logits is not None and max(q_lens) > 1 else None
        batch.draws_in_graph = self.sampled is not None
        # (q, padded requests) of the uniform graphs; (0, padded tokens) of the ragged ones
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.splits: dict[tuple[int, int], int] = {}
        self.num_replays = 0
        self.num_ragged_replays = 0
        self.num_long_replays = 0

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
        """Every graph, largest first (the ragged ones, then the uniform), in one memory pool."""
        pool = None
        device = self.batch.device
        size = max(self.sizes)
        bodies = [((0, t), lambda t=t: self._body(0, size, t)) for t in sorted(self.ragged, reverse=True)]
        for q in self.q_lens:
            bodies += [((q, s), lambda q=q, s=s: self._body(q, s)) for s in sorted(self.sizes, reverse=True)
                       if s * q <= self.max_tokens]
        self.long = self.long_variants()
        bodies += [((-1, s), lambda s=s: self._body(1, s, long=True)) for s in sorted(self.long, reverse=True)]
        for key, body in bodies:
            graph = torch.cuda.CUDAGraph()
            run = body()
            with torch.inference_mode():
                run()  # warm-up outside the graph: compiles kernels, sets up cuBLAS
                torch.cuda.synchronize(device)
                with torch.cuda.graph(graph, pool=pool):
                    run()
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize(device)
        logger.info("captured %d CUDA graphs (q in %s, up to %d requests; ragged up to %d tokens)", len(self.graphs),
                    self.q_lens, max(self.sizes), max(self.ragged, default=0))

    def long_variants(self) -> dict[int, int]:
        """The padded request counts whose decode graph gets a long-context variant, and its
        splits: where the size's own graph runs one split (its sequences alone fill the chip) and
        ``long_splits`` gives at least ``LONG_MIN_SPLITS``."""
        if self.long_splits is None or 1 not in self.q_lens:
            return {}
        long = {s: self.long_splits(s) for s in self.sizes if self.choose_splits(s, self.batch.max_len) == 1}
        return {s: n for s, n in long.items() if n >= self.LONG_MIN_SPLITS}

    def _body(self, q: int, size: int, ragged_tokens: int = 0, long: bool = False) -> Callable[[], None]:
        """The forward of ``size`` request rows of ``q`` tokens, or with ``q = 0`` of
        ``ragged_tokens`` tokens spread over them; ``long``: a decode graph's long-context variant."""
        pb, eager = self.batch, self.eager
        if q:
            tokens, per, query_len = size * q, q, q
        else:
            tokens, per, query_len = ragged_tokens, -(-ragged_tokens // size), RAGGED_QUERY_LEN
        # Placeholder step: request i owns tokens [i * per, (i + 1) * per) of block 0 (all of them
        # a context its block-table row can hold) and writes no KV. Replays read the live values
        # the persistent batch writes to the same addresses.
        starts = [min(i * per, tokens) for i in range(size + 1)]
        lens = [b - a for a, b in zip(starts, starts[1:])]
        pb.query_start_loc[:size + 1].copy_(torch.tensor(starts, dtype=torch.int32))
        pb.seq_lens[:size].copy_(torch.tensor(lens, dtype=torch.int32))
        pb.block_tables[:size].zero_()
        pb.slot_mapping[:tokens].fill_(-1)
        splits = self.long[size] if long else self.choose_splits(size, pb.max_len) if q else 1
        self.splits[(-1 if long else q, size if q else ragged_tokens)] = splits
        meta = GpuAttentionMetadata(
            query_start_loc=pb.query_start_loc[:size + 1], seq_lens=pb.seq_lens[:size],
            slot_mapping=pb.slot_mapping[:tokens], block_tables=pb.block_tables[:size],
            max_query_len=query_len, max_seq_len=pb.max_len,
            query_start_loc_cpu=starts, seq_lens_cpu=lens, num_splits=splits)
        ctx = eager.context(meta)
        model = eager.model

        def run() -> None:
            hidden, aux = model(pb.input_ids[:tokens], pb.positions[:tokens], ctx, aux_layers=eager.aux_layers)
            if eager.record is not None:
                eager.record(hidden, aux, pb.slot_mapping[:tokens])
            self.hidden[:tokens].copy_(hidden)
            for buffer, tapped in zip(self.aux, aux):
                buffer[:tokens].copy_(tapped)
            if self._with_logits(q, size):
                self.logits[:tokens].copy_(model.compute_logits(hidden))
                if q > 1:
                    argmax_rows(self.logits[:tokens], out=self.greedy[:tokens])
                elif self.sampled is not None:
                    slots = pb.req_slots[:size]
                    drawn = gumbel_sample(self.logits[:size], pb.temperature.index_select(0, slots),
                                          pb.seeds.index_select(0, slots), pb.seq_lens[:size].long(),
                                          out=self.sampled[:size])
                    pb.tokens.view(-1).index_copy_(0, pb.write_at[:size].long(), drawn.to(torch.int32))
        return run

    def _with_logits(self, q: int, size: int) -> bool:
        """Whether the uniform graph of ``size`` requests of ``q`` tokens computes their logits."""
        return q > 0 and self.logits is not None and q * size <= self.logits.shape[0]

    def graph_for(self, plan: SchedulerOutput, max_context: Callable[[], int] | None = None) -> GraphKey | None:
        """The graph for this plan: the uniform one of its q and size (a decode step whose longest
        context, ``max_context()``, gives each split of the size's long-context variant two tiles:
        that variant), else the ragged one of its token count; None when it has none (too large)."""
        counts = plan.num_scheduled_tokens
        if not counts:
            return None
        q = next(iter(counts.values()))
        total = plan.total_num_scheduled_tokens
        if q in self.q_lens and total == q * len(counts) and all(n == q for n in counts.values()):
            i = bisect.bisect_left(self.sizes, len(counts))
            if i < len(self.sizes) and (q, self.sizes[i]) in self.graphs:
                size = self.sizes[i]
                long = self.long.get(size, 0) if q == 1 else 0
                if long and max_context is not None and max_context() >= long * self.LONG_SPLIT_KEYS:
                    return GraphKey(1, size, long, long=True)
                return GraphKey(q, size, self.splits[(q, size)])
        i = bisect.bisect_left(self.ragged, total)
        if i == len(self.ragged) or len(counts) > max(self.sizes) or (0, self.ragged[i]) not in self.graphs:
            return None
        return GraphKey(0, max(self.sizes), 1, self.ragged[i])

    def run(self, batch: InputBatch, key: GraphKey | None = None) -> ForwardOutput:
        if key is None:
            return self.eager.run(batch)
        self.graphs[(-1 if key.long else key.q, key.size if key.q else key.tokens)].replay()
        self.num_replays += 1
        self.num_ragged_replays += not key.q
        self.num_long_replays += key.long
        n = batch.num_tokens
        with_logits = self._with_logits(key.q, key.size)
        logits = self.logits[:n] if with_logits else None
        sampled = self.sampled[:n] if key.q == 1 and self.sampled is not None else None
        greedy = self.greedy[:n] if with_logits and key.q > 1 else None
        return ForwardOutput(self.hidden[:n], [a[:n] for a in self.aux], logits, sampled, greedy)

"""EAGLE-1 and EAGLE-3 proposers: a one-layer head drafts K tokens from the target's hidden states.

``speculative_config={"method": "eagle" | "eagle3", "model": HEAD_DIR, "num_speculative_tokens": K}``
(layouts in ``proposers.heads``). Position ``p`` of the head pairs the token at ``p + 1`` with a
hidden state for position ``p``: the target's (EAGLE-1: its final state; EAGLE-3: ``fc`` over the
residual streams entering three target layers, tapped during the target's own forward) for every
position the target computed, the head's own output for the positions it drafts.

Cache. The head's paged KV cache has the target's blocks and is indexed by the target's block
table, so it is allocated, preempted, freed and prefix-cached with the target's. Its entry for
position ``p`` needs only the target's state at ``p`` and the token after it, so the proposer
records the target's states as the target computes them (``record``, inside the target's forward
and its CUDA graphs: one row per KV slot, the head's input after EAGLE-3's ``fc``) and feeds the
head lazily: a proposal first feeds each request every position its cache lacks below the newest
token, from that record (``catches_up``). A request proposed for in every step lacks exactly the
step's rows; after steps the speculation policy drafted nothing for (which then cost the head
nothing) it lacks those steps' positions too, and a new request its whole prompt, prefix-cache hits
included (their record is the target's; rewriting a shared entry writes the value it holds, since
the last block of a hit, whose last entry pairs with this request's next token, is recomputed:
``SpeculativeConfig.reads_target_hidden_states``). Rows of rejected drafts leave entries past the
newest token, rewritten before anything reads them, so the cache below the newest token always
holds target-fed entries.

Drafting. Step 1 is that feed: its output at the last accepted position gives draft 1. Each further
step feeds one draft at the next position with the previous step's output as its hidden state.
Drafts are drawn with the request's sampling processing and report their distribution (``draw``).
On CUDA with the Triton attention backend a uniform decode or verification step's proposal replays
one graph (``proposers.chain_graphs.ProposalGraphs``): the first step over every target row, each
request's output at its newest accepted row, its argmax, and the further steps, each step's output
and argmax feeding the next on the device. When every drafting request is plain greedy those are
the drafts, read once; otherwise the further steps are drawn eagerly from the graph's first-step
outputs. After a step that is not uniform (a prompt chunk) the first step runs eagerly and the
greedy further steps replay one graph (``ChainGraphs``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from specloop.kernel.config import EngineConfig
from specloop.models.attention import AttentionMetadata
from specloop.models.context import ForwardContext
from specloop.models.loader import resolve_dtype

from .base import DraftProposal, LaunchInputs, Proposer, ProposerContext, ProposerInputs, draft_limits
from .draft_vocab import DraftHead
from .draw import draw, plain_greedy
from .heads import Eagle3Head, load_head
from .recorded import Recorded
from .chain_graphs import (ChainGraphs, ProposalGraphs, capture_feeds, greedy_drafts, greedy_graphed, launchable,
                           take_drafts)
from .feed_graphs import FeedGraphs
from .step_graphs import StepGraphs, feed_token_ids, graphs_wanted, last_pool, uniform_feed, warm_up_eager


class EagleProposer(Proposer):
    """EAGLE-1 (``"eagle"``); :class:`Eagle3Proposer` is EAGLE-3."""
    config_fields = frozenset({"model", "draft_dtype", "token_map"})

    version = 1
    needs_hidden_states = True
    catches_up = True
    records_hidden_states = True
    launches = True

    def __init__(self, config: EngineConfig, context: ProposerContext) -> None:
        super().__init__(config, context)
        spec = config.speculative_config
        if not spec.model:
            raise ValueError(f"speculative_config.method={spec.method!r} needs 'model' (a local head checkpoint path)")
        self.device = context.device
        self.dtype = resolve_dtype(spec.draft_dtype, context.device) if spec.draft_dtype else context.dtype
        self.head, self.head_config, layers = load_head(spec.model, self.version, context, self.dtype)
        # The forward taps each layer once, in layer order; the head's fc reads them in its own order.
        self.hidden_state_layers = tuple(sorted(set(layers)))
        self.aux_order = [self.hidden_state_layers.index(i) for i in layers]
        self.embed_tokens = context.embed_tokens
        self.target_head = DraftHead(context, spec.token_map)  # EAGLE-1 drafts through the target's head
        self.attn_backend = context.attention_backend()
        self.ops = context.ops
        self.block_size = context.block_size
        self.kv_caches: list[torch.Tensor] = []
        self.graphs_on = False  # greedy drafting replays graphs (CUDA, Triton attention)
        self.chain: ChainGraphs | None = None  # drafts 2..K
        self.feed_graphs: dict[int, StepGraphs] = {}  # the first step's, by rows per request
        self.ragged: FeedGraphs | None = None  # catch-ups' ragged feeds
        # The head's input states of the target's rows, by KV slot, and how far each request is fed.
        self.recorded = Recorded(self.head_config.hidden_size, self.dtype, self.device,
                                 max(config.max_num_batched_tokens or 8192, 1024))

    def kv_cache_bytes_per_block(self) -> int:
        return (self.head_config.kv_bytes_per_block(self.block_size, self.dtype.itemsize)
                + self.recorded.bytes_per_block(self.block_size))

    def initialize(self, num_kv_blocks: int) -> None:
        mc = self.head_config
        shape = self.attn_backend.kv_cache_shape(num_kv_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)]
        self.recorded.allocate(num_kv_blocks * self.block_size)
        self.chain, self.feed_graphs, self.ragged = None, {}, None
        self.graphs_on = graphs_wanted(self.config, self.device, self.attn_backend)
        if self.graphs_on:
            warm_up_eager(self._feed_step, self.device, self.block_size, self.config.max_model_len or 2048)
            c = self.config
            hidden = ((self.head_config.hidden_size,), self.dtype)
            max_len = (c.max_model_len or 2048) + self.num_speculative_tokens + 1
            self.feed_graphs = capture_feeds(self._feed_step, c, self.device, max_len, self.block_size,
                                             self.num_speculative_tokens, [], step=self._step,
                                             argmax=self._argmax, source=self.device_step)
            if self.num_speculative_tokens > 1:
                self.chain = ChainGraphs(self._step, self.device, c.max_num_seqs, max_len, self.block_size,
                                         self.num_speculative_tokens - 1, hidden, pool=last_pool(self.feed_graphs))
                self.chain.capture()
            # Last in the pool: no graph captured after it whose outputs its replays could overwrite.
            self.ragged = FeedGraphs(self._feed_step, self.device, c.max_num_seqs, self.recorded.max_rows, max_len,
                                     self.block_size, pool=self.chain.pool if self.chain else last_pool(self.feed_graphs))
            self.ragged.capture()

    def record(self, hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor],
               slot_mapping: torch.Tensor) -> None:
        rows = min(len(slot_mapping), len(hidden_states))
        self.recorded.write(self._head_input(hidden_states[:rows], [a[:rows] for a in aux_hidden_states]),
                            slot_mapping[:rows])

    def skip(self) -> None:
        self.recorded.skip()

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        self.recorded.forget(req_ids)

    def _step(self, meta: AttentionMetadata, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per request fed with the previous step's output: the head's output and its argmax."""
        embeds = self.embed_tokens(token_ids).to(self.dtype)
        out = self.head(embeds, hidden, positions, ForwardContext(self.attn_backend, meta, self.kv_caches, self.ops))
        return out, self._argmax(out)

    def _feed_step(self, meta: AttentionMetadata, token_ids: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor]:
        """The first step over ``q`` target rows per request, their states read from the record at
        their slots (the target's forward wrote them): the head's output per row."""
        embeds = self.embed_tokens(token_ids).to(self.dtype)
        ctx = ForwardContext(self.attn_backend, meta, self.kv_caches, self.ops)
        return (self.head(embeds, self.recorded.read(meta.slot_mapping), positions, ctx),)

    def propose(self, inputs: ProposerInputs) -> DraftProposal:
        with torch.inference_mode():
            return self._propose(inputs)

    def launch(self, step: LaunchInputs) -> torch.Tensor | None:
        """The whole greedy proposal's graph, fed from the device: row ``j``'s next token is the
        target's token after it (a draft it accepted, or its own token at the newest row). Only
        when the head's cache holds every position before the step's rows."""
        n = len(step.req_ids)
        feed = launchable(self.graphs_on, self.feed_graphs, n, step.q)
        first = step.first.tolist()
        if feed is None:
            return None
        with torch.inference_mode():
            if not self.recorded.fill_gaps(step, first, self._catch_up):
                return None
            drafts = feed.launch(step)
        self.recorded.launched(step.req_ids, first)
        return drafts

    def _propose(self, inputs: ProposerInputs) -> DraftProposal:
        n = inputs.num_reqs
        limits = np.where(inputs.num_sampled > 0, draft_limits(self.config, inputs, self.num_speculative_tokens), 0)
        qsl = inputs.query_start_loc
        first = inputs.positions[qsl[:-1]]
        newest = np.array([len(t) - 1 for t in inputs.token_ids], dtype=np.int64)
        # A step's rows, less the rejected drafts at the end of each request, when the cache holds
        # everything before them (one graph when uniform); else every position it lacks.
        feed = uniform_feed(self.feed_graphs, inputs.num_sampled, qsl)
        drafts: list[list[int]] = [[] for _ in range(n)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]  # none: one-hot
        live = [i for i in range(n) if limits[i] > 0]
        if feed is not None and self.recorded.fill_gaps(inputs, first.tolist(), self._catch_up):
            counts = qsl[1:] - qsl[:-1] - inputs.num_rejected
            out, greedy, last_rows, last_pos = self._feed_graph(inputs, feed, counts)
            self.recorded.fed_to(inputs.req_ids, newest)
            if live and self.graphs_on and plain_greedy(inputs, live):
                rows = greedy[:n].tolist()  # the whole proposal was in the graph
                take_drafts([rows[i] for i in live], live, limits, drafts)
                return DraftProposal(drafts, [None] * n)
            out = out[torch.as_tensor(last_rows[live], device=self.device)]
        else:
            start = np.array([self.recorded.valid(rid, int(f)) for rid, f in zip(inputs.req_ids, first)])
            out = self._catch_up(inputs, start, newest, np.arange(n))
            self.recorded.fed_to(inputs.req_ids, newest)
            last_pos = newest - 1
            out = out[torch.as_tensor(live, device=self.device, dtype=torch.int64)]
        if not live:
            return DraftProposal(drafts, [None] * n)
        if greedy_graphed(self.graphs_on, self.chain, limits[live]) and plain_greedy(inputs, live):
            greedy_drafts(self.chain, live, limits, last_pos, inputs.block_ids, out, self._argmax(out), drafts)
            return DraftProposal(drafts, [None] * n)
        for step in range(int(limits.max())):
            if step:
                keep = [k for k, i in enumerate(live) if limits[i] > step]
                live = [live[k] for k in keep]
                ids = np.array([drafts[i][-1] for i in live], dtype=np.int64)
                out = self._forward(inputs, live, ids, out[torch.as_tensor(keep, device=self.device)],
                                    last_pos[live] + step, list(range(len(live) + 1)))
            if plain_greedy(inputs, live):
                tokens, q = self._argmax(out).tolist(), None
            else:
                tokens, q = draw(inputs, live, self._logits(out), drafts)
            for k, i in enumerate(live):
                drafts[i].append(tokens[k])
                if q is not None:
                    probs[i].append(q[k])
        return DraftProposal(drafts, [torch.stack(p) if p else None for p in probs])

    def _catch_up(self, inputs: ProposerInputs | LaunchInputs, start: np.ndarray, end: np.ndarray,
                  reqs: np.ndarray) -> torch.Tensor:
        """Feed request ``reqs[k]``'s positions ``start[k] .. end[k] - 1`` (at least the last) from
        the record, a group of at most ``max_rows`` rows a forward; each one's output at its last
        position ``[len(reqs), H]``."""
        last = torch.empty(len(start), self.head_config.hidden_size, dtype=self.dtype, device=self.device)
        for pieces in self.recorded.pieces(start, end):
            if self.ragged is not None and self.ragged.feed_into(last, pieces, end, reqs, inputs):
                continue
            group = [(int(reqs[k]), s, e) for k, s, e in pieces]
            positions = np.concatenate([np.arange(s, e) for _, s, e in group])
            qsl = np.concatenate([[0], np.cumsum([e - s for _, s, e in group])])
            ids = np.concatenate([inputs.token_ids[i][s + 1:e + 1] for i, s, e in group])
            hidden = self.recorded.read_positions(inputs.block_ids, group, self.block_size)
            out = self._forward(inputs, [i for i, _, _ in group], ids, hidden, positions, qsl.tolist())
            ends = [j for j, (k, _, e) in enumerate(pieces) if e == end[k]]
            index = torch.as_tensor([pieces[j][0] for j in ends], dtype=torch.int64, device=self.device)
            last[index] = out[torch.as_tensor(qsl[1:][ends] - 1, dtype=torch.int64, device=self.device)]
        return last

    def _feed_graph(self, inputs: ProposerInputs, feed: ProposalGraphs, counts: np.ndarray
                    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
        """The uniform first step replayed from a graph: all ``q`` rows of every request, the rows
        of rejected drafts included (their cache entries lie past the accepted tokens, where this
        step's drafts and the next feed write before anything reads), and the greedy drafts from
        there. Returns the outputs, the greedy drafts, each request's row of its last accepted
        position, and that position."""
        n, q = inputs.num_reqs, feed.q
        first = inputs.positions[inputs.query_start_loc[:-1]]
        ids = torch.from_numpy(feed_token_ids(inputs.token_ids, first, q)).to(self.device)
        out, greedy = feed.propose(ids, first, inputs.block_ids[:n], counts)
        return out, greedy, np.arange(n) * q + counts - 1, first + counts - 1

    def _head_input(self, hidden: torch.Tensor, aux: Sequence[torch.Tensor]) -> torch.Tensor:
        """The head's state input for target rows: EAGLE-3's ``fc`` over the tapped streams, else
        the target's final state."""
        head = self.head
        if isinstance(head, Eagle3Head) and head.fc is not None:
            return head.fc(torch.cat([aux[k] for k in self.aux_order], dim=-1).to(self.dtype))
        return hidden.to(self.dtype)

    def _forward(self, inputs: ProposerInputs, reqs: Sequence[int], token_ids: np.ndarray, hidden: torch.Tensor,
                 positions: np.ndarray, qsl: list[int]) -> torch.Tensor:
        """The head over ragged rows: request ``reqs[k]`` owns rows ``qsl[k]:qsl[k + 1]``, at
        consecutive ``positions`` ending at its context's end. Returns the head's output per row."""
        bs = self.block_size
        slots, seq_lens, tables = [], [], []
        for k, i in enumerate(reqs):
            blocks = inputs.block_ids[i]
            pos = positions[qsl[k]:qsl[k + 1]]
            if int(pos[-1]) >= len(blocks) * bs:
                raise RuntimeError(f"draft position {int(pos[-1])} of request {inputs.req_ids[i]!r} is past its "
                                   f"{len(blocks)} KV blocks")
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos.tolist())
            seq_lens.append(int(pos[-1]) + 1)
            tables.append(blocks)
        dev = self.device
        meta = AttentionMetadata.build(qsl, seq_lens, slots, tables, dev)
        ctx = ForwardContext(self.attn_backend, meta, self.kv_caches, self.ops)
        embeds = self.embed_tokens(torch.as_tensor(token_ids, device=dev)).to(self.dtype)
        return self.head(embeds, hidden, torch.as_tensor(positions, device=dev), ctx)

    def _argmax(self, out: torch.Tensor) -> torch.Tensor:
        """Target-vocabulary ids of the head's greedy next tokens."""
        if isinstance(self.head, Eagle3Head):
            return self.head.argmax(out, self.ops)
        return self.target_head.argmax(out, self.ops)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        if isinstance(self.head, Eagle3Head):
            return self.head.logits(out, self.ops)
        return self.target_head.logits(out)


class Eagle3Proposer(EagleProposer):
    """EAGLE-3 (``"eagle3"``): reads the residual streams entering three target layers."""

    config_fields = frozenset({"model", "draft_dtype"})  # its head has a vocabulary of its own (d2t)
    version = 3


"""EAGLE-1 and EAGLE-3 proposers: a one-layer head drafts K tokens from the target's hidden states.

``speculative_config={"method": "eagle" | "eagle3", "model": HEAD_DIR, "num_speculative_tokens": K}``
(layouts in ``proposers.heads``). Position ``p`` of the head pairs the token at ``p + 1`` with a
hidden state for position ``p``: the target's (EAGLE-1: its final state; EAGLE-3: ``fc`` over the
residual streams entering three target layers, tapped during the target's own forward) for every
position the target computed, the head's own output for the positions it drafts.

Cache. The head's paged KV cache has the target's blocks and is indexed by the target's block
table, so it is allocated, preempted, freed and prefix-cached with the target's. Every step feeds
the head every position the target computed in that step (prefill chunks too, hence
``runs_on_prefill_chunks``) except rejected drafts, with the target's hidden states; that overwrites
whatever the previous step drafted there, so the cache below the newest token always holds
target-fed entries, rolled back with the target by construction and with no per-request state.
One approximation: a prefix-cache hit ending at position ``p`` reuses the head's entry for ``p``,
which paired ``p``'s hidden state with the token after it *in the request that wrote the block*.
Where the new request continues with another token (its prompt diverges from the cached one
exactly at a block boundary) that one entry was built from the other token; the block is shared,
so it cannot be right for both. Outputs are unaffected (the target verifies every draft); only
that request's acceptance can dip. (vLLM recomputes the last hit block instead.)

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

from typing import Sequence

import numpy as np
import torch

from specloop.kernel.config import EngineConfig
from specloop.models.attention import AttentionMetadata
from specloop.models.context import ForwardContext
from specloop.models.loader import resolve_dtype

from .base import DraftProposal, KeepUpInputs, LaunchInputs, Proposer, ProposerContext, ProposerInputs, draft_limits
from .draw import draw, plain_greedy
from .heads import Eagle3Head, load_head
from .chain_graphs import (ChainGraphs, ProposalGraphs, capture_feeds, greedy_drafts, greedy_graphed, launchable,
                           take_drafts)
from .step_graphs import StepGraphs, feed_token_ids, graphs_wanted, last_pool, uniform_feed


class EagleProposer(Proposer):
    """EAGLE-1 (``"eagle"``); :class:`Eagle3Proposer` is EAGLE-3."""

    version = 1
    needs_hidden_states = True
    keeps_up = True
    launches = True
    runs_on_prefill_chunks = True

    def __init__(self, config: EngineConfig, context: ProposerContext) -> None:
        super().__init__(config, context)
        spec = config.speculative_config
        if not spec.model:
            raise ValueError(f"speculative_config.method={spec.method!r} needs 'model' (a local head checkpoint path)")
        self.device = context.device
        self.target_dtype = context.dtype
        self.dtype = resolve_dtype(spec.draft_dtype, context.device) if spec.draft_dtype else context.dtype
        self.head, self.head_config, layers = load_head(spec.model, self.version, context, self.dtype)
        # The forward taps each layer once, in layer order; the head's fc reads them in its own order.
        self.hidden_state_layers = tuple(sorted(set(layers)))
        self.aux_order = [self.hidden_state_layers.index(i) for i in layers]
        self.embed_tokens = context.embed_tokens
        self.target_logits = context.lm_head
        self.attn_backend = context.attention_backend()
        self.ops = context.ops
        self.block_size = context.block_size
        self.kv_caches: list[torch.Tensor] = []
        self.graphs_on = False  # greedy drafting replays graphs (CUDA, Triton attention)
        self.chain: ChainGraphs | None = None  # drafts 2..K
        self.feed_graphs: dict[int, StepGraphs] = {}  # the first step's, by rows per request
        self.follow: StepGraphs | None = None  # keep_up's feed of one row per request

    def kv_cache_bytes_per_block(self) -> int:
        return self.head_config.kv_bytes_per_block(self.block_size, self.dtype.itemsize)

    def initialize(self, num_kv_blocks: int) -> None:
        mc = self.head_config
        shape = self.attn_backend.kv_cache_shape(num_kv_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)]
        self.chain, self.feed_graphs, self.follow = None, {}, None
        self.graphs_on = graphs_wanted(self.config, self.device, self.attn_backend)
        if self.graphs_on:
            c = self.config
            hidden = ((self.head_config.hidden_size,), self.dtype)
            max_len = (c.max_model_len or 2048) + self.num_speculative_tokens + 1
            self.feed_graphs = capture_feeds(self._feed_step, c, self.device, max_len, self.block_size,
                                             self.num_speculative_tokens, [hidden], step=self._step,
                                             argmax=self._argmax)
            self.follow = StepGraphs(self._feed_step, self.device, c.max_num_seqs, max_len, self.block_size,
                                     extra=[hidden], pool=last_pool(self.feed_graphs))
            self.follow.capture()
            if self.num_speculative_tokens > 1:
                self.chain = ChainGraphs(self._step, self.device, c.max_num_seqs, max_len, self.block_size,
                                         self.num_speculative_tokens - 1, hidden, pool=self.follow.pool)
                self.chain.capture()

    def _step(self, meta: AttentionMetadata, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per request fed with the previous step's output: the head's output and its argmax."""
        embeds = self.embed_tokens(token_ids).to(self.dtype)
        out = self.head(embeds, hidden, positions, ForwardContext(self.attn_backend, meta, self.kv_caches, self.ops))
        return out, self._argmax(out)

    def _feed_step(self, meta: AttentionMetadata, token_ids: torch.Tensor, positions: torch.Tensor,
                   hidden: torch.Tensor) -> tuple[torch.Tensor]:
        """The first step over ``q`` target rows per request: the head's output per row."""
        embeds = self.embed_tokens(token_ids).to(self.dtype)
        ctx = ForwardContext(self.attn_backend, meta, self.kv_caches, self.ops)
        return (self.head(embeds, hidden, positions, ctx),)

    def propose(self, inputs: ProposerInputs) -> DraftProposal:
        with torch.inference_mode():
            return self._propose(inputs)

    def launch(self, step: LaunchInputs) -> torch.Tensor | None:
        """The whole greedy proposal's graph, fed from the device: row ``j``'s next token is the
        target's token after it (a draft it accepted, or its own token at the newest row)."""
        n = len(step.req_ids)
        feed = launchable(self.graphs_on, self.feed_graphs, n, step.q)
        if feed is None:
            return None
        with torch.inference_mode():
            hidden = self._target_hidden(step, slice(0, n * step.q))
            return feed.propose(step.target_tokens, step.first, step.block_ids, step.accepted, hidden)[1][:n]

    def keep_up(self, step: KeepUpInputs) -> None:
        """Each request's newest position into the head's cache (its hidden state with the token
        sampled after it, still on the device), as a proposal's first step would write it."""
        n = len(step.req_ids)
        with torch.inference_mode():
            hidden = self._target_hidden(step, slice(0, n))
            if self.follow is not None and self.follow.fits(n):
                self.follow.run(step.next_token_ids, step.positions, step.block_ids, hidden)
            else:
                self._forward(step, range(n), step.next_token_ids, hidden, step.positions, list(range(n + 1)))

    def _propose(self, inputs: ProposerInputs) -> DraftProposal:
        n = inputs.num_reqs
        limits = np.where(inputs.num_sampled > 0, draft_limits(self.config, inputs, self.num_speculative_tokens), 0)
        # Feed every row the target computed, less the rejected drafts at the end of each request.
        qsl = inputs.query_start_loc
        counts = qsl[1:] - qsl[:-1] - inputs.num_rejected
        feed = uniform_feed(self.feed_graphs, inputs.num_sampled, qsl)
        drafts: list[list[int]] = [[] for _ in range(n)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]  # none: one-hot
        live = [i for i in range(n) if limits[i] > 0]
        if feed is not None:
            out, greedy, last_rows, last_pos = self._feed_graph(inputs, feed, counts)
            if live and self.graphs_on and plain_greedy(inputs, live):
                rows = greedy[:n].tolist()  # the whole proposal was in the graph
                take_drafts([rows[i] for i in live], live, limits, drafts)
                return DraftProposal(drafts, [None] * n)
        else:
            rows = np.concatenate([np.arange(qsl[i], qsl[i] + counts[i]) for i in range(n)])
            positions = inputs.positions[rows]
            feed_qsl = np.concatenate([[0], np.cumsum(counts)])
            next_ids = np.concatenate([inputs.token_ids[i][positions[feed_qsl[i]:feed_qsl[i + 1]] + 1]
                                       for i in range(n)])
            last_rows = feed_qsl[1:] - 1
            last_pos = positions[last_rows]
            hidden = self._target_hidden(inputs, torch.as_tensor(rows, device=self.device))
            out = self._forward(inputs, list(range(n)), next_ids, hidden, positions, feed_qsl.tolist())
        if not live:
            return DraftProposal(drafts, [None] * n)
        out = out[torch.as_tensor(last_rows[live], device=self.device)]
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
        out, greedy = feed.propose(ids, first, inputs.block_ids[:n], counts,
                                   self._target_hidden(inputs, slice(0, n * q)))
        return out, greedy, np.arange(n) * q + counts - 1, first + counts - 1

    def _target_hidden(self, inputs: ProposerInputs | KeepUpInputs | LaunchInputs, rows: torch.Tensor | slice
                       ) -> torch.Tensor:
        head = self.head
        if isinstance(head, Eagle3Head) and head.fc is not None:
            aux = inputs.aux_hidden_states
            return head.fc(torch.cat([aux[k][rows] for k in self.aux_order], dim=-1).to(self.dtype))
        return inputs.hidden_states[rows].to(self.dtype)

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
        return self.target_logits(out.to(self.target_dtype)).argmax(dim=-1)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        if isinstance(self.head, Eagle3Head):
            return self.head.logits(out, self.ops)
        return self.target_logits(out.to(self.target_dtype)).float()


class Eagle3Proposer(EagleProposer):
    """EAGLE-3 (``"eagle3"``): reads the residual streams entering three target layers."""

    version = 3


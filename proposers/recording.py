"""Drafting from the target's recorded states: what EAGLE's head and MTP's layers share.

Both keep a paged KV cache of their own over the target's positions, indexed by the target's block
table, whose entry at position ``p`` pairs the token at ``p + 1`` with a state for position ``p``:
the target's, recorded inside its forward (``record``; ``proposers.recorded``) for every position the
target computed, the proposer's own output for the positions it drafts. And both draft the same way:

* Step 1 feeds each request every verified position its cache lacks. In a run of steps with drafts
  that is the step's rows: replayed from one graph when every request computed the same number of
  rows (``StepGraphs``), rejected rows included (their entries lie past the newest token, where this
  step's drafts and the next step write before anything reads them); else eagerly, in ragged groups
  (``FeedGraphs``). After steps the policy drafted nothing for (skipped), those steps' positions
  too; for a new request its whole sequence. Step 1's output at the newest verified position gives
  draft 1, and the feeds that lead to a proposal (the whole-proposal graphs, the catch-ups) ask for
  that row's output alone (``rows``): the others are fed for their cache entries, so a model may
  stop them after attention (MTP's MoE then reads only the experts the kept rows route to).
* Step ``k + 1`` feeds draft ``k`` at the next position with step ``k``'s output as its state.
* Where one step function serves every further step (``chains``), plain greedy drafting replays
  graphs: the whole proposal in step 1's graph (``ProposalGraphs``, also launched from the device
  after a verification, before the host reads it), or steps 2..K after an eager step 1 as one graph
  (``ChainGraphs``). Other drafts are drawn with the request's sampling processing (``draw``), and
  report their distribution unless the request is greedy (one-hot).

A subclass loads its model, calls :meth:`_setup`, and gives :meth:`_feed` (step 1 over target
states), :meth:`_draft` (a further step), :meth:`_argmax` and :meth:`_logits` (of a step's output).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch

from specloop.models.attention import AttentionMetadata
from specloop.models.config import ModelConfig
from specloop.models.context import ForwardContext

from .base import DraftProposal, LaunchInputs, Proposer, ProposerContext, ProposerInputs, draft_limits
from .chain_graphs import (ChainGraphs, ProposalGraphs, capture_feeds, greedy_drafts, greedy_graphed, launchable,
                           take_drafts)
from .draw import draw, plain_greedy
from .feed_graphs import FeedGraphs
from .recorded import Recorded
from .step_graphs import StepGraphs, feed_token_ids, graphs_wanted, last_pool, uniform_feed, warm_up_eager


class RecordingProposer(Proposer):
    needs_hidden_states = True
    catches_up = True
    records_hidden_states = True
    launches = True  # where ``chains`` and a graph fits the step: the whole greedy proposal is one graph
    chains = True  # one step function serves every step after the first

    def _setup(self, context: ProposerContext, state_width: int, cache_config: ModelConfig) -> None:
        """The shared state, once ``device``, ``dtype`` and the model are set: ``state_width``
        values a recorded state (and a step's output), ``cache_config`` shapes the caches."""
        self.embed_tokens = context.embed_tokens
        self.attn_backend = context.attention_backend()
        self.ops = context.ops
        self.block_size = context.block_size
        self.state_width, self.cache_config = state_width, cache_config
        self.kv_caches: list[torch.Tensor] = []
        self.graphs_on = False  # greedy drafting replays graphs (CUDA, Triton attention)
        self.chain: ChainGraphs | None = None  # drafts 2..K
        self.feed_graphs: dict[int, StepGraphs] = {}  # step 1's, by rows per request
        self.ragged: FeedGraphs | None = None  # catch-ups' ragged feeds
        # The target's states by KV slot, and how far each request is fed.
        self.recorded = Recorded(state_width, self.dtype, self.device,
                                 max(self.config.max_num_batched_tokens or 8192, 1024))

    # --- the model: a subclass's -------------------------------------------------------------------

    def _feed(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
              rows: torch.Tensor | None = None) -> torch.Tensor:
        """Step 1 over rows of the target's ``states``, writing the cache at the rows' slots; the
        outputs at ``rows`` (indices into them; all without). Only a request's newest row gives a
        draft, so the feeds ask for those alone and the model may stop the others after attention,
        which is all their cache entries need."""
        raise NotImplementedError

    def _draft(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
               step: int) -> torch.Tensor:
        """Step ``step + 1`` (``step`` >= 1; 0 inside the graphs of ``chains``) from the previous
        step's outputs ``hidden``."""
        raise NotImplementedError

    def _argmax(self, out: torch.Tensor, step: int) -> torch.Tensor:
        """Target-vocabulary ids of the greedy next tokens after step ``step + 1``'s outputs."""
        raise NotImplementedError

    def _logits(self, out: torch.Tensor, step: int) -> torch.Tensor:
        raise NotImplementedError

    # --- the engine's calls ----------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        return (self.cache_config.kv_bytes_per_block(self.block_size, self.dtype.itemsize)
                + self.recorded.bytes_per_block(self.block_size))

    def initialize(self, num_kv_blocks: int) -> None:
        shape = self.cache_config.kv_cache_shape(self.attn_backend, num_kv_blocks, self.block_size)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.cache_config.num_layers)]
        self.recorded.allocate(num_kv_blocks * self.block_size)
        self.chain, self.feed_graphs, self.ragged = None, {}, None
        self.graphs_on = graphs_wanted(self.config, self.device, self.attn_backend)
        if not self.graphs_on:
            return
        # A catch-up over skipped positions or a new prompt runs eagerly: its attention variants
        # compile now, not mid-run.
        warm_up_eager(self._feed_step, self.device, self.block_size, self.config.max_model_len or 2048)
        c, k, whole = self.config, self.num_speculative_tokens, self.chains
        max_len = (c.max_model_len or 2048) + k + 1
        self.feed_graphs = capture_feeds(self._feed_step, c, self.device, max_len, self.block_size, k, [],
                                         step=self._step if whole else None,
                                         argmax=self._first_argmax if whole else None, source=self.device_step,
                                         selects=True)
        if whole and k > 1:
            self.chain = ChainGraphs(self._step, self.device, c.max_num_seqs, max_len, self.block_size, k - 1,
                                     ((self.state_width,), self.dtype), pool=last_pool(self.feed_graphs))
            self.chain.capture()
        # Last in the pool: no graph captured after it whose outputs its replays could overwrite.
        self.ragged = FeedGraphs(self._feed_step, self.device, c.max_num_seqs, self.recorded.max_rows, max_len,
                                 self.block_size, pool=self.chain.pool if self.chain else last_pool(self.feed_graphs),
                                 selects=True)
        self.ragged.capture()

    def record(self, hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor],
               slot_mapping: torch.Tensor) -> None:
        self.recorded.write(hidden_states, slot_mapping)

    def skip(self) -> None:
        self.recorded.skip()

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        self.recorded.forget(req_ids)

    def launch(self, step: LaunchInputs) -> torch.Tensor | None:
        """The whole greedy proposal's graph, fed from the device: row ``j``'s next token is the
        target's token after it (a draft it accepted, or its own token at the newest row). Only
        when the cache holds every position before the step's rows."""
        feed = launchable(self.graphs_on, self.feed_graphs, len(step.req_ids), step.q)
        if feed is None:
            return None
        first = step.first.tolist()
        with torch.inference_mode():
            if not self.recorded.fill_gaps(step, first, self._catch_up):
                return None
            drafts = feed.launch(step)
        self.recorded.launched(step.req_ids, first)
        return drafts

    def propose(self, inputs: ProposerInputs) -> DraftProposal:
        with torch.inference_mode():
            return self._propose(inputs)

    # --- drafting ----------------------------------------------------------------------------------------

    def _propose(self, inputs: ProposerInputs) -> DraftProposal:
        n = inputs.num_reqs
        limits = np.where(inputs.num_sampled > 0, draft_limits(self.config, inputs, self.num_speculative_tokens), 0)
        first = inputs.positions[inputs.query_start_loc[:-1]]
        newest = np.array([len(t) - 1 for t in inputs.token_ids], dtype=np.int64)
        drafts: list[list[int]] = [[] for _ in range(n)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        live = [i for i in range(n) if limits[i] > 0]
        # The step's rows when the cache holds everything before them (one graph when uniform),
        # else every position it lacks.
        feed = uniform_feed(self.feed_graphs, inputs.num_sampled, inputs.query_start_loc)
        if feed is not None and self.recorded.fill_gaps(inputs, first.tolist(), self._catch_up):
            out, greedy, last_rows = self._feed_graph(inputs, feed)
            self.recorded.fed_to(inputs.req_ids, newest)
            if live and greedy is not None and plain_greedy(inputs, live):
                rows = greedy[:n].tolist()  # the whole proposal was in the graph
                take_drafts([rows[i] for i in live], live, limits, drafts)
                return DraftProposal(drafts, [None] * n)
            out = out[torch.as_tensor(last_rows[live], dtype=torch.int64, device=self.device)]
        else:
            start = np.array([self.recorded.valid(rid, int(f)) for rid, f in zip(inputs.req_ids, first)])
            out = self._catch_up(inputs, start, newest, np.arange(n))
            self.recorded.fed_to(inputs.req_ids, newest)
            out = out[torch.as_tensor(live, dtype=torch.int64, device=self.device)]
        if not live:
            return DraftProposal(drafts, [None] * n)
        last_pos = newest - 1  # each request's newest verified position: its state gave ``out``
        if greedy_graphed(self.graphs_on, self.chain, limits[live]) and plain_greedy(inputs, live):
            greedy_drafts(self.chain, live, limits, last_pos, inputs.block_ids, out, self._argmax(out, 0), drafts)
            return DraftProposal(drafts, [None] * n)
        for step in range(int(limits.max())):
            if step:  # one position on: the previous draft, and the previous step's output
                keep = [k for k, i in enumerate(live) if limits[i] > step]
                live = [live[k] for k in keep]
                out = self._forward(inputs, live, [np.array([last_pos[i] + step]) for i in live],
                                    np.array([drafts[i][-1] for i in live], dtype=np.int64),
                                    out[torch.as_tensor(keep, dtype=torch.int64, device=self.device)], step)
            if plain_greedy(inputs, live):
                tokens, q = self._argmax(out, step).tolist(), None
            else:
                tokens, q = draw(inputs, live, self._logits(out, step), drafts)
            for k, i in enumerate(live):
                drafts[i].append(tokens[k])
                if q is not None and not inputs.sampling_params[i].greedy:
                    probs[i].append(q[k])
        return DraftProposal(drafts, [torch.stack(p) if p else None for p in probs])

    def _catch_up(self, inputs: ProposerInputs | LaunchInputs, start: np.ndarray, end: np.ndarray,
                  reqs: np.ndarray) -> torch.Tensor:
        """Step 1 over request ``reqs[k]``'s positions ``start[k] .. end[k] - 1`` (at least the last),
        the target's states from the record, a group of at most ``max_rows`` rows a forward. Returns
        each one's output at its last position ``[len(reqs), state_width]``."""
        last = torch.empty(len(start), self.state_width, dtype=self.dtype, device=self.device)
        for pieces in self.recorded.pieces(start, end):
            if self.ragged is not None and self.ragged.feed_into(last, pieces, end, reqs, inputs):
                continue
            group = [(int(reqs[k]), s, e) for k, s, e in pieces]
            positions = [np.arange(s, e) for _, s, e in group]
            tokens = np.concatenate([inputs.token_ids[i][s + 1:e + 1] for i, s, e in group])
            states = self.recorded.read_positions(inputs.block_ids, group, self.block_size)
            ends = [j for j, (k, _, e) in enumerate(pieces) if e == end[k]]
            rows = np.cumsum([len(p) for p in positions]) - 1
            # Outputs at the runs' ends only (a group of runs that all go on in a later group: its
            # last row's, unread).
            out = self._forward(inputs, [i for i, _, _ in group], positions, tokens, states, None,
                                rows=torch.as_tensor(rows[ends] if ends else rows[-1:], dtype=torch.int64,
                                                     device=self.device))
            if ends:
                last[torch.as_tensor([pieces[j][0] for j in ends], dtype=torch.int64, device=self.device)] = out
        return last

    def _feed_graph(self, inputs: ProposerInputs, feed: StepGraphs
                    ) -> tuple[torch.Tensor, torch.Tensor | None, np.ndarray]:
        """The step's rows replayed from a graph, all ``q`` rows of every request (and, from
        :class:`ProposalGraphs`, the greedy drafts). Returns the outputs, the greedy drafts (or
        None) and each request's row of its newest verified position."""
        n, q = inputs.num_reqs, feed.q
        first = inputs.positions[inputs.query_start_loc[:-1]]
        ids = torch.from_numpy(feed_token_ids(inputs.token_ids, first, q)).to(self.device)
        accepted = q - inputs.num_rejected
        if isinstance(feed, ProposalGraphs):  # its outputs are the newest rows' alone
            out, greedy = feed.propose(ids, first, inputs.block_ids[:n], accepted)
            return out, greedy, np.arange(n)
        (out,), greedy = feed.run(ids, first, inputs.block_ids[:n]), None
        return out, greedy, np.arange(n) * q + accepted - 1

    def _forward(self, inputs: ProposerInputs | LaunchInputs, reqs: Sequence[int], positions: list[np.ndarray],
                 tokens: np.ndarray, states: torch.Tensor, step: int | None, rows: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """Step 1 (``step`` None, over target ``states``) or step ``step + 1`` at ``positions[k]`` of
        request ``reqs[k]`` (consecutive, writing its cache there), reading ``tokens`` (one a
        position, packed) and ``states`` (likewise). The outputs, a row a position (step 1: at
        ``rows`` alone, if given)."""
        bs, dev = self.block_size, self.device
        slots, seq_lens, qsl = [], [], [0]
        for i, p in zip(reqs, positions):
            blocks = np.asarray(inputs.block_ids[i], dtype=np.int64)
            if p[-1] >= len(blocks) * bs:
                raise RuntimeError(f"draft position {int(p[-1])} of request {inputs.req_ids[i]!r} is past its "
                                   f"{len(blocks)} KV blocks")
            slots.append(blocks[p // bs] * bs + p % bs)
            seq_lens.append(int(p[-1]) + 1)
            qsl.append(qsl[-1] + len(p))
        meta = AttentionMetadata.build(qsl, seq_lens, np.concatenate(slots).tolist(),
                                       [inputs.block_ids[i] for i in reqs], dev)
        ctx = ForwardContext(self.attn_backend, meta, self.kv_caches, self.ops)
        embeds = self.embed_tokens(torch.as_tensor(tokens).to(dev)).to(self.dtype)
        pos = torch.from_numpy(np.concatenate(positions)).to(dev)
        return self._feed(embeds, states, pos, ctx, rows) if step is None else self._draft(embeds, states, pos, ctx, step)

    # --- the graphs' step functions ------------------------------------------------------------------------

    def _feed_step(self, meta: AttentionMetadata, token_ids: torch.Tensor, positions: torch.Tensor,
                   rows: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        """Step 1 over ``q`` target rows per request, their states read from the record at their
        slots (the target's forward wrote them); the outputs at ``rows`` (all without)."""
        embeds = self.embed_tokens(token_ids).to(self.dtype)
        ctx = ForwardContext(self.attn_backend, meta, self.kv_caches, self.ops)
        return (self._feed(embeds, self.recorded.read(meta.slot_mapping), positions, ctx, rows),)

    def _step(self, meta: AttentionMetadata, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """A further step of ``chains``, one token a request: the outputs and the greedy next drafts."""
        embeds = self.embed_tokens(token_ids).to(self.dtype)
        out = self._draft(embeds, hidden, positions, ForwardContext(self.attn_backend, meta, self.kv_caches, self.ops), 0)
        return out, self._argmax(out, 0)

    def _first_argmax(self, out: torch.Tensor) -> torch.Tensor:
        return self._argmax(out, 0)

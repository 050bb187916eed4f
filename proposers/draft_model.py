"""Draft-model proposer: a smaller model with the target's tokenizer drafts K tokens per step.

The draft model keeps its own paged KV cache, indexed by the *target's* block table: position
``p`` of a request lives at the same slot in both caches, so the scheduler's block allocation
(including the lookahead slots it reserves for drafts) covers the draft model too, and a finished or
preempted request's draft KV goes away with its blocks.

Rollback follows the committed tokens. After proposing ``k`` drafts for a request of ``L`` tokens,
the draft cache holds positions ``< L + k - 1``: the known tokens, then drafts ``0..k-2`` at
``L..L+k-2`` (the last draft is never fed back). An entry depends only on the tokens up to its
position, so at the next proposal the cache is valid up to the first of those drafts that differs
from the token committed there (and below the newest token, which the draft model has not seen),
however many steps the proposer skipped in between. The next proposal feeds everything from there
(the newest tokens, or a whole prompt after admission), then one token per further draft. Stale
slots are simply overwritten.

On CUDA with the Triton attention backend greedy drafting replays CUDA graphs
(``proposers.chain_graphs``) when every drafting request is plain greedy. The first step of a steady
decode or verification step feeds one or two tokens a request (two when every draft was accepted:
the last draft, never fed, and the target's token); the graph feeds every request the longest
feed's count, its newest tokens, re-feeding a position whose entry is already valid where a
request needs fewer (the same token at the same position: the same entry). Drafts 2..K follow in
the same graph (``ProposalGraphs``), each step's argmax feeding the next on the device; the host
reads the drafts once, at the end. A longer feed (a prompt after admission) runs eagerly, and the
drafts after it replay one graph of their own (``ChainGraphs``).

After a uniform greedy verification of ``q`` rows per request on the GPU runner the proposal is
launched from the device (:meth:`DraftModelProposer.launch`, :class:`TokenRowProposals`), before
the host reads the verification: one graph feeds each request the ``q + 1`` tokens of its device
token row from the verification's first position (its newest token, the drafts it accepted, the
target's token after them, then rows past it whose entries the next proposal rewrites before
anything reads them) and drafts from its newest token's row. That needs every position before the
verification's first in the draft cache: so for a request whose last proposal was launched in the
step before, or whose record says so; otherwise the host proposes, feeding from what it knows is
valid (after a launch, the positions up to that verification's first).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

import torch

from specloop.kernel.config import EngineConfig
from specloop.models.attention import AttentionMetadata
from specloop.models.context import ForwardContext
from specloop.models.loader import load_model
from specloop.models.parallel import SINGLE

from .base import DeviceStep, DraftProposal, LaunchInputs, Proposer, ProposerContext, ProposerInputs, draft_limits
from .draw import draw, plain_greedy
from .chain_graphs import ChainGraphs, ProposalGraphs, greedy_drafts, greedy_graphed, take_drafts
from .step_graphs import graphs_wanted, verification_shapes, warm_up_eager


class DraftModelProposer(Proposer):
    """``speculative_config={"method": "draft_model", "model": PATH, "num_speculative_tokens": K}``;
    ``draft_dtype`` overrides the target's dtype for the draft."""
    config_fields = frozenset({"model", "draft_dtype"})

    FEED_ROWS = (1, 2)  # tokens per request a steady step's first draft step feeds
    catches_up = True  # a proposal feeds every token its cache lacks (_valid_prefix)
    launches = True

    def __init__(self, config: EngineConfig, context: ProposerContext) -> None:
        super().__init__(config, context)
        spec = config.speculative_config
        if not spec.model:
            raise ValueError("speculative_config.method='draft_model' needs 'model' (a local checkpoint path)")
        self.device = context.device
        self.model, self.model_config = load_model(spec.model, context.models, self.device,
                                                   spec.draft_dtype or context.dtype, context.tp or SINGLE)
        if self.model_config.vocab_size != context.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.model_config.vocab_size}) differs from the "
                             f"target's ({context.vocab_size}); it must share the target's tokenizer")
        self.dtype = next(self.model.parameters()).dtype
        self.attn_backend = context.attention_backend()
        self.ops = context.ops
        self.block_size = context.block_size
        self.kv_caches: list[torch.Tensor] = []
        self.graphs_on = False  # greedy drafting replays graphs (CUDA, Triton attention)
        self.chain: ChainGraphs | None = None  # drafts 2..K
        self.feed_graphs: dict[int, ProposalGraphs] = {}  # whole proposals, by tokens fed per request
        self.launch_graphs: dict[int, TokenRowProposals] = {}  # launched ones, by rows verified per request
        self.launched_last: set[str] = set()  # requests the last call launched for (none since)
        # Per request, what the last proposal left in the draft cache: the request's length then
        # and the drafts it fed after it (module docstring).
        self.written: dict[str, tuple[int, list[int]]] = {}

    def kv_cache_bytes_per_block(self) -> int:
        return self.model_config.kv_bytes_per_block(self.block_size, self.dtype.itemsize)

    def initialize(self, num_kv_blocks: int) -> None:
        mc = self.model_config
        shape = mc.kv_cache_shape(self.attn_backend, num_kv_blocks, self.block_size)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_layers)]
        self.chain, self.feed_graphs, self.launch_graphs = None, {}, {}
        self.graphs_on = graphs_wanted(self.config, self.device, self.attn_backend)
        if not self.graphs_on:
            return
        # A catch-up over skipped tokens (after steps the policy drafted nothing after) or a new
        # prompt runs eagerly: its attention variants compile now, not mid-run.
        warm_up_eager(self._feed_step, self.device, self.block_size, self.config.max_model_len or 2048)
        c, k = self.config, self.num_speculative_tokens
        max_len = (c.max_model_len or 2048) + k + 1
        pool = None
        for q in self.FEED_ROWS:
            graphs = ProposalGraphs(self._feed_step, self._chain_step, self._argmax, self.device, c.max_num_seqs,
                                    max_len, self.block_size, k - 1, rows_per_req=q, pool=pool)
            graphs.capture()
            pool = graphs.pool
            self.feed_graphs[q] = graphs
        for q, max_reqs in verification_shapes(c, k) if self.device_step is not None else ():
            graphs = TokenRowProposals(self, self.device_step, q, max_reqs, max_len, pool)
            graphs.capture()
            pool = graphs.pool
            self.launch_graphs[q] = graphs
        if k > 1:  # captured last, so that its replays leave the feeds' live outputs alone
            self.chain = ChainGraphs(self._chain_step, self.device, c.max_num_seqs, max_len, self.block_size, k - 1,
                                     ((self.model_config.hidden_size,), self.dtype), pool=pool)
            self.chain.capture()

    def _context(self, meta: AttentionMetadata) -> ForwardContext:
        return ForwardContext(self.attn_backend, meta, self.kv_caches, self.ops)

    def _feed_step(self, meta: AttentionMetadata, token_ids: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor]:
        """``q`` tokens per request: the draft's hidden state after each."""
        return (self.model(token_ids, positions, self._context(meta))[0],)

    def _chain_step(self, meta: AttentionMetadata, token_ids: torch.Tensor, positions: torch.Tensor,
                    state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per request: its hidden state and the argmax of its next-token logits."""
        hidden, _ = self.model(token_ids, positions, self._context(meta))
        return hidden, self._argmax(hidden)

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.argmax(self.model.compute_logits(hidden))

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.written.pop(rid, None)
            self.launched_last.discard(rid)

    def skip(self) -> None:
        self.launched_last.clear()

    def launch(self, step: LaunchInputs) -> torch.Tensor | None:
        """The whole greedy proposal from one graph fed from the device (module docstring), when
        one was captured for the step's shape and every request's draft cache holds the positions
        before its first row."""
        graphs = self.launch_graphs.get(step.q)
        n = len(step.req_ids)
        if graphs is None or step.device is not graphs.source or not graphs.fits(n):
            return None
        first = step.first.tolist()
        if not all(rid in self.launched_last or self._valid_prefix(rid, tokens) >= f
                   for rid, tokens, f in zip(step.req_ids, step.token_ids, first)):
            return None
        with torch.inference_mode():
            drafts = graphs.replay_device(step)
        if drafts is None:
            return None
        for rid, f in zip(step.req_ids, first):  # positions up to ``f`` hold its tokens; past it, unknown yet
            self.written[rid] = (f + 1, [])
        self.launched_last = set(step.req_ids)
        return drafts

    def propose(self, inputs: ProposerInputs) -> DraftProposal:
        self.launched_last.clear()
        limits = draft_limits(self.config, inputs, self.num_speculative_tokens)
        drafts: list[list[int]] = [[] for _ in inputs.req_ids]
        probs: list[list[torch.Tensor]] = [[] for _ in inputs.req_ids]  # none: one-hot
        active = [i for i in range(inputs.num_reqs) if limits[i] > 0]
        if not active:
            return DraftProposal(drafts, [None] * inputs.num_reqs)
        lengths = {i: len(inputs.token_ids[i]) for i in active}
        # Step 0 feeds every token whose draft KV is missing, up to the newest one.
        feed = {}
        for i in active:
            valid = self._valid_prefix(inputs.req_ids[i], inputs.token_ids[i])
            feed[i] = (valid, inputs.token_ids[i][valid:].tolist())
        if greedy_graphed(self.graphs_on, self.chain, limits[active]) and plain_greedy(inputs, active):
            self._propose_greedy_graphs(inputs, active, limits, lengths, feed, drafts)
            self._remember(inputs, active, lengths, drafts)
            return DraftProposal(drafts, [None] * inputs.num_reqs)
        for step in range(int(limits.max())):
            live = [i for i in active if limits[i] > step]
            last_hidden = self._forward(inputs, live, feed)
            logits = self._logits(last_hidden)
            tokens, q = draw(inputs, live, logits, drafts)
            for k, i in enumerate(live):
                drafts[i].append(tokens[k])
                if q is not None and not inputs.sampling_params[i].greedy:
                    probs[i].append(q[k])
                position = lengths[i] + step
                feed[i] = (position, [tokens[k]])
        self._remember(inputs, active, lengths, drafts)
        # Greedy drafts are deterministic: the rejection sampler treats them as one-hot.
        return DraftProposal(drafts, [torch.stack(p) if p else None for p in probs])

    def _valid_prefix(self, req_id: str, token_ids: np.ndarray) -> int:
        """Positions at the start of the request whose draft KV holds its committed tokens: up to
        the first draft fed last time that differs from the token committed there, and below the
        newest token."""
        length, fed = self.written.get(req_id, (0, []))
        newest = len(token_ids) - 1
        valid = min(length, newest)
        for token in fed:
            if valid >= newest or int(token_ids[valid]) != token:
                break
            valid += 1
        return valid

    def _remember(self, inputs: ProposerInputs, active: list[int], lengths: dict[int, int],
                  drafts: list[list[int]]) -> None:
        for i in active:
            self.written[inputs.req_ids[i]] = (lengths[i], drafts[i][:-1])

    def _propose_greedy_graphs(self, inputs: ProposerInputs, active: list[int], limits: np.ndarray,
                               lengths: dict[int, int], feed: dict[int, tuple[int, list[int]]],
                               drafts: list[list[int]]) -> None:
        """Greedy drafts from graphs: the whole proposal in one when the feeds are short (a steady
        step), else an eager first step and the chain; one device-to-host read at the end."""
        q = max(len(feed[i][1]) for i in active)
        graphs = self.feed_graphs.get(q)
        with torch.inference_mode():
            if graphs is not None and graphs.fits(len(active)):
                first = np.array([lengths[i] - q for i in active], dtype=np.int64)
                ids = np.concatenate([inputs.token_ids[i][lengths[i] - q:] for i in active]).astype(np.int64)
                tokens = graphs.propose(torch.from_numpy(ids).to(self.device), first,
                                        [inputs.block_ids[i] for i in active], np.full(len(active), q))[1]
                take_drafts(tokens[:len(active)].tolist(), active, limits, drafts)
                return
            hidden = self._forward(inputs, active, feed)
            newest = np.array([len(t) - 1 for t in inputs.token_ids], dtype=np.int64)
            greedy_drafts(self.chain, active, limits, newest, inputs.block_ids, hidden, self._argmax(hidden), drafts)

    def _forward(self, inputs: ProposerInputs, live: list[int], feed: dict[int, tuple[int, list[int]]]
                 ) -> torch.Tensor:
        """Run the draft model over each live request's ``feed`` (first position, token ids);
        returns the hidden state of each request's last fed token."""
        bs = self.block_size
        input_ids, positions, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        for i in live:
            start, tokens = feed[i]
            blocks = inputs.block_ids[i]
            end = start + len(tokens)
            if end > len(blocks) * bs:
                raise RuntimeError(f"draft position {end - 1} of request {inputs.req_ids[i]!r} is past its "
                                   f"{len(blocks)} KV blocks")
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            tables.append(blocks)
        dev = self.device
        meta = AttentionMetadata.build(qsl, seq_lens, slots, tables, dev)
        ctx = ForwardContext(self.attn_backend, meta, self.kv_caches, self.ops)
        with torch.inference_mode():
            hidden, _ = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                                   torch.tensor(positions, dtype=torch.int64, device=dev), ctx)
        return hidden[torch.tensor(qsl[1:], device=dev) - 1]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.compute_logits(hidden).float()


class TokenRowProposals(ProposalGraphs):
    """A draft model's whole greedy proposal after a verification of ``verified`` rows per
    request, one graph per padded request count fed from the runner's step alone (``source``): the
    rows each request accepted (its next token written into its token row), then ``verified + 1``
    tokens a request from its token row at the verification's positions and one past, the drafts
    from its newest token's row on, and the drafts into the token rows."""

    host_fed = False

    def __init__(self, proposer: DraftModelProposer, source: DeviceStep, verified: int, max_reqs: int, max_len: int,
                 pool: object) -> None:
        super().__init__(proposer._feed_step, proposer._chain_step, proposer._argmax, proposer.device, max_reqs,
                         max_len, proposer.block_size, proposer.num_speculative_tokens - 1, rows_per_req=verified + 1,
                         pool=pool, source=source)
        self.verified = verified
        self._row_offsets = torch.arange(verified + 1, dtype=torch.int64, device=proposer.device)

    def device_forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        src, q, bs, rows = self.source, self.verified, self.block_size, size * self.q
        accepted = src.accept_rows(size, q)
        writable = src.writable(size)
        first = torch.where(writable > 0, src.positions[:size * q:q], 0)  # padding: position 0, nothing written
        pos = first[:, None] + self._row_offsets
        width = src.tokens.shape[1]
        at = src.req_slots[:size, None].long() * width + pos.clamp(max=width - 1)
        self.token_ids[:rows].copy_(src.tokens.view(-1).index_select(0, at.view(-1)))
        self._packed[0, :rows].copy_(pos.view(-1))
        tables = src.block_tables[:size]
        block = tables.gather(1, (pos // bs).clamp(max=tables.shape[1] - 1)).long()
        self._packed[1, :rows].copy_(torch.where(pos < writable[:, None], block * bs + pos % bs, -1).view(-1))
        self._packed[3, :size].copy_(accepted + 1)  # the newest token's row, counted from 1
        self._packed[4, :size].copy_(writable)
        self.seq_lens[:size].copy_(first + q + 1)
        width = min(self.max_blocks, tables.shape[1])
        self.block_tables[:size, :width].copy_(tables[:, :width])
        drafts = self.forward(size)[1]
        src.write_row_drafts(drafts, accepted, q)
        return drafts, accepted

"""Multi-token prediction (MTP): DeepSeek-V3's own draft layers, stored in the target's checkpoint.

``speculative_config={"method": "mtp", "num_speculative_tokens": K}`` (vLLM's ``"deepseek_mtp"``
too); ``model`` defaults to the target's directory, where the layers live at
``model.layers.{num_hidden_layers + j}`` (``models/deepseek_mtp.py``). The target's embedding and
head are used in place (``ProposerContext``), never copied.

At every verified position ``p`` the layer reads the embedding of token ``p + 1`` and the target's
final hidden state at ``p``; its own latent KV cache, indexed by the target's block table, holds an
entry for every such position. The target's forward records its final states by KV slot
(``record``, ``proposers.recorded``), and a proposal first feeds each request every verified
position its cache lacks: in a run of steps with drafts, the step's accepted rows; after steps the
policy drafted nothing for (skipped: they cost nothing), those steps' positions too; for a new
request its whole sequence. Rows of rejected drafts leave entries past the newest token, rewritten
before anything reads them, and a preempted or aborted request's cache goes with its blocks.

The output at the newest verified position ``L - 2`` gives draft 1 (token ``L``). Draft ``k + 1``
applies the layer again one position on, to draft ``k``'s embedding and its own previous output
(vLLM's way with one MTP layer; with several layers, step ``k`` uses layer ``k mod n``). Those
speculative cache rows sit past the verified positions and are rewritten by the next step.

On CUDA with the Triton attention backend both kinds of step replay CUDA graphs
(``proposers.step_graphs``, ``proposers.chain_graphs``): the first step when every request computed the same number of target
rows (decode and verification steps, drafts padded to one count), over all of those rows, the
rejected ones included (their cache rows lie past the verified positions, where this step's drafts
and the next step write before anything reads them); the further steps of a one-layer checkpoint
when every drafting request is plain greedy, each step's argmax and output feeding the next on the
device: in the same graph as that first step (``ProposalGraphs``), or after an eager first step as
one graph of their own (``ChainGraphs``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Sequence

import numpy as np
import torch

from specloop.kernel.config import EngineConfig
from specloop.models.attention import AttentionMetadata
from specloop.models.config import read_model_config
from specloop.models.context import ForwardContext
from specloop.models.deepseek_mtp import DeepSeekMTP
from specloop.models.loader import build_empty, iter_safetensors, resolve_dtype, safetensors_files

from .base import DraftProposal, LaunchInputs, Proposer, ProposerContext, ProposerInputs, draft_limits
from .draft_vocab import DraftHead
from .draw import draw, plain_greedy
from .chain_graphs import (ChainGraphs, ProposalGraphs, capture_feeds, greedy_drafts, greedy_graphed, launchable,
                           take_drafts)
from .recorded import Recorded
from .feed_graphs import FeedGraphs
from .step_graphs import StepGraphs, feed_token_ids, graphs_wanted, last_pool, uniform_feed, warm_up_eager

# Target architectures whose checkpoints carry MTP layers, and the module that runs them.
MTP_MODULES = {"DeepseekV3ForCausalLM": DeepSeekMTP, "DeepseekV2ForCausalLM": DeepSeekMTP}


class MTPProposer(Proposer):
    config_fields = frozenset({"model", "draft_dtype", "token_map"})
    needs_hidden_states = True
    catches_up = True
    records_hidden_states = True
    launches = True  # a one-layer checkpoint, when its proposal graph fits the step

    def __init__(self, config: EngineConfig, context: ProposerContext) -> None:
        super().__init__(config, context)
        spec = config.speculative_config
        path = spec.model or config.model
        cfg = read_model_config(path)
        module = MTP_MODULES.get(cfg.architecture)
        if module is None:
            raise ValueError(f"speculative_config.method={spec.method!r}: {cfg.architecture} has no MTP layers "
                             f"specloop can run (supported: {', '.join(sorted(MTP_MODULES))})")
        if cfg.num_mtp_layers < 1:
            raise ValueError(f"speculative_config.method={spec.method!r}: {path} has no MTP layer "
                             "(num_nextn_predict_layers is 0)")
        if (cfg.hidden_size, cfg.vocab_size) != (context.model_config.hidden_size, context.vocab_size):
            raise ValueError(f"the MTP layers of {path} do not fit the target (hidden size, vocabulary)")
        self.device = context.device
        self.dtype = resolve_dtype(spec.draft_dtype, context.device) if spec.draft_dtype else context.dtype
        self.model = build_empty(lambda: module(hf_config=cfg.hf), self.device, self.dtype)
        first = cfg.num_layers

        def mtp_tensor(name: str) -> bool:
            match = re.match(r"model\.layers\.(\d+)\.", name)
            return match is not None and int(match[1]) >= first

        self.model.load_weights(iter_safetensors(safetensors_files(path), self.device, keep=mtp_tensor))
        self.model.eval().requires_grad_(False)
        self.num_layers = cfg.num_mtp_layers
        self.cache_config = dataclasses.replace(cfg, num_layers=cfg.num_mtp_layers)  # shapes the layers' caches
        self.embed_tokens = context.embed_tokens
        self.head = DraftHead(context, spec.token_map)  # the target's head, or a token map's rows of it
        self.attn_backend = context.attention_backend()
        self.ops = context.ops
        self.block_size = context.block_size
        self.hidden_size = cfg.hidden_size
        self.kv_caches: list[torch.Tensor] = []
        self.graphs_on = False  # greedy drafting replays graphs (CUDA, Triton attention)
        self.chain: ChainGraphs | None = None  # drafts 2..K (one-layer checkpoints)
        self.feed_graphs: dict[int, StepGraphs] = {}  # the first step's, by rows per request
        self.ragged: FeedGraphs | None = None  # catch-ups' ragged feeds
        # The target's final states by KV slot, and how far each request is fed.
        self.recorded = Recorded(self.hidden_size, self.dtype, self.device,
                                 max(config.max_num_batched_tokens or 8192, 1024))

    def kv_cache_bytes_per_block(self) -> int:
        return (self.cache_config.kv_bytes_per_block(self.block_size, self.dtype.itemsize)
                + self.recorded.bytes_per_block(self.block_size))

    def initialize(self, num_kv_blocks: int) -> None:
        shape = self.cache_config.kv_cache_shape(self.attn_backend, num_kv_blocks, self.block_size)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.recorded.allocate(num_kv_blocks * self.block_size)
        self.chain, self.feed_graphs, self.ragged = None, {}, None
        self.graphs_on = graphs_wanted(self.config, self.device, self.attn_backend)
        if not self.graphs_on:
            return
        warm_up_eager(self._feed_step, self.device, self.block_size, self.config.max_model_len or 2048)
        c, k = self.config, self.num_speculative_tokens
        max_len = (c.max_model_len or 2048) + k + 1
        hidden = ((self.hidden_size,), self.dtype)
        # A one-layer checkpoint's greedy proposal replays whole (ProposalGraphs).
        one = self.num_layers == 1
        self.feed_graphs = capture_feeds(self._feed_step, c, self.device, max_len, self.block_size, k, [],
                                         step=self._step if one else None, argmax=self._first_argmax if one else None,
                                         source=self.device_step)
        if self.num_layers == 1 and k > 1:
            self.chain = ChainGraphs(self._step, self.device, c.max_num_seqs, max_len, self.block_size, k - 1, hidden,
                                     pool=last_pool(self.feed_graphs))
            self.chain.capture()
        # Last in the pool: no graph captured after it whose outputs its replays could overwrite.
        self.ragged = FeedGraphs(self._feed_step, self.device, c.max_num_seqs, self.recorded.max_rows, max_len,
                                 self.block_size, pool=self.chain.pool if self.chain else last_pool(self.feed_graphs))
        self.ragged.capture()

    def record(self, hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor],
               slot_mapping: torch.Tensor) -> None:
        self.recorded.write(hidden_states, slot_mapping)

    def skip(self) -> None:
        self.recorded.skip()

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        self.recorded.forget(req_ids)

    def launch(self, step: LaunchInputs) -> torch.Tensor | None:
        """A one-layer checkpoint's whole greedy proposal, fed from the device (as EAGLE's), when
        the cache holds every position before the step's rows."""
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

    def _context(self, meta: AttentionMetadata) -> ForwardContext:
        return ForwardContext(self.attn_backend, meta, self.kv_caches, self.ops)

    def _feed_step(self, meta: AttentionMetadata, token_ids: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor]:
        """Every layer over ``q`` target rows per request, their states read from the record at
        their slots; layer 0's outputs."""
        embeds = self.embed_tokens(token_ids).to(self.dtype)
        hidden = self.recorded.read(meta.slot_mapping)
        outs = [self.model(embeds, positions, hidden, self._context(meta), layer) for layer in range(self.num_layers)]
        return (outs[0],)

    def _step(self, meta: AttentionMetadata, token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step of a one-layer checkpoint: the layer's output and the greedy next draft."""
        out = self.model(self.embed_tokens(token_ids).to(self.dtype), positions, hidden, self._context(meta), 0)
        return out, self._argmax(out, 0)

    def _first_argmax(self, out: torch.Tensor) -> torch.Tensor:
        return self._argmax(out, 0)

    def _argmax(self, out: torch.Tensor, layer: int) -> torch.Tensor:
        return self.head.argmax(self.model.logits_input(out, self.ops, layer), self.ops)

    def propose(self, inputs: ProposerInputs) -> DraftProposal:
        limits = np.where(inputs.num_sampled > 0, draft_limits(self.config, inputs, self.num_speculative_tokens), 0)
        drafts: list[list[int]] = [[] for _ in inputs.req_ids]
        probs: list[list[torch.Tensor]] = [[] for _ in inputs.req_ids]
        first = inputs.positions[inputs.query_start_loc[:-1]]
        newest = np.array([len(t) - 1 for t in inputs.token_ids], dtype=np.int64)
        with torch.inference_mode():
            # The step's rows when the cache holds everything before them (one graph when
            # uniform), else every position it lacks.
            feed = uniform_feed(self.feed_graphs, inputs.num_sampled, inputs.query_start_loc)
            if feed is not None and not self.recorded.fill_gaps(inputs, first.tolist(), self._catch_up):
                feed = None
            live = [i for i in range(inputs.num_reqs) if limits[i] > 0]
            if isinstance(feed, ProposalGraphs) and live and plain_greedy(inputs, live):
                rows = self._feed_graph(inputs, feed)[1][:inputs.num_reqs].tolist()  # the whole proposal
                self.recorded.fed_to(inputs.req_ids, newest)
                take_drafts([rows[i] for i in live], live, limits, drafts)
                return DraftProposal(drafts, [None] * inputs.num_reqs)
            if feed is None:
                start = np.array([self.recorded.valid(rid, int(f)) for rid, f in zip(inputs.req_ids, first)])
                out, last_rows = self._catch_up(inputs, start, newest, np.arange(inputs.num_reqs)), \
                    np.arange(inputs.num_reqs)
            else:
                out, _, last_rows = self._feed_graph(inputs, feed)
            self.recorded.fed_to(inputs.req_ids, newest)
            hidden = out[torch.tensor(last_rows[live], dtype=torch.int64, device=self.device)] if live else out
            if live and greedy_graphed(self.graphs_on, self.chain, limits[live]) and plain_greedy(inputs, live):
                last_pos = np.array([len(t) - 2 for t in inputs.token_ids], dtype=np.int64)
                greedy_drafts(self.chain, live, limits, last_pos, inputs.block_ids, hidden, self._argmax(hidden, 0),
                              drafts)
                return DraftProposal(drafts, [None] * inputs.num_reqs)
            for step in range(int(limits.max(initial=0))):
                if step:  # the layer again, one position on: the previous draft and output
                    keep = [k for k, i in enumerate(live) if limits[i] > step]
                    live = [live[k] for k in keep]
                    hidden = self._run_draft(inputs, live, step, [drafts[i][-1] for i in live],
                                             hidden[torch.tensor(keep, device=self.device)])
                norm_input = self.model.logits_input(hidden, self.ops, step % self.num_layers)
                logits = self.head.logits(norm_input)
                tokens, q = draw(inputs, live, logits, drafts)
                for k, i in enumerate(live):
                    drafts[i].append(tokens[k])
                    if q is not None and not inputs.sampling_params[i].greedy:
                        probs[i].append(q[k])
        # Greedy drafts are deterministic: the rejection sampler treats them as one-hot.
        return DraftProposal(drafts, [torch.stack(p) if p else None for p in probs])

    def _catch_up(self, inputs: ProposerInputs | LaunchInputs, start: np.ndarray, end: np.ndarray,
                  reqs: np.ndarray) -> torch.Tensor:
        """Every MTP layer over request ``reqs[k]``'s positions ``start[k] .. end[k] - 1`` (at least
        the last), the target's states from the record, a group of at most ``max_rows`` rows a
        forward. Returns layer 0's output at each one's last position ``[len(reqs), H]``."""
        last = torch.empty(len(start), self.hidden_size, dtype=self.dtype, device=self.device)
        for pieces in self.recorded.pieces(start, end):
            if self.ragged is not None and self.ragged.feed_into(last, pieces, end, reqs, inputs):
                continue
            group = [(int(reqs[k]), s, e) for k, s, e in pieces]
            positions = [np.arange(s, e) for _, s, e in group]
            tokens = np.concatenate([inputs.token_ids[i][s + 1:e + 1] for i, s, e in group])
            hidden = self.recorded.read_positions(inputs.block_ids, group, self.block_size)
            members = [i for i, _, _ in group]  # (not ``reqs``: the next group reads that)
            outs = [self._forward(inputs, members, positions, tokens, hidden, layer)
                    for layer in range(self.num_layers)]
            ends = [j for j, (k, _, e) in enumerate(pieces) if e == end[k]]
            rows = np.cumsum([len(p) for p in positions]) - 1
            last[torch.as_tensor([pieces[j][0] for j in ends], dtype=torch.int64, device=self.device)] = \
                outs[0][torch.as_tensor(rows[ends], dtype=torch.int64, device=self.device)]
        return last

    def _feed_graph(self, inputs: ProposerInputs, feed: StepGraphs
                    ) -> tuple[torch.Tensor, torch.Tensor | None, np.ndarray]:
        """The step's rows replayed from a graph, all ``q`` rows of every request (and,
        from :class:`ProposalGraphs`, the greedy drafts). Returns layer 0's outputs, the greedy
        drafts (or None) and each request's row of its newest verified position."""
        n, q = inputs.num_reqs, feed.q
        first = inputs.positions[inputs.query_start_loc[:-1]]
        ids = torch.from_numpy(feed_token_ids(inputs.token_ids, first, q)).to(self.device)
        accepted = q - inputs.num_rejected
        if isinstance(feed, ProposalGraphs):
            out, greedy = feed.propose(ids, first, inputs.block_ids[:n], accepted)
        else:
            (out,), greedy = feed.run(ids, first, inputs.block_ids[:n]), None
        return out, greedy, np.arange(n) * q + accepted - 1

    def _run_draft(self, inputs: ProposerInputs, live: list[int], step: int, tokens: list[int],
                   hidden: torch.Tensor) -> torch.Tensor:
        """Draft step ``step`` >= 1 of each live request: position ``L - 2 + step``, whose next
        token is the previous draft, continuing from the previous step's output."""
        positions = [np.array([len(inputs.token_ids[i]) - 2 + step]) for i in live]
        return self._forward(inputs, live, positions, np.array(tokens, dtype=np.int64), hidden,
                             step % self.num_layers)

    def _forward(self, inputs: ProposerInputs, reqs: Sequence[int], positions: list[np.ndarray], tokens: np.ndarray,
                 hidden: torch.Tensor, layer: int) -> torch.Tensor:
        """MTP layer ``layer`` at ``positions[k]`` of request ``reqs[k]`` (consecutive, writing its
        cache there), reading ``tokens`` (one per position, packed) and ``hidden`` (likewise)."""
        bs, dev = self.block_size, self.device
        slots, seq_lens, qsl = [], [], [0]
        for i, p in zip(reqs, positions):
            blocks = np.asarray(inputs.block_ids[i], dtype=np.int64)
            if p[-1] >= len(blocks) * bs:
                raise RuntimeError(f"MTP position {int(p[-1])} of request {inputs.req_ids[i]!r} is past its "
                                   f"{len(blocks)} KV blocks")
            slots.append(blocks[p // bs] * bs + p % bs)
            seq_lens.append(int(p[-1]) + 1)
            qsl.append(qsl[-1] + len(p))
        meta = AttentionMetadata.build(qsl, seq_lens, np.concatenate(slots).tolist(),
                                       [inputs.block_ids[i] for i in reqs], dev)
        embeds = self.embed_tokens(torch.as_tensor(tokens).to(dev)).to(self.dtype)
        return self.model(embeds, torch.from_numpy(np.concatenate(positions)).to(dev), hidden,
                          ForwardContext(self.attn_backend, meta, self.kv_caches, self.ops), layer)

"""Medusa proposer: K heads over the target's last hidden state draft K tokens in one shot.

``speculative_config={"method": "medusa", "model": HEADS_DIR, "num_speculative_tokens": K}``; K
beyond the checkpoint's head count drafts one token per head. Head ``k`` reads the final hidden
state the newest token was sampled from and guesses the token ``k + 1`` places after it; each
draft is the head's top-1 token after the request's logit processing (bias, min_tokens, penalties,
the drafts before it counting as output), so the drafts are deterministic and the rejection
sampler treats them as one-hot: sampled output still follows the target exactly.

After a greedy verification on the GPU runner the heads run from the device
(:meth:`MedusaProposer.launch`): the step's final states go to a static buffer and one graph per
verification shape reads each request's state at its accepted row, runs the heads and writes the
argmax drafts into the token rows, before the host has read the verification.

Checkpoint layouts (``docs/speculative.md``):

* vLLM's (``MedusaModel``): ``config.json`` with ``hidden_size``, ``vocab_size``, ``num_heads``,
  ``num_hidden_layers`` (residual blocks per head), ``medusa_fc_bias``, ``truncated_vocab_size``
  and ``original_lm_head``; tensors ``blocks.{h}.layers.{l}.weight`` (+ ``.bias``) for the blocks
  ``x + SiLU(W x + b)``, ``lm_heads.{h}.weight`` (only ``lm_heads.0`` with ``original_lm_head``,
  shared by every head) and, for a truncated vocabulary, ``token_map`` (head column -> token id).
  A ``medusa_heads.`` prefix is dropped.
* the Medusa repository's ``medusa_lm_head.safetensors``: ``{h}.{l}.linear.weight/bias`` and
  ``{h}.{num_layers}.weight`` with ``medusa_num_heads`` / ``medusa_num_layers`` in the config.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from specloop.kernel.config import EngineConfig
from specloop.models.config import ModelLoadError

from .base import DraftProposal, LaunchInputs, Proposer, ProposerContext, ProposerInputs, draft_limits
from .draw import plain_greedy, processed_logits
from .heads import fill, read_checkpoint
from .step_graphs import LaunchGraphs, capture_launches

_ORIGINAL_BLOCK = re.compile(r"^(\d+)\.(\d+)\.linear\.(weight|bias)$")
_ORIGINAL_HEAD = re.compile(r"^(\d+)\.(\d+)\.weight$")


class MedusaHeads(nn.Module):
    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int, bias: bool, head_vocab: int,
                 shared_head: bool) -> None:
        super().__init__()
        self.vocab = vocab
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"layers": nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(num_layers))})
            for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden, head_vocab, bias=False)
                                      for _ in range(1 if shared_head else num_heads))
        self.register_buffer("token_map", torch.arange(head_vocab, dtype=torch.int64))

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_heads, rows, vocab] (-inf outside a truncated vocabulary)."""
        out = hidden.new_full((self.num_heads, hidden.shape[0], self.vocab), float("-inf"), dtype=torch.float32)
        for k, block in enumerate(self.blocks):
            x = hidden
            for layer in block["layers"]:
                x = x + nn.functional.silu(layer(x))
            out[k][:, self.token_map] = self.lm_heads[min(k, len(self.lm_heads) - 1)](x).float()
        return out


def _vllm_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("medusa_heads.")
        if m := _ORIGINAL_BLOCK.match(name):
            name = f"blocks.{m[1]}.layers.{m[2]}.{m[3]}"
        elif m := _ORIGINAL_HEAD.match(name):
            name = f"lm_heads.{m[1]}.weight"
        out[name] = tensor
    return out


def load_medusa(path: str, target_hidden: int, target_vocab: int, device: torch.device, dtype: torch.dtype
                ) -> MedusaHeads:
    hf, tensors = read_checkpoint(path, device)
    tensors = _vllm_names(tensors)
    try:
        hidden, vocab = int(hf["hidden_size"]), int(hf["vocab_size"])
    except KeyError as e:
        raise ModelLoadError(f"{path}/config.json lacks required field {e.args[0]!r}") from None
    num_heads = int(hf.get("num_heads") or hf.get("medusa_num_heads") or 5)
    num_layers = int(hf.get("num_hidden_layers") or hf.get("medusa_num_layers") or 1)
    original = "medusa_num_heads" in hf
    bias = bool(hf.get("medusa_fc_bias", original))
    head_vocab = int(hf.get("truncated_vocab_size") or vocab)
    if hidden != target_hidden or vocab != target_vocab:
        raise ModelLoadError(f"{path}: Medusa heads of hidden size {hidden} and vocabulary {vocab} do not fit the "
                             f"target's ({target_hidden}, {target_vocab})")
    heads = MedusaHeads(hidden, vocab, num_heads, num_layers, bias, head_vocab, bool(hf.get("original_lm_head")))
    heads.requires_grad_(False)
    views = dict(heads.named_parameters())
    if head_vocab != vocab:
        views["token_map"] = heads.token_map
        # vLLM also takes full-vocabulary heads and keeps the token map's rows.
        token_map = tensors.get("token_map")
        if token_map is not None:
            for name, tensor in list(tensors.items()):
                if name.startswith("lm_heads.") and tensor.shape[0] == vocab:
                    tensors[name] = tensor[token_map.long()]
    fill(views, tensors, "Medusa", path)
    if int(heads.token_map.min()) < 0 or int(heads.token_map.max()) >= vocab:
        raise ModelLoadError(f"{path}: token_map holds ids outside the vocabulary")
    return heads.to(device=device, dtype=dtype).eval()


class MedusaProposer(Proposer):
    config_fields = frozenset({"model"})
    needs_hidden_states = True
    # Stateless: a proposal reads only the newest token's hidden state, so the runner may skip the
    # call in steps that draft nothing (and those steps overlap the next).
    catches_up = True
    launches = True  # when it has a head for every draft

    def __init__(self, config: EngineConfig, context: ProposerContext) -> None:
        super().__init__(config, context)
        spec = config.speculative_config
        if not spec.model:
            raise ValueError("speculative_config.method='medusa' needs 'model' (a local checkpoint path)")
        self.device = context.device
        self.heads = load_medusa(spec.model, context.model_config.hidden_size, context.vocab_size, context.device,
                                 context.dtype)
        self.launch_graphs: dict[int, LaunchGraphs] = {}  # by rows per request
        # The launched step's final states, where the graphs read them.
        self.states = torch.empty(0, context.model_config.hidden_size, dtype=context.dtype, device=self.device)

    def initialize(self, num_kv_blocks: int) -> None:
        c, k = self.config, self.num_speculative_tokens
        if self.device_step is None or k > self.heads.num_heads:
            return
        rows = max(c.max_num_batched_tokens or 0, c.max_num_seqs * (k + 1))
        self.states = self.states.new_zeros(rows, self.states.shape[1])
        self.launch_graphs = capture_launches(self._drafts, c, self.device_step, self.device, k, "Medusa heads")

    def _drafts(self, accepted: torch.Tensor, q: int, states: torch.Tensor | None = None) -> torch.Tensor:
        """Each request's greedy drafts ``[n, K]`` from its final state at its newest accepted row
        (of ``q``) in ``states`` (default: :attr:`states`)."""
        rows = torch.arange(0, len(accepted) * q, q, device=accepted.device) + accepted - 1
        states = self.states if states is None else states
        logits = self.heads(states.index_select(0, rows))[:self.num_speculative_tokens]
        return logits.argmax(dim=-1).t().contiguous()

    def launch(self, step: LaunchInputs) -> torch.Tensor | None:
        """The heads over the verification's states at each request's accepted row, in one graph
        replay when one was captured for the step's shape (else eagerly): every request's ``K``
        greedy drafts, as :meth:`propose` drafts for a plain greedy request."""
        if step.device is None or step.device is not self.device_step or self.num_speculative_tokens > self.heads.num_heads:
            return None
        with torch.inference_mode():
            graphs = self.launch_graphs.get(step.q)
            if graphs is not None and len(step.hidden_states) <= len(self.states):
                self.states[:len(step.hidden_states)].copy_(step.hidden_states)
                drafts = graphs.replay(step)
                if drafts is not None:
                    return drafts
            return self._drafts(step.accept(), step.q, step.hidden_states)

    def propose(self, inputs: ProposerInputs) -> DraftProposal:
        k = min(self.num_speculative_tokens, self.heads.num_heads)
        limits = draft_limits(self.config, inputs, k)
        drafts: list[list[int]] = [[] for _ in inputs.req_ids]
        live = [i for i in range(inputs.num_reqs) if limits[i] > 0]
        if live:
            rows = torch.as_tensor(inputs.sampled_rows[live], device=self.device)
            with torch.inference_mode():
                logits = self.heads(inputs.hidden_states[rows])
            greedy = plain_greedy(inputs, live)
            for step in range(int(limits.max())):
                keep = [k for k, i in enumerate(live) if limits[i] > step]
                reqs = [live[k] for k in keep]
                rows = logits[step][torch.as_tensor(keep, device=self.device)]
                if not greedy:
                    rows, _ = processed_logits(inputs, reqs, rows, drafts)
                for i, token in zip(reqs, rows.argmax(dim=-1).tolist()):
                    drafts[i].append(token)
        return DraftProposal(drafts, None)


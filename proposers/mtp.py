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

The drafting is ``proposers.recording``'s, shared with EAGLE: on CUDA with the Triton attention
backend step 1 replays a graph when every request computed the same number of target rows, and a
one-layer checkpoint's plain greedy proposal replays whole (launched from the device after a
verification), or its steps 2..K as one graph after an eager step 1.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from specloop.kernel.config import EngineConfig
from specloop.models.config import read_model_config
from specloop.models.context import ForwardContext
from specloop.models.deepseek_mtp import DeepSeekMTP
from specloop.models.loader import build_empty, iter_safetensors, resolve_dtype, safetensors_files

from .base import ProposerContext
from .draft_vocab import DraftHead
from .recording import RecordingProposer

# Target architectures whose checkpoints carry MTP layers, and the module that runs them.
MTP_MODULES = {"DeepseekV3ForCausalLM": DeepSeekMTP, "DeepseekV2ForCausalLM": DeepSeekMTP}


class MTPProposer(RecordingProposer):
    config_fields = frozenset({"model", "draft_dtype", "token_map"})

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
        # A one-layer checkpoint's steps are all the same function: its greedy proposals replay whole.
        self.chains = self.num_layers == 1
        self.head = DraftHead(context, spec.token_map)  # the target's head, or a token map's rows of it
        # The caches: one a layer; recorded: the target's final states.
        self._setup(context, cfg.hidden_size, dataclasses.replace(cfg, num_layers=cfg.num_mtp_layers))

    def _feed(self, embeds: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
              rows: torch.Tensor | None = None) -> torch.Tensor:
        """Every layer over the target's states (each layer's cache holds every verified position);
        layer 0's outputs at ``rows``, which give draft 1. The other rows stop after attention, in
        every layer: their experts are never read for them."""
        outs = [self.model(embeds, positions, states, ctx, layer, rows=rows) for layer in range(self.num_layers)]
        return outs[0]

    def _draft(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
               step: int) -> torch.Tensor:
        return self.model(embeds, positions, hidden, ctx, step % self.num_layers)

    def _argmax(self, out: torch.Tensor, step: int) -> torch.Tensor:
        return self.head.argmax(self.model.logits_input(out, self.ops, step % self.num_layers), self.ops)

    def _logits(self, out: torch.Tensor, step: int) -> torch.Tensor:
        return self.head.logits(self.model.logits_input(out, self.ops, step % self.num_layers))

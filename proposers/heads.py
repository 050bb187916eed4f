"""EAGLE-1 and EAGLE-3 draft heads: their modules, built from specloop's Llama decoder layer, and the
public checkpoint layouts they load.

Both read the target's hidden states and share its token embedding; a head's decoder layers keep
their own paged KV cache (``proposers.eagle``). Layouts (``docs/speculative.md``):

* EAGLE-1 (the EAGLE repository's checkpoints; vLLM's ``EagleLlamaForCausalLM``): ``fc`` [H, 2H]
  (``fc.bias`` optional) over [embedding ; the target's final hidden state], ``layers.{i}.*`` Llama
  decoder layers of which layer 0 has no ``input_layernorm``, no final norm; logits through the
  target's head. HASS checkpoints add ``embedding_layernorm`` and ``hidden_states_layernorm``
  (``add_para_norm``). ``embed_tokens.weight`` / ``lm_head.weight`` copies of the target's are
  accepted and unused.
* EAGLE-3 (the EAGLE repository, SpecForge, vLLM's ``LlamaForCausalLMEagle3``): ``fc`` [H, n * H_t]
  over the target's residual streams entering the ``eagle_aux_hidden_state_layer_ids`` (in
  ``eagle_config`` or at the top level; default low/middle/high = 2, L // 2, L - 3), ``midlayer.*``
  (``layers.0.*`` in vLLM's spelling) whose attention reads [input_layernorm(embedding) ;
  hidden_norm(hidden)] (2H) and whose residual is the hidden state (``hidden_norm``-ed with
  ``norm_before_residual``), ``norm``, ``lm_head`` [draft_vocab_size, H] and ``d2t`` (draft id ->
  target id - draft id; ``t2d`` accepted and unused). The output before ``norm`` feeds the next step.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from specloop.models.config import ModelConfig, ModelLoadError, parse_hf_config
from specloop.models.layers import RMSNorm, RotaryEmbedding
from specloop.models.llama import DEFAULT_MAX_POSITIONS, DecoderLayer
from specloop.models.loader import iter_safetensors, safetensors_files

if TYPE_CHECKING:
    from specloop.models.context import ForwardContext

    from .base import ProposerContext


def read_checkpoint(path: str, device: torch.device) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``config.json`` and every tensor of a head directory (a ``model.`` prefix dropped)."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"head directory {path!r} has no config.json")
    with open(config_path, encoding="utf-8") as f:
        try:
            hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{config_path} is not valid JSON: {e}") from None
    tensors = {name.removeprefix("model."): t for name, t in iter_safetensors(safetensors_files(path), device)}
    return hf, tensors


def checkpoint_views(module: nn.Module, rename: Callable[[str], str] = lambda n: n) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the part of ``module``'s parameter it fills: specloop's fused ``qkv_proj``
    and ``gate_up_proj`` are stored as ``q/k/v_proj`` and ``gate/up_proj``."""
    views: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        owner = module.get_submodule(name.rsplit(".", 2)[0]) if name.count(".") >= 2 else module
        if ".qkv_proj." in name:
            parts = zip(("q_proj", "k_proj", "v_proj"), param.split([owner.q_size, owner.kv_size, owner.kv_size]))
        elif ".gate_up_proj." in name:
            parts = zip(("gate_proj", "up_proj"), param.chunk(2))
        else:
            views[rename(name)] = param
            continue
        fused = "qkv_proj" if ".qkv_proj." in name else "gate_up_proj"
        for part, view in parts:
            views[rename(name.replace(fused, part))] = view
    return views


def fill(views: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], what: str, path: str,
         ignored: dict[str, tuple[int, ...]] | None = None) -> None:
    """Copy ``tensors`` into ``views``; a missing, unexpected or mis-shaped tensor is a
    :class:`ModelLoadError` naming it. ``ignored`` tensors may be present (with that shape)."""
    ignored = ignored or {}
    missing = sorted(set(views) - set(tensors))
    if missing:
        raise ModelLoadError(f"{path}: the {what} checkpoint lacks {len(missing)} tensor(s): {', '.join(missing[:6])}")
    unexpected = sorted(set(tensors) - set(views) - set(ignored))
    if unexpected:
        raise ModelLoadError(f"{path}: unexpected tensor(s) in the {what} checkpoint: {', '.join(unexpected[:6])}")
    for name, tensor in tensors.items():
        dest = views.get(name)
        shape = tuple(dest.shape) if dest is not None else ignored[name]
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        if dest is not None:
            with torch.no_grad():
                dest.copy_(tensor)


def layer_flags(hf: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, bool]:
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bool(hf.get("qkv_bias", bias)), "o_bias": bias,
            "qk_norm": any(n.endswith("self_attn.q_norm.weight") for n in tensors),
            "mlp_bias": bool(hf.get("mlp_bias", False))}


class EagleHead(nn.Module):
    """EAGLE-1: ``fc([embedding ; hidden])``, then the decoder layers (layer 0 without its input
    norm). The output, also the next step's hidden state, goes through the target's head."""

    def __init__(self, cfg: ModelConfig, flags: dict[str, bool], rotary: RotaryEmbedding, fc_bias: bool,
                 para_norm: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.rotary = rotary
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, rotary, **flags) for i in range(cfg.num_layers))
        self.layers[0].input_layernorm = None
        self.embedding_layernorm = RMSNorm(h, cfg.rms_norm_eps) if para_norm else None
        self.hidden_states_layernorm = RMSNorm(h, cfg.rms_norm_eps) if para_norm else None

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        ops = ctx.ops
        if self.embedding_layernorm is not None:
            embeds = ops.rms_norm(embeds, self.embedding_layernorm.weight, self.embedding_layernorm.eps)
            hidden = ops.rms_norm(hidden, self.hidden_states_layernorm.weight, self.hidden_states_layernorm.eps)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        first = self.layers[0]
        norm = first.post_attention_layernorm
        h, residual = ops.add_rms_norm(first.self_attn(x, positions, ctx), x, norm.weight, norm.eps)
        x = first.mlp(h, ops)
        for layer in self.layers[1:]:
            x, residual = layer(x, residual, positions, ctx)
        return x + residual


class Eagle3Head(nn.Module):
    """EAGLE-3: one decoder layer over [normed embedding ; normed hidden], its own final norm and
    head over a draft vocabulary mapped into the target's by ``d2t``."""

    def __init__(self, cfg: ModelConfig, flags: dict[str, bool], rotary: RotaryEmbedding, fc_in: int | None,
                 draft_vocab: int, norm_before_residual: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.rotary = rotary
        self.vocab_size = cfg.vocab_size
        self.norm_before_residual = norm_before_residual
        self.fc = nn.Linear(fc_in, h, bias=False) if fc_in else None
        self.midlayer = DecoderLayer(cfg, 0, rotary, **flags)
        attn = self.midlayer.self_attn
        attn.qkv_proj = nn.Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=flags["qkv_bias"])
        self.midlayer.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        ops, layer = ctx.ops, self.midlayer
        e = ops.rms_norm(embeds, layer.input_layernorm.weight, layer.input_layernorm.eps)
        h = ops.rms_norm(hidden, layer.hidden_norm.weight, layer.hidden_norm.eps)
        residual = h if self.norm_before_residual else hidden
        norm = layer.post_attention_layernorm
        x, residual = ops.add_rms_norm(layer.self_attn(torch.cat([e, h], dim=-1), positions, ctx), residual,
                                       norm.weight, norm.eps)
        return layer.mlp(x, ops) + residual

    def draft_logits(self, prenorm: torch.Tensor, ops: Any) -> torch.Tensor:
        return self.lm_head(ops.rms_norm(prenorm, self.norm.weight, self.norm.eps)).float()

    def logits(self, prenorm: torch.Tensor, ops: Any) -> torch.Tensor:
        """float32 logits over the target's vocabulary (-inf outside the draft vocabulary)."""
        draft = self.draft_logits(prenorm, ops)
        out = draft.new_full((draft.shape[0], self.vocab_size), float("-inf"))
        out[:, torch.arange(draft.shape[1], device=draft.device) + self.d2t] = draft
        return out

    def argmax(self, prenorm: torch.Tensor, ops: Any) -> torch.Tensor:
        """The most likely target token id per row (the scatter into the whole vocabulary skipped)."""
        best = ops.argmax(self.draft_logits(prenorm, ops))
        return best + self.d2t[best]


def aux_layer_ids(hf: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    eagle = hf.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") or hf.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    return tuple(int(i) for i in ids)


def load_head(path: str, version: int, context: ProposerContext, dtype: torch.dtype
              ) -> tuple[EagleHead | Eagle3Head, ModelConfig, tuple[int, ...]]:
    """The EAGLE-``version`` head at ``path`` for the target of ``context``, on its device in
    ``dtype``; returns the module, its config and (EAGLE-3) the target layers it reads, in its
    ``fc``'s order."""
    what = "EAGLE-3" if version == 3 else "EAGLE"
    hf, tensors = read_checkpoint(path, context.device)
    hf = {"architectures": ["EagleHead"], **hf}
    cfg = parse_hf_config(hf)
    target = context.model_config
    if cfg.vocab_size != target.vocab_size:
        raise ModelLoadError(f"{path}: the {what} head's vocabulary ({cfg.vocab_size}) differs from the target's "
                             f"({target.vocab_size})")
    h, th = cfg.hidden_size, target.hidden_size
    if h != th:
        raise ModelLoadError(f"{path}: the {what} head's hidden_size ({h}) differs from the target's ({th})")
    max_positions = max(cfg.max_position_embeddings or 0, target.max_position_embeddings or DEFAULT_MAX_POSITIONS,
                        getattr(context.target, "max_positions", 0) or 0)
    rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
    flags = layer_flags(hf, tensors)
    ignored = {"embed_tokens.weight": (target.vocab_size, th)}
    layers: tuple[int, ...] = ()
    if version == 1:
        head: EagleHead | Eagle3Head = EagleHead(cfg, flags, rotary, "fc.bias" in tensors,
                                                 bool(hf.get("add_para_norm")) or "embedding_layernorm.weight" in tensors)
        ignored["lm_head.weight"] = (target.vocab_size, th)
        views = checkpoint_views(head)
    else:
        if cfg.num_layers != 1:
            raise ModelLoadError(f"{path}: EAGLE-3 heads have one decoder layer, config.json says {cfg.num_layers}")
        use_aux = (hf.get("eagle_config") or {}).get("use_aux_hidden_state", True)
        layers = aux_layer_ids(hf, target.num_layers) if use_aux else ()
        bad = [i for i in layers if not 0 <= i <= target.num_layers]
        if bad:
            raise ModelLoadError(f"{path}: eagle_aux_hidden_state_layer_ids {list(layers)} name layers outside the "
                                 f"target's 0..{target.num_layers}")
        fc_in = len(layers) * th if use_aux else None
        draft_vocab = int(hf.get("draft_vocab_size") or cfg.vocab_size)
        head = Eagle3Head(cfg, flags, rotary, fc_in, draft_vocab, bool(hf.get("norm_before_residual", False)))
        tensors = {("midlayer." + n.removeprefix("layers.0.") if n.startswith("layers.0.") else n): t
                   for n, t in tensors.items()}
        views = checkpoint_views(head)
        if "d2t" in tensors or draft_vocab != cfg.vocab_size:
            views["d2t"] = head.d2t
        ignored["t2d"] = (cfg.vocab_size,)
    head.requires_grad_(False)
    fill(views, tensors, what, path, ignored)
    if version == 3:
        mapped = torch.arange(head.d2t.shape[0], device=head.d2t.device) + head.d2t
        if int(mapped.min()) < 0 or int(mapped.max()) >= cfg.vocab_size:
            raise ModelLoadError(f"{path}: d2t maps draft ids outside the target's vocabulary")
    head.to(device=context.device, dtype=dtype)
    head.rotary.reset_buffers()
    return head.eval(), cfg, layers

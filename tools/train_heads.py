"""Speculative heads for ``specloop-tiny``: EAGLE-1, EAGLE-3 and Medusa, trained against the frozen target.

Imported by ``train_default_models.py``, whose recipes build these modules, train them and write them
in the public checkpoint layouts that ``specloop.proposers`` loads (``docs/speculative.md``):

* EAGLE-1 (``EagleLlamaForCausalLM``): ``fc`` over [token embedding ; the target's final hidden
  state] (2H -> H), one Llama decoder layer without its input norm, the target's embedding and head.
  It learns the target's next final hidden state (smooth L1) and its next-token distribution through
  the target's head (cross-entropy, weight 0.1), from the target's own features with uniform noise:
  the EAGLE paper's recipe.
* EAGLE-3 (``LlamaForCausalLMEagle3``): ``fc`` fuses three of the target's residual streams (3H -> H),
  ``midlayer`` attends over [normed embedding ; normed hidden] (2H), its own ``norm`` and ``lm_head``
  over the ``EAGLE3_VOCAB`` most frequent training tokens (``d2t``, ``t2d``). Training-time test: step j
  feeds the layer its own step j-1 outputs, attends to the target-fed keys of earlier positions and
  to its own keys of steps 1..j at the same position, exactly as drafting does, and learns the
  target's distribution j + 1 tokens ahead (losses weighted 0.8^j).
* Medusa (vLLM's ``MedusaModel`` layout): per head one residual SiLU block over the target's final
  hidden state and the target's head (``original_lm_head``) restricted to a token map; head k learns
  the target's distribution k + 2 tokens ahead (weights 0.8^k).

Every head reads the target in inference form (no dropout, frozen); only the head's parameters train.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HEAD_INTERMEDIATE = 384  # the heads' MLP width (the target's is 896): small to ship, cheap to draft
# EAGLE-3's draft vocabulary and Medusa's token map: 87% of held-out tokens, 92% of the target's picks.
DRAFT_VOCAB = 2048  # Medusa's truncated head
EAGLE3_VOCAB = 4096  # EAGLE-3's draft vocabulary: 96% of the target's greedy picks on held-out windows
EAGLE3_LAYERS = (1, 3, 5)  # low, middle, high: the residual stream entering these target layers
TTT_STEPS = 3  # EAGLE-3 training-time-test depth
MEDUSA_HEADS = 5
EAGLE_NOISE = 0.2  # EAGLE-1: uniform noise of this width on the target's features
DECAY = 0.8  # weight of each further draft position's loss


def load_target(path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return target.requires_grad_(False)


def frequent_tokens(data: Path, n: int) -> torch.Tensor:
    """The ``n`` most frequent token ids of the training split, ascending (EAGLE-3's draft vocabulary)."""
    counts = np.bincount(np.load(data / "train.npy").astype(np.int64), minlength=8192)
    return torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[:n]))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Neox-style rotary embedding of ``x`` [B, heads, L, D] at ``positions`` [L]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device).float() / d)
    freqs = positions.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([freqs.cos()] * 2, -1).to(x.dtype), torch.cat([freqs.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    """Llama attention whose keys can include earlier training-time-test steps' (see :class:`Layer`)."""

    def __init__(self, d_in: int, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.theta = 10000.0
        self.q_proj = nn.Linear(d_in, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        """Step ``len(cache)`` of a training-time test over ``x`` [B, L, d_in]: the query at i sees
        step 0's keys at positions <= i and step s's key at position i for 1 <= s <= this step."""
        b, n, _ = x.shape
        q = rope(self.q_proj(x).view(b, n, self.heads, -1).transpose(1, 2), positions, self.theta)
        k = rope(self.k_proj(x).view(b, n, self.kv_heads, -1).transpose(1, 2), positions, self.theta)
        v = self.v_proj(x).view(b, n, self.kv_heads, -1).transpose(1, 2)
        cache.append((k, v))
        keys = torch.cat([c[0] for c in cache], dim=2).repeat_interleave(self.heads // self.kv_heads, dim=1)
        values = torch.cat([c[1] for c in cache], dim=2).repeat_interleave(self.heads // self.kv_heads, dim=1)
        i = torch.arange(n, device=x.device)
        mask = torch.cat([i[None, :] <= i[:, None]] + [i[None, :] == i[:, None]] * (len(cache) - 1), dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """One draft decoder layer. EAGLE-1 (``emb_norm=False``): attention straight over its input,
    which is also the residual. EAGLE-3: attention over [input_layernorm(embedding) ;
    hidden_norm(hidden)], residual = the raw hidden state."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eagle3: bool,
                 intermediate: int = HEAD_INTERMEDIATE, eps: float = 1e-6, theta: float = 10000.0) -> None:
        super().__init__()
        self.eagle3 = eagle3
        self.self_attn = Attention(2 * hidden if eagle3 else hidden, hidden, heads, kv_heads, head_dim)
        self.self_attn.theta = theta
        if eagle3:
            self.input_layernorm = RMSNorm(hidden, eps)
            self.hidden_norm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cache: list, emb: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1) if self.eagle3 else hidden
        h = hidden + self.self_attn(x, positions, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def shifted(x: torch.Tensor, j: int) -> torch.Tensor:
    """``x`` [B, L, ...] moved ``j`` positions left (the tail repeats the last entry; masked out)."""
    if j == 0:
        return x
    return torch.cat([x[:, j:], x[:, -1:].expand(-1, j, *x.shape[2:])], dim=1)


def soft_ce(logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` against softmax(``target_logits``), averaged over ``mask``."""
    ce = -(target_logits.float().softmax(-1) * logits.float().log_softmax(-1)).sum(-1)
    return (ce * mask).sum() / mask.sum().clamp(min=1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x.float() * mask).sum() / mask.sum().clamp(min=1)


def target_pass(target: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    with torch.no_grad():
        out = target(input_ids=x, output_hidden_states=True)
    return out.logits.float(), out.hidden_states


def valid(b: int, n: int, ahead: int, device: torch.device) -> torch.Tensor:
    """[B, L] 1.0 where the target's logits ``ahead`` positions on exist in the window."""
    return (torch.arange(n, device=device) < n - ahead).float().expand(b, n)


class EagleHead(nn.Module):
    def __init__(self, target_path: Path) -> None:
        super().__init__()
        self.target = load_target(target_path)
        c = self.target.config
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        with torch.no_grad():  # start from "the next feature is this one"
            self.fc.weight.zero_()
            self.fc.weight[:, c.hidden_size:].copy_(torch.eye(c.hidden_size))
        self.layer = Layer(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, eagle3=False)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # Position i: token t[i+1] = y[i] with the target's final state h[i]; predicts h[i+1] and t[i+2].
        logits, states = target_pass(self.target, x)
        h = states[-1]
        if self.training:
            h_in = h + (torch.rand_like(h) - 0.5) * EAGLE_NOISE
        else:
            h_in = h
        emb = self.target.model.embed_tokens(y)
        positions = torch.arange(x.shape[1], device=x.device)
        pred = self.layer(self.fc(torch.cat([emb, h_in], dim=-1)), positions, [])
        mask = valid(*x.shape, 1, x.device)
        vloss = masked_mean(F.smooth_l1_loss(pred.float(), shifted(h, 1).float(), reduction="none").mean(-1), mask)
        out_logits = self.target.lm_head(pred)
        target_next = shifted(logits, 1)
        ploss = soft_ce(out_logits, target_next, mask)
        acc = masked_mean(out_logits.argmax(-1) == target_next.argmax(-1), mask)
        return vloss + 0.1 * ploss, {"loss": (vloss + 0.1 * ploss).detach(), "vloss": vloss.detach(),
                                     "ploss": ploss.detach(), "acc": acc}

    def state_dict_out(self) -> dict[str, torch.Tensor]:
        return {"fc.weight": self.fc.weight, **layer_state(self.layer, "layers.0.")}

    def config(self) -> dict:
        return head_config(self.target.config, ["EagleLlamaForCausalLM"], bias=False)


class Eagle3Head(nn.Module):
    def __init__(self, target_path: Path, data: Path) -> None:
        super().__init__()
        self.target = load_target(target_path)
        c = self.target.config
        self.fc = nn.Linear(len(EAGLE3_LAYERS) * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = Layer(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, eagle3=True)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        vocab = frequent_tokens(data, EAGLE3_VOCAB)
        self.lm_head = nn.Linear(c.hidden_size, EAGLE3_VOCAB, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(self.target.lm_head.weight[vocab])
        self.register_buffer("d2t", vocab - torch.arange(EAGLE3_VOCAB))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, vocab, True))
        self.register_buffer("vocab", vocab, persistent=False)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits, states = target_pass(self.target, x)
        hidden = self.fc(torch.cat([states[i] for i in EAGLE3_LAYERS], dim=-1))
        b, n = x.shape
        positions = torch.arange(n, device=x.device)
        cache: list = []
        total = torch.zeros((), device=x.device)
        metrics: dict[str, torch.Tensor] = {}
        for j in range(TTT_STEPS):
            # Step j at position i: token t[i+1+j], the previous step's output; predicts t[i+2+j].
            emb = self.target.model.embed_tokens(shifted(y, j))
            hidden = self.midlayer(hidden, positions + j, cache, emb)
            draft_logits = self.lm_head(self.norm(hidden))
            target_logits = shifted(logits, j + 1)
            best = target_logits.argmax(-1)
            mask = valid(b, n, j + 1, x.device)
            loss = soft_ce(draft_logits, target_logits[..., self.vocab], mask * self.t2d[best])
            total = total + DECAY ** j * loss
            metrics[f"acc{j}"] = masked_mean(self.vocab[draft_logits.argmax(-1)] == best, mask)
        return total, {"loss": total.detach(), **metrics}

    def state_dict_out(self) -> dict[str, torch.Tensor]:
        return {"fc.weight": self.fc.weight, "norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight,
                "d2t": self.d2t, "t2d": self.t2d, **layer_state(self.midlayer, "midlayer.")}

    def config(self) -> dict:
        c = self.target.config
        return head_config(c, ["LlamaForCausalLMEagle3"], draft_vocab_size=EAGLE3_VOCAB,
                           target_hidden_size=c.hidden_size, norm_before_residual=False,
                           eagle_config={"eagle_aux_hidden_state_layer_ids": list(EAGLE3_LAYERS),
                                         "use_aux_hidden_state": True})


class ResidualBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden)])
        with torch.no_grad():  # Medusa starts each head as the identity (the target's own next token)
            self.layers[0].weight.zero_()
            self.layers[0].bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, target_path: Path, data: Path) -> None:
        super().__init__()
        self.target = load_target(target_path)
        c = self.target.config
        self.blocks = nn.ModuleList(ResidualBlock(c.hidden_size) for _ in range(MEDUSA_HEADS))
        self.register_buffer("token_map", frequent_tokens(data, DRAFT_VOCAB))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logits, states = target_pass(self.target, x)
        h = states[-1]
        b, n = x.shape
        in_map = torch.zeros(logits.shape[-1], device=x.device).index_fill_(0, self.token_map, 1.0)
        head = self.target.lm_head.weight[self.token_map]
        total = torch.zeros((), device=x.device)
        metrics: dict[str, torch.Tensor] = {}
        for k, block in enumerate(self.blocks):
            # Head k at position i predicts t[i+k+2]: the target's logits at position i+k+1.
            head_logits = F.linear(block(h), head)
            target_logits = shifted(logits, k + 1)
            best = target_logits.argmax(-1)
            mask = valid(b, n, k + 1, x.device)
            loss = soft_ce(head_logits, target_logits[..., self.token_map], mask * in_map[best])
            total = total + DECAY ** k * loss
            metrics[f"acc{k}"] = masked_mean(self.token_map[head_logits.argmax(-1)] == best, mask)
        return total, {"loss": total.detach(), **metrics}

    def state_dict_out(self) -> dict[str, torch.Tensor]:
        sd = {f"blocks.{k}.layers.0.{p}": getattr(b.layers[0], p) for k, b in enumerate(self.blocks)
              for p in ("weight", "bias")}
        sd["lm_heads.0.weight"] = self.target.lm_head.weight[self.token_map]
        sd["token_map"] = self.token_map
        return sd

    def config(self) -> dict:
        c = self.target.config
        return {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": c.hidden_size,
                "vocab_size": c.vocab_size, "num_heads": MEDUSA_HEADS, "num_hidden_layers": 1,
                "truncated_vocab_size": DRAFT_VOCAB, "original_lm_head": True, "medusa_fc_bias": True}


def layer_state(layer: Layer, prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in layer.state_dict().items()}


def head_config(c, architectures: list[str], **extra) -> dict:
    """A Llama-style ``config.json`` for a one-layer head of the target ``c``."""
    return {"architectures": architectures, "model_type": "llama", "hidden_size": c.hidden_size,
            "intermediate_size": HEAD_INTERMEDIATE, "num_hidden_layers": 1,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": 10000.0, "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size, "tie_word_embeddings": False, "torch_dtype": "bfloat16", **extra}


def head_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def check_head_reload(module: nn.Module, out: Path) -> dict[str, float]:
    """Largest difference between the shipped tensors and the trained module's, rounded to bf16."""
    from safetensors.torch import load_file

    saved = load_file(out / "model.safetensors")
    expected = module.state_dict_out()
    if set(saved) != set(expected):
        raise RuntimeError(f"{out}: tensors {sorted(set(saved) ^ set(expected))} differ from the module's")
    diff = max(float((saved[k].float() - v.detach().to(saved[k].dtype).float().cpu()).abs().max())
               for k, v in expected.items())
    return {"tensors": diff if math.isfinite(diff) else float("inf")}

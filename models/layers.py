"""Building blocks shared by the decoder architectures: RMSNorm, rotary embedding, gated MLP. They
hold weights and tables; the math runs in the ops of the forward context (:mod:`.ops`)."""

from __future__ import annotations

import math

from typing import Protocol

import torch
from torch import nn

from .config import RopeConfig
from .parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TensorParallel, even_shard


class _SiluAndMul(Protocol):
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference RMSNorm over the last dim: float32 statistics, the normalised value rounded back
    to ``x``'s dtype before the weight multiplies it, as Hugging Face's layers do (so half-precision
    results match theirs bit for bit in the common case)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with the configured scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Llama 3.1: long wavelengths (low frequencies) are divided by `factor`, short ones are
        # kept, and the band between interpolates linearly in 1/wavelength.
        old_len = float(rope.original_max_position_embeddings or 8192)
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: high frequencies (many rotations over the original context) are kept, low ones are
    divided by ``factor``, with a linear ramp between the dims that rotate ``beta_fast`` and
    ``beta_slow`` times over ``original_max_position_embeddings``."""
    old_len = float(rope.original_max_position_embeddings or 4096)

    def dim_of(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return 1.0 / (rope.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (the first and second halves of each head rotate together), with
    float32 ``cos``/``sin`` tables ``[max_positions, head_dim // 2]`` computed once (the same float32
    products as computing them per call; YaRN's magnitude correction included). One per model,
    shared by its attention layers."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2, dtype=torch.float32), persistent=False)
        if self.cos.device.type != "meta":
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """Compute the tables (not part of any checkpoint) in float32, also after the loader
        materialised the module from the meta device."""
        device = self.cos.device
        inv_freq = rope_inv_freq(self.rope, self.head_dim).to(device)
        freqs = torch.arange(self.max_positions, device=device).float()[:, None] * inv_freq.float()[None, :]
        scale = self.rope.cos_sin_scale
        self.cos = (freqs.cos() * scale).contiguous()
        self.sin = (freqs.sin() * scale).contiguous()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [T]; ``q`` [T, Hq, D]; ``k`` [T, Hkv, D]."""
        cos = torch.cat((self.cos[positions],) * 2, dim=-1).to(q.dtype)[:, None, :]
        sin = torch.cat((self.sin[positions],) * 2, dim=-1).to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward with the gate and up projections fused into one matmul; under tensor
    parallelism each rank holds its slice of gate and of up, and ``down_proj`` sums the slices."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        shard = even_shard(intermediate_size, tp)
        self.intermediate_size = shard.size
        self.gate_up_proj = ColumnParallelLinear(hidden_size, (shard, shard), bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)

    def forward(self, x: torch.Tensor, ops: _SiluAndMul) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


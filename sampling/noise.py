"""Counter-based randomness shared by every sampler: a hash of (request seed, token position,
index), so a row's random draw depends only on its own request and position, never on the batch
around it, how its prefill was chunked, or whether it was sampled while verifying drafts.

The Triton kernels (``specloop.kernels.sampling``, ``specloop.kernels.rejection_sample``) compute
the same hash bit for bit; these torch versions are their references and the CPU implementation.
"""

from __future__ import annotations

import torch


def _u32(c: int) -> int:
    # A uint32 constant as the int32 with the same bits (int32 products wrap like uint32 ones).
    return c - (1 << 32) if c >= 1 << 31 else c


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    # Logical right shift of int32 lanes (torch's >> is arithmetic).
    return (x >> n) & ((1 << (32 - n)) - 1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # Wellons' "lowbias32" finaliser on uint32 bit patterns held in int32.
    x = x ^ _shr(x, 16)
    x = x * _u32(0x7FEB352D)
    x = x ^ _shr(x, 15)
    x = x * _u32(0x846CA68B)
    return x ^ _shr(x, 16)


def position_key(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A 32-bit key (int32 bits) per (int64 seed, int64 sequence position); the kernel's
    ``_position_key``."""
    seed_lo = seeds.to(torch.int32)  # truncation keeps the low 32 bits
    seed_hi = (seeds >> 32).to(torch.int32)
    return _mix32(_mix32(_mix32(seed_lo) ^ seed_hi) + positions.to(torch.int32))


def hashed_uniform(key: torch.Tensor, index: torch.Tensor | int) -> torch.Tensor:
    """Uniform float32 in (0, 1) for (key, index), broadcasting; the kernel's ``_uniform``: 23
    random bits centred in their bucket, exact in float32."""
    index = torch.as_tensor(index, device=key.device).to(torch.int32)
    h = _mix32(_mix32(key + index * _u32(0x9E3779B9)))
    return (_shr(h, 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def exponential_noise(key: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` i.i.d. Exp(1) draws, entry ``(b, v)`` from (``key[b]``, index ``v + 1``)."""
    vocab = torch.arange(vocab_size, device=key.device)
    return -torch.log(hashed_uniform(key[:, None], vocab[None, :] + 1))


def exponential_race(weights: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Sample one index per row of ``weights`` ``[B, V]`` (non-negative, not necessarily
    normalised) with the noise of ``key`` ``[B]``: ``argmax(w / E)``, ``E ~ Exp(1)`` per entry.
    Rows of zeros return 0."""
    return (weights / exponential_noise(key, weights.shape[-1])).argmax(dim=-1)

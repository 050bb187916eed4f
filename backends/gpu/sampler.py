"""Sampling on the device with the reference sampler's semantics and noise, the race on the Triton
Gumbel-max kernel (``specloop.kernels.sampling``).

Bias, min_tokens and penalties are the reference's vectorised steps on device tensors; temperature,
min-p and the draw are one kernel pass. Top-p depends on temperature and min-p, so rows that use
top-k / top-p take the reference's temperature -> min-p -> top-k/top-p masking first and are drawn
at temperature 1. Greedy rows take the argmax of the processed logits either way (the masks keep the
maximum).
"""

from __future__ import annotations

import torch

from specloop.backends.sampler import (SamplingMetadata, apply_min_p, apply_temperature, apply_top_k_top_p,
                                       process_logits)
from specloop.kernels.sampling import gumbel_sample


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """One token per row from raw float32 logits [R, V]; the contract of
    ``specloop.backends.sampler.sample``. Returns int64 [R]."""
    logits = process_logits(logits, meta)
    if meta.top_k is None and meta.top_p is None:
        return gumbel_sample(logits, meta.temperature, meta.seeds, meta.positions, min_p=meta.min_p)
    masked = apply_top_k_top_p(apply_min_p(apply_temperature(logits, meta), meta), meta)
    unit = torch.where(meta.greedy, 0.0, 1.0).to(torch.float32)
    return gumbel_sample(masked.contiguous(), unit, meta.seeds, meta.positions)

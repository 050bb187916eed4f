"""Sampling one token per row by Gumbel-max, with temperature and min-p, one program per row.

``argmax(logits / T - log(E))``, ``E ~ Exp(1)`` i.i.d. per vocabulary entry, is a draw from
``softmax(logits / T)``: the log of the reference sampler's exponential race ``argmax(p / E)``. It
needs no normalisation and no sort, so a row is one streaming pass (two with min-p, which needs the
row maximum first). ``E = -log(U)`` uses the noise of the reference sampler and the rejection
sampler (``specloop.sampling.noise``): ``U`` hashes (request seed, sequence position of the
sampled token, vocabulary id + 1), so a seeded request draws the same token here, in the torch
sampler and as a bonus token after verification, whatever batch it shares. Rows with
``temperature == 0`` take the plain argmax. Top-k / top-p are applied beforehand by masking logits
to ``-inf`` (see ``specloop.sampling.sampler.sample``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rejection_sample import _position_key, _uniform


@triton.jit
def _gumbel_sample_kernel(
    logits_ptr, stride_l, temperature_ptr, min_p_ptr, seed_ptr, position_ptr, out_ptr,
    V, BLOCK: tl.constexpr, USE_MIN_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temperature))
    key = _position_key(tl.load(seed_ptr + row), tl.load(position_ptr + row))
    base = logits_ptr + row * stride_l
    cols = tl.arange(0, BLOCK)

    threshold = float("-inf")
    if USE_MIN_P:
        # min-p keeps tokens with p >= min_p * p_max, i.e. logit / T >= max / T + log(min_p).
        row_max = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            row_max = tl.maximum(row_max, x)
        min_p = tl.load(min_p_ptr + row)
        threshold = tl.where(min_p > 0.0, tl.max(row_max, 0) * inv_t + tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))

    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + cols
        ok = idx < V
        x = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        if not greedy:
            score = tl.where(x >= threshold, x - tl.log(-tl.log(_uniform(key, idx + 1))), float("-inf"))
        else:
            score = x
        # Ties (and all -inf rows) resolve to the lowest index, as torch.argmax does.
        better = (score > best_val) | ((score == best_val) & (idx < best_idx))
        better = better & ok
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(best_val, 0)
    winner = tl.min(tl.where(best_val == top, best_idx, 2147483647), 0)
    tl.store(out_ptr + row, winner.to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  min_p: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits`` ``[num_rows, vocab]``.

    :param temperature: float32 ``[num_rows]``; 0 means greedy.
    :param seeds: int64 ``[num_rows]``, each row's request seed.
    :param positions: int64 ``[num_rows]``, sequence position of the token each row samples.
    :param min_p: float32 ``[num_rows]`` or None (no row uses min-p).
    :returns: int64 ``[num_rows]`` token ids.
    """
    num_rows, vocab = logits.shape
    for name, t in (("temperature", temperature), ("seeds", seeds), ("positions", positions)):
        if t.shape[0] < num_rows:
            raise ValueError(f"{name} has {t.shape[0]} rows for {num_rows} logits rows")
    if logits.stride(-1) != 1:
        raise ValueError("logits need a unit stride on the vocabulary")
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    _gumbel_sample_kernel[(num_rows,)](
        logits, logits.stride(0), temperature, min_p if min_p is not None else temperature, seeds, positions, out,
        vocab, BLOCK=min(4096, triton.next_power_of_2(vocab)), USE_MIN_P=min_p is not None, num_warps=8,
    )
    return out

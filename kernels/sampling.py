"""Sampling one token per row by Gumbel-max, with temperature and min-p; and the plain argmax.

``argmax(logits / T - log(E))``, ``E ~ Exp(1)`` i.i.d. per vocabulary entry, is a draw from
``softmax(logits / T)``: the log of the reference sampler's exponential race ``argmax(p / E)``. It
needs no normalisation and no sort, so a row is one streaming pass (two with min-p, which needs the
row maximum first). ``E = -log(U)`` uses the noise of the reference sampler and the rejection
sampler (``specloop.sampling.noise``): ``U`` hashes (request seed, sequence position of the
sampled token, vocabulary id + 1), so a seeded request draws the same token here, in the torch
sampler and as a bonus token after verification, whatever batch it shares. Rows with
``temperature == 0`` take the plain argmax. A NaN logit counts as ``+inf`` (as ``torch.argmax``,
which returns the first NaN, for rows without an infinity), so every row gets a token in range.
Top-k / top-p are applied beforehand by masking logits to ``-inf`` (see
``specloop.sampling.sampler.sample``).

A row is split over several programs when the batch is small (a decode step of a few requests
would otherwise stream each vocabulary through one SM): each writes its chunk's best score and
index, and a second kernel keeps the best, the lowest index among equals, which is the whole row's
answer whatever the split. min-p rows run whole (the threshold needs the row's maximum first).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .rejection_sample import _position_key, _uniform


@triton.jit
def _gumbel_sample_kernel(
    logits_ptr, stride_l, temperature_ptr, min_p_ptr, seed_ptr, position_ptr, out_ptr, part_ptr,
    V, chunk_len, BLOCK: tl.constexpr, USE_MIN_P: tl.constexpr, GREEDY: tl.constexpr, CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if GREEDY:
        greedy = True
        inv_t = 1.0
        key = 0
    else:
        temperature = tl.load(temperature_ptr + row)
        greedy = temperature == 0.0
        inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temperature))
        key = _position_key(tl.load(seed_ptr + row), tl.load(position_ptr + row))
    base = logits_ptr + row * stride_l
    cols = tl.arange(0, BLOCK)

    threshold = float("-inf")
    if USE_MIN_P:  # (one chunk a row: every chunk would need the row's maximum)
        # min-p keeps tokens with p >= min_p * p_max, i.e. logit / T >= max / T + log(min_p).
        row_max = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            row_max = tl.maximum(row_max, x)
        min_p = tl.load(min_p_ptr + row)
        threshold = tl.where(min_p > 0.0, tl.max(row_max, 0) * inv_t + tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))

    lo = chunk * chunk_len
    hi = tl.minimum(lo + chunk_len, V)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 2147483647, tl.int32)
    for start in range(lo, hi, BLOCK):
        idx = start + cols
        ok = idx < hi
        x = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        # NaN counts as +inf (no comparison holds for NaN: a NaN row would end at no index at all).
        x = tl.where(x == x, x, float("inf"))
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
    if CHUNKS == 1:
        tl.store(out_ptr + row, winner.to(tl.int64))
    else:  # the chunk's best, for _merge_chunks_kernel
        tl.store(part_ptr + (row * CHUNKS + chunk) * 2, top)
        tl.store(part_ptr + (row * CHUNKS + chunk) * 2 + 1, winner.to(tl.float32))


@triton.jit
def _merge_chunks_kernel(part_ptr, out_ptr, CHUNKS: tl.constexpr):
    """Each row's best over its chunks' bests, the lowest index among equals (chunks hold indices
    in order, so this is the whole row's argmax, however the chunks ran)."""
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    val = tl.load(part_ptr + (row * CHUNKS + chunks) * 2)
    idx = tl.load(part_ptr + (row * CHUNKS + chunks) * 2 + 1)  # exact in float32 below 2^24
    top = tl.max(val, 0)
    tl.store(out_ptr + row, tl.min(tl.where(val == top, idx, 3.0e38), 0).to(tl.int64))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _chunks(num_rows: int, vocab: int, block: int, device: torch.device) -> int:
    """Programs a row: enough for two a SM over the batch, each at least one ``block`` of the
    vocabulary, at most 64 (a power of two). A batch of one row would otherwise stream the whole
    vocabulary through one SM (tens of microseconds at 150k entries)."""
    if device.type != "cuda":
        return 1
    want = min(64, triton.cdiv(2 * _num_sms(device), num_rows), vocab // block)
    return 1 << (max(want, 1).bit_length() - 1)


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  min_p: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  chunks: int | None = None) -> torch.Tensor:
    """One token per row of ``logits`` ``[num_rows, vocab]``.

    :param temperature: float32 ``[num_rows]``; 0 means greedy.
    :param seeds: int64 ``[num_rows]``, each row's request seed.
    :param positions: int64 ``[num_rows]``, sequence position of the token each row samples.
    :param min_p: float32 ``[num_rows]`` or None (no row uses min-p).
    :param chunks: programs a row (a power of two; by default from the batch and the device).
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
    _launch(logits, temperature, seeds, positions, min_p, out, greedy=False, chunks=chunks)
    return out


def argmax_rows(logits: torch.Tensor, out: torch.Tensor | None = None, chunks: int | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``[num_rows, vocab]`` (ties to the lowest index), int64: a
    decode step's or a verification's greedy tokens, a proposer's drafts. Each row is split over
    several programs and their bests merged, so that a few rows over a large vocabulary do not
    leave the chip idle (``torch.argmax`` runs a row of 150k entries on one SM)."""
    num_rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("logits need a unit stride on the vocabulary")
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        _launch(logits, None, None, None, None, out, greedy=True, chunks=chunks)
    return out


def _launch(logits: torch.Tensor, temperature: torch.Tensor | None, seeds: torch.Tensor | None,
            positions: torch.Tensor | None, min_p: torch.Tensor | None, out: torch.Tensor, greedy: bool,
            chunks: int | None = None) -> None:
    num_rows, vocab = logits.shape
    block = min(4096, triton.next_power_of_2(vocab))
    if chunks is not None and (chunks < 1 or chunks & (chunks - 1)):
        raise ValueError(f"chunks must be a power of two, got {chunks}")
    if min_p is not None:
        chunks = 1
    elif chunks is None:
        chunks = _chunks(num_rows, vocab, block, logits.device)
    else:  # a chunk is whole blocks: small vocabularies (tests) split in smaller blocks
        block = max(16, min(block, triton.next_power_of_2(triton.cdiv(vocab, chunks))))
    chunk_len = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    chunks = triton.cdiv(vocab, chunk_len)
    chunks = 1 << (chunks - 1).bit_length()  # a power of two (the merge's arange); spare chunks are empty
    part = torch.empty(num_rows * chunks * 2, dtype=torch.float32, device=logits.device) if chunks > 1 else out
    dummy = temperature if temperature is not None else logits
    _gumbel_sample_kernel[(num_rows, chunks)](
        logits, logits.stride(0), dummy, min_p if min_p is not None else dummy,
        seeds if seeds is not None else out, positions if positions is not None else out, out, part,
        vocab, chunk_len, BLOCK=block, USE_MIN_P=min_p is not None, GREEDY=greedy, CHUNKS=chunks,
        num_warps=8 if chunks == 1 else 4,
    )
    if chunks > 1:
        _merge_chunks_kernel[(num_rows,)](part, out, CHUNKS=chunks)

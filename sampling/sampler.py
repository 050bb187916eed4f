"""Token sampling: logits processing as reusable steps, batch-independent randomness, logprobs.

A *row* is one position whose next token is sampled (one per decoding request, ``K + 1`` for a
request verifying ``K`` drafts). Every step works on all rows at once, reading per-row parameters
from :class:`SamplingMetadata`. The order follows vLLM's sampler:

1. raw logprobs, if asked for, from ``log_softmax`` of the unprocessed logits;
2. :func:`apply_logit_bias`, :func:`apply_min_tokens` (ban stop/EOS ids until ``min_tokens``);
3. :func:`apply_penalties` (repetition over prompt + output, frequency/presence over output);
4. greedy rows: argmax; random rows: :func:`apply_temperature`, :func:`apply_min_p`,
   :func:`apply_top_k_top_p`, softmax, then an exponential race (:func:`sample_from_probs`).

Randomness is a counter-based hash of (request seed, token position, vocabulary id)
(:mod:`.noise`), shared with the rejection sampler and the Triton kernels: a row's sample depends
only on its own request and position, never on which other requests share the batch, how prefills
were chunked, or whether the token came from a verification step. On CUDA the draw itself can run
in the Gumbel-max kernel (``sample(..., use_kernel=True)``) with the same noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specloop.kernel.outputs import TokenLogprobs
from specloop.kernel.sampling_params import SamplingParams
from .noise import exponential_race, position_key

# Valid but extreme parameters (temperature 1e39, repetition_penalty 1e-40) overflow float32; a
# softmax over +inf is NaN, and a NaN distribution samples token 0 whatever the model says. The
# steps below keep every logit finite or -inf (masked).
_F32 = torch.finfo(torch.float32)


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row. Built by the model runner."""

    params: SamplingParams
    seed: int  # the request's effective seed (its own, or one derived from the engine seed)
    position: int  # index, in the request's token sequence, of the token this row samples
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated before this row (committed + preceding drafts)
    stop_token_ids: Sequence[int]  # banned while len(output_token_ids) < min_tokens


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling parameters as tensors. Built by :meth:`build`; optional fields are None
    when no row uses them, so their steps cost nothing."""

    temperature: torch.Tensor  # [R] float32; 0 marks a greedy row
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    seeds: torch.Tensor  # [R] int64, each in [0, 2^64) as two's complement
    positions: torch.Tensor  # [R] int64
    top_k: torch.Tensor | None  # [R] int64, vocab size where disabled
    top_p: torch.Tensor | None  # [R] float32, 1 where disabled
    min_p: torch.Tensor | None  # [R] float32
    repetition_penalty: torch.Tensor | None  # [R] float32
    frequency_penalty: torch.Tensor | None
    presence_penalty: torch.Tensor | None
    prompt_mask: torch.Tensor | None  # [R, V] bool: token occurs in the prompt
    output_counts: torch.Tensor | None  # [R, V] float32: occurrences in the output so far
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked to -inf: min_tokens, bad_words
    num_logprobs: list[int | None]  # per row: SamplingParams.logprobs

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> SamplingMetadata:
        params = [r.params for r in rows]
        temps = [0.0 if p.greedy else min(p.temperature, _F32.max) for p in params]

        def column(values: list[float], neutral: float, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        rep = column([max(p.repetition_penalty, _F32.tiny) for p in params], 1.0)
        freq = column([p.frequency_penalty for p in params], 0.0)
        pres = column([p.presence_penalty for p in params], 0.0)
        prompt_mask = output_counts = None
        if rep is not None or freq is not None or pres is not None:
            output_counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
            prompt_mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
            for i, r in enumerate(rows):
                if r.output_token_ids:
                    out = torch.tensor(r.output_token_ids, dtype=torch.int64, device=device)
                    output_counts[i].index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
                if rep is not None and r.prompt_token_ids:
                    prompt_mask[i, torch.tensor(r.prompt_token_ids, dtype=torch.int64, device=device)] = True
        bias_rows, bias_ids, bias_vals, ban_rows, ban_ids = [], [], [], [], []
        for i, r in enumerate(rows):
            for token, value in (r.params.logit_bias or {}).items():
                bias_rows.append(i)
                bias_ids.append(token)
                bias_vals.append(value)
            if len(r.output_token_ids) < r.params.min_tokens:
                ban_rows.extend([i] * len(r.stop_token_ids))
                ban_ids.extend(r.stop_token_ids)
            for word in r.params.bad_words_token_ids:
                # A bad word's last token is banned where the output already ends with the rest.
                tail = r.output_token_ids[len(r.output_token_ids) - len(word) + 1:]
                if len(word) == 1 or list(tail) == word[:-1]:
                    ban_rows.append(i)
                    ban_ids.append(word[-1])

        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            greedy=torch.tensor([t == 0.0 for t in temps], dtype=torch.bool, device=device),
            all_greedy=all(t == 0.0 for t in temps),
            seeds=index([seed_to_int64(r.seed) for r in rows]),
            positions=index([r.position for r in rows]),
            top_k=column([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], vocab_size,
                         torch.int64),
            top_p=column([p.top_p for p in params], 1.0),
            min_p=column([p.min_p for p in params], 0.0),
            repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
            prompt_mask=prompt_mask, output_counts=output_counts,
            bias=(index(bias_rows), index(bias_ids), torch.tensor(bias_vals, dtype=torch.float32, device=device))
            if bias_rows else None,
            banned=(index(ban_rows), index(ban_ids)) if ban_rows else None,
            num_logprobs=[p.logprobs for p in params],
        )


def stop_token_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The ids ``min_tokens`` bans: the request's ``stop_token_ids`` plus its EOS ids unless
    ``ignore_eos``."""
    ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        ids += [t for t in eos_token_ids if t not in ids]
    return ids


def seed_to_int64(seed: int) -> int:
    """Any Python int as the int64 whose bits are its low 64 bits (what the noise hash reads)."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


# --- logits processing (each returns new logits; inputs are float32 [R, V]) --------------------

def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.bias is None:
        return logits
    rows, ids, values = meta.bias
    return logits.index_put((rows, ids), values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.banned is None:
        return logits
    return logits.index_put(meta.banned, torch.tensor(float("-inf"), device=logits.device))


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty on tokens seen in the prompt or output (divide positive logits, multiply
    negative ones, as CTRL and transformers do); then ``- frequency * count - presence * [count > 0]``
    over the output only (OpenAI's definition)."""
    if meta.output_counts is None:
        return logits
    counts = meta.output_counts
    if meta.repetition_penalty is not None:
        rep = meta.repetition_penalty[:, None]
        seen = meta.prompt_mask | (counts > 0)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if meta.frequency_penalty is not None:
        logits = logits - meta.frequency_penalty[:, None] * counts
    if meta.presence_penalty is not None:
        logits = logits - meta.presence_penalty[:, None] * (counts > 0).float()
    return logits.clamp(max=_F32.max)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Everything that happens before the greedy/random split: bias, min_tokens, penalties."""
    return apply_penalties(apply_min_tokens(apply_logit_bias(logits, meta), meta), meta)


def apply_temperature(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    # Greedy rows keep their logits (temperature 1) so that probabilities stay finite.
    temp = torch.where(meta.greedy, torch.ones_like(meta.temperature), meta.temperature)
    return (logits / temp[:, None]).clamp(max=_F32.max)


def apply_min_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""
    if meta.min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Keep the ``top_k`` largest logits (ties with the k-th are kept), then the smallest set of
    most likely tokens whose probability reaches ``top_p`` (the most likely token always stays)."""
    if meta.top_k is None and meta.top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    vocab = logits.shape[-1]
    if meta.top_k is not None:
        kth = sorted_logits.gather(1, (vocab - meta.top_k).clamp(0, vocab - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if meta.top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - meta.top_p[:, None]
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def probabilities(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution tokens are drawn from, given processed logits (:func:`process_logits`).
    Greedy rows are one-hot on their argmax, so a rejection sampler treats them exactly."""
    logits = apply_top_k_top_p(apply_min_p(apply_temperature(logits, meta), meta), meta)
    probs = logits.softmax(dim=-1)
    if meta.greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(meta.greedy[:, None], one_hot, probs)
    return probs


# --- randomness ------------------------------------------------------------------------------

def sample_from_probs(probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Exponential race: argmax(p / E), E ~ Exp(1) i.i.d., picks token v with probability p[v]. The
    noise is the rejection sampler's, keyed by (seed, position), so a token drawn here and a bonus
    token drawn while verifying drafts at the same position agree."""
    return exponential_race(probs, position_key(meta.seeds, meta.positions))


def sample(logits: torch.Tensor, meta: SamplingMetadata, use_kernel: bool = False) -> torch.Tensor:
    """One token per row from raw float32 logits [R, V]. Returns int64 [R].

    ``use_kernel`` draws with the Triton Gumbel-max kernel: temperature, min-p and the draw in one
    pass. Top-p depends on temperature and min-p, so rows that use top-k / top-p are masked by the
    torch steps first and drawn at temperature 1. Greedy rows take the argmax of the processed
    logits either way (the masks keep the maximum)."""
    logits = process_logits(logits, meta)
    if use_kernel:
        from specloop.kernels.sampling import gumbel_sample

        if meta.top_k is None and meta.top_p is None:
            return gumbel_sample(logits, meta.temperature, meta.seeds, meta.positions, min_p=meta.min_p)
        masked = apply_top_k_top_p(apply_min_p(apply_temperature(logits, meta), meta), meta)
        unit = torch.where(meta.greedy, 0.0, 1.0).to(torch.float32)
        return gumbel_sample(masked.contiguous(), unit, meta.seeds, meta.positions)
    greedy_tokens = logits.argmax(dim=-1)
    if meta.all_greedy:
        return greedy_tokens
    random_tokens = sample_from_probs(probabilities(logits, meta), meta)
    return torch.where(meta.greedy, greedy_tokens, random_tokens)


# --- logprobs --------------------------------------------------------------------------------

def compute_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor,
                     num_logprobs: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Per row, the log-probability and 1-based rank of ``token_ids[r]`` plus the top
    ``num_logprobs[r]`` alternatives, under the raw model distribution ``log_softmax(logits)``
    (before penalties, bias, temperature and truncation; vLLM's default "raw_logprobs").
    Rows with ``None`` get ``None``."""
    if all(k is None for k in num_logprobs):
        return [None] * len(num_logprobs)
    logprobs = raw_logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    max_k = min(max(k or 0 for k in num_logprobs), logprobs.shape[-1])  # a vocabulary may be smaller than k
    top_vals, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (None, None)
    chosen_l, ranks_l, tokens_l = chosen.tolist(), ranks.tolist(), token_ids.tolist()
    top_vals_l = top_vals.tolist() if top_vals is not None else None
    top_ids_l = top_ids.tolist() if top_ids is not None else None
    out: list[TokenLogprobs | None] = []
    for r, k in enumerate(num_logprobs):
        if k is None:
            out.append(None)
            continue
        out.append(TokenLogprobs(token_id=tokens_l[r], logprob=chosen_l[r], rank=ranks_l[r],
                                 top_token_ids=top_ids_l[r][:k] if k else [],
                                 top_logprobs=top_vals_l[r][:k] if k else []))
    return out

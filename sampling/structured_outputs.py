"""Structured outputs in the sampler's terms: the request parameter (:class:`StructuredOutputsParams`,
as vLLM spells it) and the mask every constrained row gets before sampling or verification.

A mask is a packed bitmask, 32 vocabulary ids to an int32 word (bit ``v % 32`` of word ``v // 32``
set: token ``v`` allowed), the layout grammar engines write. :func:`apply_token_bitmask` sets the
forbidden logits to ``-inf``: with the Triton kernel on CUDA (``specloop.kernels.token_bitmask``),
in torch elsewhere (:func:`apply_token_bitmask_torch`, also the kernel's reference). A masked
logit stays ``-inf`` through bias, penalties, temperature and top-k/top-p, so greedy rows, random
rows and the rejection sampler (whose target distribution is then zero on a forbidden draft) all
see the grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint on a request's output: a JSON schema (``json``, a dict or its text), a
    ``regex``, one string of ``choice``, a Lark or GBNF ``grammar``, or any JSON object
    (``json_object=True``). Set by the caller; compiled by the engine's structured-output backend."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON without whitespace between its tokens

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(given) or 'none'}.")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its text).")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on; equal keys share one compilation."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace

    @classmethod
    def from_any(cls, value: Any) -> StructuredOutputsParams | None:
        """Accept the params, a dict of its fields (unknown keys refused), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}.")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}.")
        return cls(**value)


@dataclass(frozen=True, slots=True)
class GrammarBitmask:
    """The tokens a plan's structured rows may take. Set by the structured-output manager after
    ``execute_model``; applied by the runner before sampling and at every draft position."""

    req_ids: list[str]  # structured requests that sample this step, in plan order
    num_rows: list[int]  # per request: one row per draft verified, plus one
    bitmask: Any  # numpy int32 [sum(num_rows), ceil(vocab / 32)]; bit v of a row set: token v allowed


def num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_ids_bitmask(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """The packed mask allowing exactly ``token_ids`` (``allowed_token_ids``)."""
    bits = torch.zeros(num_words(vocab_size) * 32, dtype=torch.bool)
    bits[torch.tensor(list(token_ids), dtype=torch.int64)] = True
    return pack_bits(bits[None])[0]


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``[M, 32 * W]`` bool -> ``[M, W]`` int32 packed masks."""
    m, n = bits.shape
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (bits.view(m, n // 32, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_bits(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[M, W]`` int32 packed masks -> ``[M, vocab_size]`` bool (ids past ``32 * W``: False)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]))


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """In place: rows ``indices`` of ``logits`` keep only the tokens their mask allows."""
    if indices.numel() == 0:
        return
    rows = indices.long()
    allowed = unpack_bits(bitmask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """:func:`apply_token_bitmask_torch`, in the Triton kernel on CUDA."""
    if logits.is_cuda:
        from specloop.kernels.token_bitmask import apply_token_bitmask as kernel

        kernel(logits, bitmask, indices)
    else:
        apply_token_bitmask_torch(logits, bitmask, indices)

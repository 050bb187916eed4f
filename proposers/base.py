"""The proposer seam: what a model runner gives every speculative proposer, and what it gets back.

A proposer is built once per engine from the proposer registry as
``factory(config=EngineConfig, context=ProposerContext)``: the context names what it may use of the
target (device, dtype, shape, embedding and head, an attention backend for a model of its own), never
the runner itself. Each step's ``sample_tokens`` first verifies the previous step's drafts, then
calls :meth:`Proposer.propose` once for the whole batch with :class:`ProposerInputs`; the drafts
go back to the scheduler in ``post_step`` and are verified by the target in the next step. After a
uniform greedy verification on a runner that keeps token rows on the device, a proposer with
``launches`` is first offered :meth:`Proposer.launch` (:class:`LaunchInputs`, device tensors the
host has not read): drafts it returns stay on the device, the scheduler gets placeholders, and
``propose`` is not called for that step.

``ProposerInputs`` carries what any proposer needs, even where one ignores it: n-gram reads only
the token ids; a draft model adds its own KV cache over the target's block table; Medusa reads the
hidden states each request sampled from. EAGLE and MTP build caches of their own from the target's
hidden states at every position (previous hidden state + next token embedding, one step per
draft; EAGLE-3 reads the streams entering ``hidden_state_layers``): they record those states inside
the target's forward (``record``) and feed their caches from the record when they propose, so
they can skip steps (``catches_up``, ``skip``). A proposer declares what it needs as attributes, so
the runner computes and keeps only what is asked for.

A proposer that instead builds such a cache from the hidden states it is handed must see every
position the target computes, including prefill chunks that sample nothing: it sets
``runs_on_prefill_chunks`` and then also gets those requests, with ``num_sampled == 0`` (it
drafts nothing for them), and is called every step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import nn

    from specloop.kernel.config import EngineConfig
    from specloop.kernel.outputs import SchedulerOutput
    from specloop.kernel.plugins import Registry
    from specloop.kernel.sampling_params import SamplingParams
    from specloop.models.attention import AttentionBackend
    from specloop.models.config import ModelConfig
    from specloop.models.ops import Ops
    from specloop.models.parallel import TensorParallel


# The speculative_config keys a method may or may not read (``Proposer.config_fields``).
OPTIONAL_FIELDS = ("model", "prompt_lookup_min", "prompt_lookup_max", "draft_dtype", "token_map", "extra")


@dataclass(frozen=True, slots=True)
class ProposerContext:
    """What a proposer may use of the engine it drafts for. Built once by the model runner."""

    device: torch.device
    dtype: torch.dtype  # the target's weights and activations
    model_config: ModelConfig  # the target's shape (hidden size, layers, vocabulary, EOS ids, ...)
    vocab_size: int
    block_size: int  # the target's KV block size; a proposer cache indexed by its block table uses it too
    models: Registry  # model architectures, to load a draft checkpoint with ``models.loader.load_model``
    attention_backend: Callable[[], AttentionBackend]  # a new instance of the runner's attention backend
    ops: Ops  # the op set the target's forward runs with
    embed_tokens: nn.Module  # the target's input embedding (EAGLE and MTP share it)
    lm_head: Callable[[torch.Tensor], torch.Tensor]  # the target's hidden states -> logits
    target: Any = None  # the target ``nn.Module`` itself, for proposers that read more of it
    proposers: Registry | None = None  # the proposer registry, for proposers that wrap another
    # The target's tensor-parallel rank: a proposer with a model of its own loads it sharded the same
    # way (``load_model(..., tp=tp)``); it runs on every rank, on the same inputs.
    tp: TensorParallel | None = None


@dataclass(slots=True)
class ProposerInputs:
    """One step's verified state, for the requests that sampled this step (and those that computed a
    partial prefill chunk, for proposers with ``runs_on_prefill_chunks``). Set by the model runner in
    ``sample_tokens``, after rejection sampling; request ``i`` is ``req_ids[i]`` throughout."""

    req_ids: list[str]
    # Prompt + committed output + this step's accepted tokens (the last one is the newest sample,
    # whose KV nobody has computed yet). A prefill chunk's request: its whole known sequence.
    token_ids: list[np.ndarray]
    num_prompt_tokens: np.ndarray  # [B]
    # Tokens emitted this step (accepted drafts + the target's token; 0 for a prefill chunk) and
    # drafts rejected.
    num_sampled: np.ndarray  # [B]
    num_rejected: np.ndarray  # [B]
    sampling_params: list[SamplingParams]
    # Per-request sampling seed for draft sampling (the runner's, derived from SamplingParams.seed
    # or the engine seed), so seeded requests draft reproducibly.
    seeds: np.ndarray  # [B] int64
    # The request's EOS ids (min_tokens bans them while drafting too).
    eos_token_ids: list[tuple[int, ...]] = field(default_factory=list)
    # The target's block table per request (proposers with their own KV cache index it too).
    block_ids: list[list[int]] = field(default_factory=list)
    # How many drafts the speculation policy gives each request this step (None: num_speculative_tokens).
    max_drafts: np.ndarray | None = None  # [B]
    # The target's forward this step: rows ``query_start_loc[i]:query_start_loc[i + 1]`` of the
    # hidden states belong to request ``i`` (their last ``num_rejected[i]`` rows held rejected
    # drafts). Filled only for proposers with ``needs_hidden_states``; the states themselves not for
    # one that ``records_hidden_states`` (it reads what it recorded during the forward).
    query_start_loc: np.ndarray | None = None  # [B + 1]
    positions: np.ndarray | None = None  # [num_step_tokens] position of each hidden-state row
    hidden_states: torch.Tensor | None = None  # [num_step_tokens, H] final states (after the final norm)
    # One [num_step_tokens, H] per hidden_state_layers: the residual stream entering that layer.
    aux_hidden_states: tuple[torch.Tensor, ...] = ()
    # Row of ``hidden_states`` whose logits produced each request's newest token (-1: a partial
    # prefill chunk, which sampled nothing).
    sampled_rows: np.ndarray | None = None  # [B]
    plan: SchedulerOutput | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(slots=True)
class DraftProposal:
    """Next-step drafts, in ``ProposerInputs`` order. Set by the proposer."""

    draft_token_ids: list[list[int]]
    # Per request ``[len(drafts), V]`` float32 probabilities each draft was sampled from; None (the
    # whole field, or a row) means the drafts were deterministic: the rejection sampler treats them
    # as one-hot.
    draft_probs: list[torch.Tensor | None] | None = None


def draft_limits(config: EngineConfig, inputs: ProposerInputs, k: int) -> np.ndarray:
    """How many drafts each request may take: ``k``, less where the speculation policy says so or
    the next step's ``drafts + 1`` tokens would pass ``max_model_len`` or the request's
    ``max_tokens``."""
    max_model_len = config.max_model_len or 1 << 62
    lengths = np.array([len(t) for t in inputs.token_ids], dtype=np.int64)
    num_output = lengths - inputs.num_prompt_tokens
    max_tokens = np.array([p.max_tokens if p.max_tokens is not None else 1 << 62 for p in inputs.sampling_params],
                          dtype=np.int64)
    room = np.minimum(max_model_len - lengths, max_tokens - num_output) - 1
    if inputs.max_drafts is not None:
        room = np.minimum(room, inputs.max_drafts)
    return np.clip(room, 0, k)


class DeviceStep(Protocol):
    """A uniform greedy verification's tensors at fixed addresses (the GPU runner's persistent
    batch), for a proposal graph captured once and replayed after every such step: its first
    ``size`` request rows of ``q`` tokens each (rows past the live ones are padding whose writes
    go nowhere), the target's greedy token after each row in ``top``. Device work only, so that
    a graph can capture it."""

    top: torch.Tensor  # [T] int64
    tokens: torch.Tensor  # [slots, max_len] int32: each request slot's token row
    req_slots: torch.Tensor  # [R] int32: each request row's slot
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding
    seq_lens: torch.Tensor  # [R] int32
    block_tables: torch.Tensor  # [R, max blocks] int32

    def accept_rows(self, size: int, q: int) -> torch.Tensor:
        """The rows each request accepted (``[size]`` int64); writes its next token after them
        into its token row and the drafts it rejected into its lag."""

    def writable(self, size: int) -> torch.Tensor:
        """Positions each request's KV blocks hold (``[size]`` int64)."""

    def write_row_drafts(self, drafts: torch.Tensor, accepted: torch.Tensor, q: int) -> None:
        """Each request's drafts (``[size, K]``) into its token row after its next token."""


@dataclass(slots=True)
class LaunchInputs:
    """A uniform greedy verification step as :meth:`Proposer.launch` sees it, before the host has
    read its outcome: request ``i`` (``req_ids[i]``) computed ``q`` rows, at positions ``first[i]``
    onwards (its newest token, then ``q - 1`` drafts), and every row sampled greedily."""

    req_ids: list[str]
    q: int
    first: np.ndarray  # [B] host
    block_ids: list[list[int]]
    # On the device: the target's greedy token after each row, and the rows each request accepted
    # (its drafts up to the first the target disagreed with, plus one), so request ``i``'s newest
    # token is ``target_tokens[i * q + accepted[i] - 1]`` at position ``first[i] + accepted[i]``.
    # ``accept()`` computes them once (writing each request's next token into its device token row)
    # unless a proposal graph did (``device``), and sets ``accepted``.
    target_tokens: torch.Tensor  # [B * q] int64
    hidden_states: torch.Tensor  # [B * q, H] final states
    accept_rows: Callable[[], torch.Tensor]
    accepted: torch.Tensor | None = None  # [B] int64
    aux_hidden_states: tuple[torch.Tensor, ...] = ()  # one [B * q, H] per hidden_state_layers
    # The step on the device at fixed addresses, ``rows`` request rows of it prepared (padding for
    # the target's graph included): a proposal graph captured on ``device`` reads them and does the
    # bookkeeping itself, accepting and writing its drafts into the token rows
    # (``drafts_written``); otherwise the runner writes the drafts ``launch`` returns.
    device: DeviceStep | None = None
    rows: int = 0
    drafts_written: bool = False
    # On the host: each request's tokens before this step (its newest last), its prompt length, and
    # the drafts this step verifies.
    token_ids: list[list[int]] = field(default_factory=list)
    num_prompt_tokens: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)

    def accept(self) -> torch.Tensor:
        """The rows each request accepted, computed on the first call."""
        if self.accepted is None:
            self.accepted = self.accept_rows()
        return self.accepted


class Proposer(ABC):
    """A speculative proposer, built by ``factory(config=..., context=...)`` from the proposer
    registry, then called directly by the model runner once per step.

    Its attributes tell the runner what to provide and reserve.
    """

    # Fill ProposerInputs.hidden_states / sampled_rows / query_start_loc / positions.
    needs_hidden_states: bool = False
    # Target layers whose input stream goes to ProposerInputs.aux_hidden_states (EAGLE-3), in
    # increasing order (the forward taps them in layer order).
    hidden_state_layers: tuple[int, ...] = ()
    # Also pass the requests whose step was a partial prefill chunk (they sample nothing this step:
    # num_sampled 0, no drafts wanted), so a proposer with a cache over the target's positions
    # builds it from every chunk's hidden states (the KV cache then recomputes a prefix hit's last
    # block: SpeculativeConfig.reads_target_hidden_states).
    runs_on_prefill_chunks: bool = False
    # May skip steps: a call after steps it never saw rebuilds what it needs (a draft model feeds
    # the tokens it missed; EAGLE and MTP feed the hidden states they recorded; n-gram keeps no
    # state). The runner then skips the call in steps that draft nothing, which asynchronous
    # scheduling overlaps; a proposer whose cache is fed every step's hidden states as they come
    # keeps being called.
    catches_up: bool = False
    # Implements launch: its greedy proposal can start from device tensors, before the host reads
    # the verification.
    launches: bool = False
    # Set by the runner before ``initialize`` when it launches proposals from the device: the
    # step tensors a launching proposer's graphs may read (``LaunchInputs.device``).
    device_step: DeviceStep | None = None
    # Implements record: the target's forward hands it every row's hidden states as it computes
    # them (inside the target's CUDA graphs too), so a proposer whose cache is built from them can
    # skip steps and catch up later from what it recorded (``catches_up``).
    records_hidden_states: bool = False
    # The ``speculative_config`` fields it reads besides ``method``, ``num_speculative_tokens`` and
    # ``policy``: any other one set is refused when it is built, naming the field. None (the
    # default) checks nothing: a plugin that reads ``extra`` refuses what it does not know itself.
    config_fields: frozenset[str] | None = None

    def __init__(self, config: EngineConfig, context: ProposerContext | None = None) -> None:
        spec = config.speculative_config
        if spec is None or isinstance(spec, (dict, str)):
            raise ValueError("a proposer needs a resolved speculative_config")
        if self.config_fields is not None:
            unused = [name for name in OPTIONAL_FIELDS if name not in self.config_fields
                      and (spec.extra if name == "extra" else getattr(spec, name) is not None)]
            if unused:
                reads = ", ".join(sorted(self.config_fields)) or "none of the optional keys"
                raise ValueError(f"speculative_config.{unused[0]} does not apply to method {spec.method!r} "
                                 f"(it reads: {reads})")
        self.config = config
        self.context = context
        self.num_speculative_tokens = spec.num_speculative_tokens

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of this proposer's own paged KV cache per block of the target's pool (0: it keeps
        none). The runner sizes the shared block pool with this added to the target's."""
        return 0

    def initialize(self, num_kv_blocks: int) -> None:
        """Allocate device state once the block pool is sized."""

    @abstractmethod
    def propose(self, inputs: ProposerInputs) -> DraftProposal:
        """Drafts for the next step: at most ``num_speculative_tokens`` per request and never
        past :func:`draft_limits`."""

    def launch(self, step: LaunchInputs) -> torch.Tensor | None:
        """Greedy drafts for the step after ``step``, launched on the device before the host reads
        the verification (so the proposal runs while the host commits and plans): ``[B, K]`` on
        the device, every request's ``K = num_speculative_tokens`` drafts, valid until the next
        launch. None when this proposer cannot for this step (the default); ``propose`` is then
        called once the host has the step's tokens. The runner keeps as many of each request's
        drafts as :func:`draft_limits` allows and reads them one step late."""
        return None

    def record(self, hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor],
               slot_mapping: torch.Tensor) -> None:
        """With ``records_hidden_states``: called inside every target forward (and captured in its
        CUDA graphs, so device work only, no host reads) with the rows' final hidden states, the
        tapped layers' streams and each row's KV-cache slot (-1: a padding row that owns none)."""
        raise NotImplementedError(f"{type(self).__name__} does not record hidden states")

    def skip(self) -> None:
        """Called once for each step after which the runner does not call this proposer (one that
        ``catches_up``, in a step the policy drafts nothing after)."""

    def remove_requests(self, req_ids: Iterable[str]) -> None:
        """Forget finished and preempted requests (a preempted one is recomputed from scratch)."""

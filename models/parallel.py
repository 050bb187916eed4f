"""Tensor parallelism for the models: a process's place in its group, and the Megatron-style layers
that split a model's weights across the group's ranks.

::

    ColumnParallelLinear    W's output rows split: each rank computes its slice of the output (its
                            q/k/v heads, its part of gate and of up); no communication
    RowParallelLinear       W's input columns split: each rank's partial sum, one all-reduce, the
                            bias added once after it
    VocabParallelEmbedding  the vocabulary's rows split: each rank looks up the ids it holds, zeros
                            the others, one all-reduce
    ParallelLMHead          the embedding's rows (a tied head shares them); the logits are all-gathered

An attention block is column (qkv) -> attention over the rank's heads -> row (o_proj), an MLP block
column (gate_up) -> row (down): one all-reduce each. At size 1 every layer is the plain
``nn.Linear`` / ``nn.Embedding`` it subclasses, with the same shapes, and issues no collective.

Each layer also knows which slice of a full checkpoint tensor is its rank's (:meth:`load`), so a
rank copies (and, from a lazily opened safetensors file, reads) only its own slices.
"""

from __future__ import annotations

import datetime
import sys
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import ModelLoadError

FAREWELL_S = 5.0  # the longest a rank waits for gloo to let go of its last exchange


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """A process's rank in its tensor-parallel group. Built by whoever starts the ranks (the
    backends' distributed executor); read by the parallel layers and the model runner."""

    rank: int = 0
    size: int = 1
    group: Any = None  # device collectives (NCCL on CUDA, gloo on CPU); None at size 1
    cpu_group: Any = None  # host objects (plans, sampled tokens): gloo, no timeout while idle

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dim, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (e.g. KV blocks each rank's memory allows)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled over the host group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def farewell(self) -> None:
        """The ranks' last exchange before they leave (rank 0 sends, the others wait for it).
        Gloo's threads retire an exchange after its caller has moved on, and retiring one drops
        the Python tensors it held, which takes the GIL: a thread still doing that when the
        interpreter finalizes is killed inside a destructor, which aborts the process. So the
        exchange uses a tensor of its own and returns once gloo has let go of it (its reference
        count is back), the GIL free meanwhile for the exchanges before it to retire as well."""
        token = torch.zeros(1, dtype=torch.int64)
        alone = sys.getrefcount(token)
        dist.broadcast(token, src=0, group=self.cpu_group)
        deadline = time.monotonic() + FAREWELL_S
        while sys.getrefcount(token) > alone and time.monotonic() < deadline:
            time.sleep(0.001)

    def broadcast_ints(self, values: torch.Tensor) -> torch.Tensor:
        """Rank 0's int64 host tensor, in place, on every rank (the others pass one of its size)."""
        dist.broadcast(values, src=0, group=self.cpu_group)
        return values


SINGLE = TensorParallel()


def init_tensor_parallel(rank: int, size: int, device: torch.device, store: Any = None) -> TensorParallel:
    """Join the process group of ``size`` ranks (through ``store``, or torchrun's environment
    when None) and return this process's :class:`TensorParallel`.

    The group is the process's default torch.distributed group: NCCL on CUDA, gloo otherwise; a
    second, gloo group carries host objects and waits without a deadline, since a worker may wait
    for the next plan as long as the engine stays idle."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    else:
        dist.init_process_group(backend)
    if dist.get_world_size() != size or dist.get_rank() != rank:
        raise RuntimeError(f"the process group has rank {dist.get_rank()} of {dist.get_world_size()}; "
                           f"expected rank {rank} of {size} (tensor_parallel_size)")
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=3650))
    if device.type == "cuda":  # create the NCCL communicator now, never inside a CUDA-graph capture
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    return TensorParallel(rank, size, group, cpu_group)


def abort_tensor_parallel(tp: TensorParallel) -> None:
    """Make the device collectives in flight fail now. Gloo fails them by itself when a peer's
    connection closes; NCCL would wait for a dead peer until its watchdog's timeout, so its
    communicators are aborted (torch's experimental ``_abort_process_group``, where it exists)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if tp.size > 1 and dist.is_initialized() and dist.get_backend(tp.group) == "nccl" and abort is not None:
        try:
            abort(tp.group)
        except (RuntimeError, ValueError):
            pass


def destroy_tensor_parallel(tp: TensorParallel) -> None:
    """Leave the process group (so that the process may join another later)."""
    if tp.size > 1 and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):  # already aborted after a failure
            pass


# --- which rows of a full tensor a rank holds -------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Shard:
    """Rows ``start:start + size`` of a (fused part of a) weight of ``full`` rows are this rank's."""

    full: int
    start: int
    size: int


def even_shard(full: int, tp: TensorParallel) -> Shard:
    if full % tp.size:
        raise ModelLoadError(f"a dimension of {full} does not split evenly over tensor_parallel_size={tp.size}")
    size = full // tp.size
    return Shard(full, tp.rank * size, size)


def head_shard(num_heads: int, head_dim: int, tp: TensorParallel) -> Shard:
    """A rank's attention heads: an even share, or one head replicated over ``size / num_heads``
    ranks when there are fewer heads than ranks (KV heads under grouped-query attention); the
    ranks holding a KV head are those whose query heads read it."""
    if num_heads >= tp.size:
        shard = even_shard(num_heads, tp)
        return Shard(num_heads * head_dim, shard.start * head_dim, shard.size * head_dim)
    if tp.size % num_heads:
        raise ModelLoadError(f"{num_heads} KV heads cannot be replicated evenly over tensor_parallel_size={tp.size}")
    head = tp.rank * num_heads // tp.size
    return Shard(num_heads * head_dim, head * head_dim, head_dim)


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[Shard, int]:
    """A rank's rows of the vocabulary (the last rank's may be fewer) and the rows every rank
    allocates (``ceil(vocab / size)``; the extra rows are zero)."""
    rows = -(-vocab_size // tp.size)
    start = min(tp.rank * rows, vocab_size)
    return Shard(vocab_size, start, min(rows, vocab_size - start)), rows


class CheckpointSource(Protocol):
    """A full checkpoint tensor: a ``torch.Tensor``, or a lazily read one (``loader.LazyTensor``)."""

    @property
    def shape(self) -> Any: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


def _check_shape(source: CheckpointSource, expected: Sequence[int]) -> None:
    if tuple(source.shape) != tuple(expected):
        raise ModelLoadError(f"has shape {tuple(source.shape)}, expected {tuple(expected)}")


def load_whole(param: torch.Tensor, source: CheckpointSource) -> None:
    """A replicated parameter: every rank copies the whole tensor."""
    _check_shape(source, param.shape)
    param.copy_(source.narrow(0, 0, param.shape[0]))


class ColumnParallelLinear(nn.Linear):
    """``x W^T + b`` with the output features split: this rank holds, for each fused part (q, k, v,
    or gate, up), the rows its :class:`Shard` names, parts one after the other. No communication."""

    matmul = staticmethod(F.linear)  # F.linear's signature; batch-invariant mode swaps it per module

    def __init__(self, in_features: int, parts: Sequence[Shard], bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__(in_features, sum(p.size for p in parts), bias=bias)
        self.tp = tp
        self.parts = tuple(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)

    def load(self, name: str, source: CheckpointSource, part: int | None) -> None:
        """Copy this rank's rows of fused part ``part`` of the checkpoint tensor."""
        index = part or 0
        shard = self.parts[index]
        param = getattr(self, name)
        _check_shape(source, (shard.full, *param.shape[1:]))
        offset = sum(p.size for p in self.parts[:index])
        param.narrow(0, offset, shard.size).copy_(source.narrow(0, shard.start, shard.size))


class ReplicatedLinear(nn.Linear):
    """``x W^T + b`` held whole (a model with no tensor-parallel layout, e.g. DeepSeek's latent
    attention); like the parallel layers, its ``matmul`` can be swapped (the few-rows kernels)."""

    matmul = staticmethod(F.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """``x W^T + b`` with the input features split: each rank multiplies its slice of ``x`` (the
    output of a column-parallel layer) by its columns of ``W``; the partial sums are all-reduced and
    the bias is added once, after the sum."""

    matmul = staticmethod(F.linear)

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        shard = even_shard(in_features, tp)
        super().__init__(shard.size, out_features, bias=bias)
        self.shard = shard
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(x, self.weight, self.bias)  # nn.Linear's forward
        y = self.tp.all_reduce(self.matmul(x, self.weight))
        return y if self.bias is None else y + self.bias

    def load(self, name: str, source: CheckpointSource, part: int | None) -> None:
        if name == "bias":
            load_whole(self.bias, source)
            return
        _check_shape(source, (self.out_features, self.shard.full))
        self.weight.copy_(source.narrow(1, self.shard.start, self.shard.size))


class VocabParallelEmbedding(nn.Embedding):
    """The input embedding with the vocabulary's rows split across ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        shard, rows = vocab_shard(vocab_size, tp)
        super().__init__(rows, hidden_size)
        self.shard = shard
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)  # nn.Embedding's forward (no padding_idx, max_norm)
        local = input_ids - self.shard.start
        foreign = (local < 0) | (local >= self.shard.size)
        out = F.embedding(local.masked_fill(foreign, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(foreign.unsqueeze(-1), 0))

    def load(self, name: str, source: CheckpointSource, part: int | None) -> None:
        _load_vocab_rows(self.weight, self.shard, source)


class ParallelLMHead(nn.Linear):
    """The output head over the same vocabulary rows as :class:`VocabParallelEmbedding`; every rank
    gets the whole logits (all-gathered), so anything downstream (sampling, a proposer drafting
    with the target's head) runs unchanged on every rank."""

    matmul = staticmethod(F.linear)

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel = SINGLE) -> None:
        shard, rows = vocab_shard(vocab_size, tp)
        super().__init__(hidden_size, rows, bias=False)
        self.shard = shard
        self.tp = tp
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.matmul(hidden, self.weight)  # nn.Linear's forward
        return self.tp.all_gather(self.matmul(hidden, self.weight))[..., :self.vocab_size]

    def load(self, name: str, source: CheckpointSource, part: int | None) -> None:
        _load_vocab_rows(self.weight, self.shard, source)


def _load_vocab_rows(weight: torch.Tensor, shard: Shard, source: CheckpointSource) -> None:
    _check_shape(source, (shard.full, weight.shape[1]))
    weight[:shard.size].copy_(source.narrow(0, shard.start, shard.size))
    weight[shard.size:].zero_()


PARALLEL_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead)


def load_parameter(module: nn.Module, name: str, source: CheckpointSource, part: int | None = None) -> None:
    """Copy this rank's share of a checkpoint tensor into ``module.<name>``: a parallel layer's
    slice, or the whole tensor for a replicated parameter. Raises :class:`ModelLoadError` on a
    shape that does not fit."""
    with torch.no_grad():
        if isinstance(module, PARALLEL_LAYERS):
            module.load(name, source, part)
        else:
            load_whole(getattr(module, name), source)

"""The ``"gpu"`` model runner: the one ``ModelRunner`` composed of GPU parts.

* fused Triton ops (``models.ops.TritonOps``) in the model's forward, and the ``"triton"``
  attention backend (its decode tile timed at start-up);
* a device-resident persistent batch instead of host-built inputs;
* CUDA graphs of uniform decode / verification steps (every draft count up to K) around the eager
  executor;
* a fast sampling path for plain batches around the reference sampling stage.

Options (``config.plugin_options["gpu"]``): ``fused`` (default on), ``cuda_graphs`` (default on
unless ``enforce_eager``; CUDA only, and only with the fused ops), ``device_proposals`` (default on:
a proposer that can launches its greedy proposal from the device after a verification, its drafts
left in the device token rows; off, it proposes once the host has read the step) and
``device_timeline`` (device timestamps for the step timeline) and ``skinny_gemv`` (default on on
CUDA, off with ``batch_invariant``, which it cannot be combined with: the target's linear layers run
``kernels.gemv`` in steps of up to ``skinny_rows`` rows (at most 16; by default 2 for a model of small
projections, 1 otherwise: ``default_skinny_rows``), cuBLAS in the
rest, and the op set fuses a decoder layer's norms and activation into them,
``models.few_rows_ops.FewRowsOps``) and ``graph_sampling`` (default on: a decode
step's CUDA graph draws each row's token, ``backends.gpu.graphs``; one rank only) and
``late_verification`` (default on, with asynchronous scheduling and ``device_proposals``: a greedy
verification whose next proposal launched from the device is read a step late, the next step
planned as if every draft were accepted, ``backends.pending.read_later``) and ``pdl`` (the decode
path's Triton kernels launch with programmatic dependent launch, compute capability 9.0 on, so each
starts, and fetches its weights into L2, while the one before it finishes; ``kernels.pdl``. By
default on where it pays: for a model whose every projection fits a third of L2, whose step is
mostly launch gaps; on the H200 it made qwen3-0.6b's batch-1 decode 10% faster and llama3-8b's 6.5%
slower) and ``rope_in_attention`` (default off: a decode step's q/k norms, rotary embedding and KV write run
inside the attention kernel, one launch a layer fewer, ``kernels.paged_attention.DecodeRope``; on
the H200 it made qwen3-0.6b's batch-1 decode 5% slower, batch 4 3% faster) and ``last_sums``
(default off: a few-rows projection split along its inputs has its slices added by the last program
of each column block to finish, counted by an atomic, instead of by a second kernel, and
flash-decoding's splits and the one-token MoE's down groups merged likewise, ``kernels.last_sums``;
on the H200 2.5% slower at qwen3-0.6b's batch 1)
and ``decode_tile`` (the decode attention tile, one of ``TritonAttentionBackend.DECODE_CONFIGS`` as
``[keys a tile, warps, stages]``; by default the fastest of them timed at start-up, which two
engines of one process may choose differently: a benchmark comparing them gives both one; refused
for latent attention and in batch-invariant mode, which keep their own) and ``long_context_graphs``
(default off, not yet measured end to end: a second decode graph for each batch size whose split
count leaves the chip short of programs, with more splits, replayed when the longest context gives
each split two tiles, ``backends.gpu.graphs``; dense attention only) and ``moe_down_groups`` (by
default ``MOE_DOWN_GROUPS`` where the kernel runs: the one-token MoE's down projection spreads a
token's experts over that many programs a block of hidden units, ``kernels.skinny_moe``; other than
1, refused where that kernel does not run) and ``fused_latent`` (default on with ``skinny_gemv``:
latent attention at one token in three kernels, its rotary and cache write beside ``W_UK``'s
product and its split merge inside ``W_UV``'s, ``kernels.latent_heads``; on an H100
DeepSeek-V2-Lite's batch-1 decode 1.5-5% faster; refused without ``skinny_gemv``) and
``moe_shared_stream`` (default on with ``skinny_gemv``: a one-token MoE's shared experts start on a
second stream beside the router and the routing, ``kernels.skinny_moe.shared_beside_routing``;
``True`` refused where no such MoE runs, any value without ``skinny_gemv``) and ``fused_routing``
(default on with ``skinny_gemv``: a one-token MoE's router and routing in one kernel, the routing
run by the router's last program to finish, ``kernels.moe_route.router_route``; refused likewise).
Any other key is refused.
"""

from __future__ import annotations

import functools
import logging

import torch

from specloop.kernel.config import EngineConfig
from specloop.kernel.plugins import PluginManager
from specloop.kernels import last_sums, latent_heads, moe_route, pdl, skinny_moe
from specloop.kernels.gemv import MAX_ROWS, ROUTED_ROWS, SMALL_ROUTED_ROWS, set_routed_rows
from specloop.kernels.gemv import few_rows_linear
from specloop.models.few_rows_ops import FEW_ROWS_OPS
from specloop.models.ops import TORCH_OPS, TRITON_OPS, Ops
from specloop.models.parallel import ColumnParallelLinear, ParallelLMHead, ReplicatedLinear, RowParallelLinear
from specloop.plugins.options import options_of

from ..distributed import TensorParallelRunner, launch_model_runner
from ..executor import EagerExecutor
from ..parts import RunnerParts
from ..runner import ModelRunner
from ..sampling_stage import SamplingStage
from .fast_sampling import FastSamplingStage
from .graphs import GraphExecutor
from .persistent_batch import PersistentBatch
from .batch_invariant import make_batch_invariant
from .triton_attention import TritonAttentionBackend

logger = logging.getLogger("specloop")

# The one-token MoE's down kernel spreads a token's experts over this many programs a block by
# default (``moe_down_groups``; one pick a program for DeepSeek-V2-Lite's 6 + 2, the same bits in
# half precision as one program): on the H200 V2-Lite's MoE layer alone took 41.3 us against 45.9
# with 4 and 57.9 with 1, and its batch-1 decode ran 381.8 / 377.9 tok/s against 359.3 / 351.6
# with 1 (in turn, one call; 4 against 1, another call: 366.5 / 373.3 against 360.5 / 360.1).
MOE_DOWN_GROUPS = 8


class GpuPlatform:
    default_attention_backend = "triton"
    overlap = "device"
    OPTIONS = ("fused", "cuda_graphs", "device_proposals", "device_timeline", "skinny_gemv", "graph_sampling",
               "late_verification", "pdl", "rope_in_attention", "last_sums", "skinny_rows", "decode_tile",
               "long_context_graphs", "moe_down_groups", "fused_latent", "moe_shared_stream", "fused_routing")

    def __init__(self, config: EngineConfig) -> None:
        opts = dict(options_of(config, "gpu", self.OPTIONS))
        self.fused = bool(opts.get("fused", True))
        self.cuda_graphs = bool(opts.get("cuda_graphs", not config.enforce_eager))
        self.long_context_graphs = bool(opts.get("long_context_graphs", False))
        self.device_proposals = bool(opts.get("device_proposals", True))
        self.graph_sampling = bool(opts.get("graph_sampling", True))
        self.late_verification = bool(opts.get("late_verification", True))
        self.pdl = None if opts.get("pdl") is None else bool(opts["pdl"])  # None: where it pays
        self.rope_in_attention = bool(opts.get("rope_in_attention", False))
        self.last_sums = bool(opts.get("last_sums", False))
        # On by default on CUDA; batch-invariant mode fixes the linear layers' kernel, so not there.
        on_cuda = str(config.device).startswith("cuda") or (str(config.device) == "auto" and torch.cuda.is_available())
        default_skinny = on_cuda and not config.batch_invariant
        self.skinny_gemv = bool(opts.get("skinny_gemv", default_skinny))
        if self.skinny_gemv and config.batch_invariant:
            raise ValueError("plugin_options['gpu']['skinny_gemv'] and batch_invariant=True both choose the linear "
                             "layers' kernel; use one")
        rows = opts.get("skinny_rows")  # None: default_skinny_rows, once the model is loaded
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= MAX_ROWS):
            raise ValueError(f"plugin_options['gpu']['skinny_rows'] must be an integer from 1 to {MAX_ROWS} (the "
                             f"most rows a step the few-rows kernels take), got {rows!r}")
        if "skinny_rows" in opts and not self.skinny_gemv:
            raise ValueError("plugin_options['gpu']['skinny_rows'] sets the few-rows kernels' steps, which "
                             "skinny_gemv is off for")
        self.skinny_rows = rows
        tile = opts.get("decode_tile")  # None: timed at start-up
        if tile is not None:
            tile = tuple(tile) if isinstance(tile, (list, tuple)) else tile
            if tile not in TritonAttentionBackend.DECODE_CONFIGS:
                raise ValueError(f"plugin_options['gpu']['decode_tile'] must be one of "
                                 f"{', '.join(str(list(c)) for c in TritonAttentionBackend.DECODE_CONFIGS)} (keys a "
                                 f"tile, warps, stages), got {opts['decode_tile']!r}")
        self.decode_tile = tile
        groups = opts.get("moe_down_groups")  # None: MOE_DOWN_GROUPS where the kernel runs
        if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= 64):
            raise ValueError(f"plugin_options['gpu']['moe_down_groups'] must be an integer from 1 to 64 (programs "
                             f"over a token's experts in the one-token MoE's down projection), got {groups!r}")
        self.moe_down_groups = groups
        if opts.get("fused_latent") and not self.skinny_gemv:
            raise ValueError("plugin_options['gpu']['fused_latent'] fuses kernels of the few-rows op set, which "
                             "skinny_gemv is off for")
        self.fused_latent = bool(opts.get("fused_latent", True))
        if opts.get("moe_shared_stream") and not self.skinny_gemv:
            raise ValueError("plugin_options['gpu']['moe_shared_stream'] sets how the few-rows op set runs a "
                             "one-token MoE, which skinny_gemv is off for")
        self.moe_shared_stream = bool(opts.get("moe_shared_stream", True))
        self.shared_stream_given = opts.get("moe_shared_stream") is True
        if opts.get("fused_routing") and not self.skinny_gemv:
            raise ValueError("plugin_options['gpu']['fused_routing'] sets how the few-rows op set runs a one-token "
                             "MoE, which skinny_gemv is off for")
        self.fused_routing = bool(opts.get("fused_routing", True))
        self.fused_routing_given = opts.get("fused_routing") is True

    def ops(self, config: EngineConfig) -> Ops:
        if not self.fused:
            return TORCH_OPS
        return FEW_ROWS_OPS if self.skinny_gemv else TRITON_OPS

    def parts(self, runner: ModelRunner) -> RunnerParts:
        moe = runner.model_config.moe
        one_token_moe = moe is not None and self.fused and self.skinny_gemv
        if self.shared_stream_given and not (one_token_moe and moe.num_shared_experts):
            raise ValueError("plugin_options['gpu']['moe_shared_stream'] runs a one-token MoE's shared experts beside "
                             "its routing, which this engine does not have (a model without shared experts, or fused "
                             "or skinny_gemv off)")
        if self.fused_routing_given and not one_token_moe:
            raise ValueError("plugin_options['gpu']['fused_routing'] routes a one-token MoE in its router's kernel, "
                             "which this engine does not run (a model without experts, or fused or skinny_gemv off)")
        if self.moe_down_groups not in (None, 1) and not one_token_moe:
            raise ValueError("plugin_options['gpu']['moe_down_groups'] sets the one-token MoE kernel's programs, "
                             "which this engine does not run (a model without experts, or fused or skinny_gemv off)")
        c = runner.config
        pdl.set_enabled(self.pdl if self.pdl is not None else pdl_pays(runner.model, runner.device))
        if hasattr(runner.attn_backend, "rope_in_attention"):
            runner.attn_backend.rope_in_attention = self.rope_in_attention
        last_sums.set_enabled(self.last_sums, runner.device if runner.device.type == "cuda" else None)
        set_routed_rows(self.skinny_rows or default_skinny_rows(runner.model, runner.device))
        latent_heads.set_fused(self.fused_latent)
        skinny_moe.set_shared_stream(self.moe_shared_stream)
        moe_route.set_fused(self.fused_routing)
        if one_token_moe and self.fused_routing and runner.device.type == "cuda":
            last_sums.counts(runner.device)  # the router's arrival count, allocated before any graph capture
        skinny_moe.set_down_groups(self.moe_down_groups or (MOE_DOWN_GROUPS if one_token_moe else 1))
        if pdl.enabled(runner.device):
            logger.info("programmatic dependent launch in the decode path's kernels")
        if c.batch_invariant:
            logger.info("batch-invariant kernels in %d linear layers", make_batch_invariant(runner))
        if self.skinny_gemv:
            logger.info("few-rows kernels in %d linear layers", use_few_rows_linear(runner.model))
        k = c.num_lookahead_tokens
        max_len = (c.max_model_len or 2048) + k + 1
        max_tokens = max(c.max_num_batched_tokens or 8192, c.max_num_seqs * (k + 1))
        batch = PersistentBatch(c.max_num_seqs, max_len, runner.block_size, max_tokens, runner.device)
        eager = EagerExecutor(runner.model, runner.ops, runner.attn_backend, runner.aux_layers, runner.recorder)
        executor: EagerExecutor | GraphExecutor = eager
        if (self.cuda_graphs and self.fused and runner.device.type == "cuda"
                and isinstance(runner.attn_backend, TritonAttentionBackend)):
            mc, backend = runner.model_config, runner.attn_backend
            # Ragged steps replay graphs too, but for the latent (MLA) and MoE kernels, whose grids
            # follow the step's shape, and in batch-invariant mode.
            ragged = mc.mla is None and mc.moe is None and not c.batch_invariant
            executor = GraphExecutor(eager, batch, list(range(1, k + 2)), mc.hidden_size, runner.vocab_size,
                                     functools.partial(backend.decode_splits, mc), ragged=ragged,
                                     sample_in_graph=self.graph_sampling and runner.tp.size == 1,
                                     long_splits=functools.partial(backend.long_decode_splits, mc)
                                     if self.long_context_graphs else None)
        reference = SamplingStage(runner.model, runner.vocab_size, runner.device, use_kernels=True)
        return RunnerParts(batch, executor, FastSamplingStage(reference, batch, max_tokens),
                           device_rows=batch if self.device_proposals else None)

    def kv_allocated(self, runner: ModelRunner) -> None:
        backend, c = runner.attn_backend, runner.config
        # The latent (MLA) kernel keeps its fixed tile, and so does batch-invariant attention.
        tunable = runner.model_config.mla is None and not getattr(backend, "invariant", False)
        if self.decode_tile is not None:
            if not (isinstance(backend, TritonAttentionBackend) and tunable):
                raise ValueError("plugin_options['gpu']['decode_tile'] sets the tile of the triton backend's paged "
                                 "decode attention, which this engine does not tune (latent attention, "
                                 "batch-invariant mode or another attention backend)")
            backend.decode_config = self.decode_tile
            logger.info("decode attention tile: %s (given)", backend.decode_config)
        elif runner.device.type == "cuda" and isinstance(backend, TritonAttentionBackend) and tunable:
            max_len = (c.max_model_len or 2048) + c.num_lookahead_tokens + 1
            backend.tune_decode(runner.kv_caches[0], runner.model_config.num_heads, c.max_num_seqs,
                                min(max_len, 1024))
            logger.info("decode attention tile: %s (%s)", backend.decode_config, backend.decode_tuning)
        executor = runner.parts.executor
        if isinstance(executor, GraphExecutor):
            executor.capture()


def pdl_pays(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether programmatic dependent launch speeds ``model``'s decode up: where the device has it
    and the projections of its decoder layers (``model.layers``; the LM head, after them, does not
    count, whatever class holds it) that do not fit the weights a kernel may prefetch
    (``kernels.pdl``) hold at most a quarter of their bytes. A larger projection streams long enough
    that launch gaps matter little, and kernels started early take SM slots from it: llama3-8b's
    batch-1 decode, every projection past the budget, ran 6.5% slower with it on the H200. In
    DeepSeek-V2-Lite only the first layer's dense MLP is past it (18% of the bytes), and on an H100
    its batch-1 decode ran 1.6-2.6% faster with it (with its shared experts beside the routing)."""
    if not pdl.supported(device):
        return False
    sizes = _projection_bytes(model)
    budget = pdl.prefetch_budget(device)
    return 4 * sum(size for size in sizes if size > budget) <= sum(sizes)


def _projection_bytes(model: torch.nn.Module) -> list[int]:
    """The weight bytes of each projection of ``model``'s decoder layers (``model.layers``)."""
    return [m.weight.numel() * m.weight.element_size() for m in getattr(model, "layers", model).modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear))]


def default_skinny_rows(model: torch.nn.Module, device: torch.device) -> int:
    """The most rows a step the few-rows kernels take by default: two for a model whose step is
    launch and latency bound (programmatic dependent launch on the device, every projection of
    its decoder layers within a kernel's prefetch), one otherwise.
    On the H200 qwen3-0.6b decoded batch 2 at 1,754-1,757 tok/s with the kernels against 1,401-1,464
    with cuBLAS; llama3-8b at 292 against 415."""
    small = pdl.supported(device) and max(_projection_bytes(model), default=0) <= pdl.prefetch_budget(device)
    return SMALL_ROUTED_ROWS if small else ROUTED_ROWS


def use_few_rows_linear(model: object) -> int:
    """The ``skinny_gemv`` option: every linear layer of ``model`` runs ``kernels.gemv``'s
    ``few_rows_linear`` (its kernels for steps of up to ``skinny_rows`` rows, ``F.linear`` for more); the
    layers switched."""
    switched = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, ParallelLMHead)):
            module.matmul = few_rows_linear
            switched += 1
    return switched


def gpu_model_runner(config: EngineConfig, plugins: PluginManager) -> ModelRunner | TensorParallelRunner:
    return launch_model_runner(config, plugins, GpuPlatform(config))

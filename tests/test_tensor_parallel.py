"""Tensor parallelism on CPUs (gloo, two processes): a TP=2 engine's tokens are TP=1's and
transformers', seeded sampling does not depend on the TP size, each rank reads only its slices of
the checkpoint, ranks share rank 0's sampled tokens, and a worker that dies fails the engine at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch
from hf_models import build, prompts, tiny

from specloop.backends.distributed import WorkerFailedError
from specloop.backends.runner import ModelRunner
from specloop.backends.scripted import ScriptedModelRunner
from specloop.backends.shared_tokens import BroadcastSampledTokens, ReceiveSampledTokens
from specloop.backends.sampling_stage import SampleResult
from specloop.frontend.llm import LLM
from specloop.kernel.config import EngineConfig
from specloop.kernel.engine_core import EngineCore
from specloop.kernel.plugins import PluginManager
from specloop.kernel.sampling_params import SamplingParams
from specloop.models import loader
from specloop.models.config import ModelLoadError, read_model_config
from specloop.models.loader import load_model
from specloop.models.parallel import TensorParallel

MODELS = PluginManager(load_entrypoints=False).models
ENGINE: dict[str, Any] = dict(device="cpu", num_kv_blocks=160, max_model_len=128, block_size=4,
                              skip_tokenizer_init=True)


def tokens(llm: LLM, batch: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]


@pytest.fixture
def shutdown() -> Any:
    """Collects engines and shuts each down, so a failing test leaves no process group behind."""
    engines: list[LLM] = []
    yield engines.append
    for llm in engines:
        llm.core.shutdown()


@pytest.mark.parametrize("name", ["llama", "qwen3_kv1"])
def test_tp2_tokens_match_tp1_and_transformers(tmp_path: Any, shutdown: Any, name: str) -> None:
    """Greedy tokens are transformers' at TP=1 and TP=2 (Qwen3 with one KV head, replicated on
    both ranks; Llama verifying the drafts of a draft model sharded like the target); seeded
    sampled tokens are the same at both sizes."""
    if name == "llama":
        model = tiny("llama")
        draft = build("llama", str(tmp_path), seed=7)
        extra: dict[str, Any] = {"speculative_config": {"method": "draft_model", "model": draft.path,
                                                        "num_speculative_tokens": 2}}
    else:
        model = build("qwen3", str(tmp_path), overrides={"num_key_value_heads": 1})
        extra = {}
    batch = prompts(4, seed=5, max_len=24)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(len(batch))]
    one = LLM(model.path, **ENGINE, **extra)
    two = LLM(model.path, **ENGINE, **extra, tensor_parallel_size=2)
    shutdown(two)
    expected = [model.greedy(p, 10) for p in batch]
    assert tokens(one, batch, greedy) == expected
    assert tokens(two, batch, greedy) == expected
    assert tokens(two, batch, seeded) == tokens(one, batch, seeded)
    runner = two.core.runner
    assert runner.local.model_config.num_kv_heads == 1 and len(runner.workers) == 1


def test_async_scheduling_is_refused_across_ranks_and_off_by_default() -> None:
    """The ranks step in lockstep, each plan committed before the next: asking for asynchronous
    scheduling is refused by name before any rank starts; left unset it resolves off (on a GPU too,
    where a lone rank's default is on)."""
    with pytest.raises(ValueError, match="async_scheduling is not supported with tensor_parallel_size > 1"):
        LLM(tiny("llama").path, **ENGINE, tensor_parallel_size=2, async_scheduling=True)
    runner = ModelRunner.__new__(ModelRunner)
    runner.config, runner.device = EngineConfig(async_scheduling=None), torch.device("cuda")
    runner.tp = TensorParallel(rank=1, size=2)
    assert runner._resolve_async_scheduling() is False
    runner.tp = TensorParallel()
    assert runner._resolve_async_scheduling() is True


def test_each_rank_reads_only_its_slices(tmp_path: Any, monkeypatch: Any) -> None:
    """Loading rank ``r`` of 2 (no process group is needed to load) reads, per sharded tensor, half
    of it, and the halves of both ranks put back together are the checkpoint."""
    from safetensors.torch import load_file

    model = build("qwen3", str(tmp_path), overrides={"vocab_size": 509})  # not a multiple of 2: padded rows
    full = {k.removeprefix("model."): v for k, v in load_file(os.path.join(model.path, "model.safetensors")).items()}
    read: dict[int, int] = {}
    narrow = loader.LazyTensor.narrow

    def counting(self: loader.LazyTensor, dim: int, start: int, length: int) -> torch.Tensor:
        out = narrow(self, dim, start, length)
        read[rank] = read.get(rank, 0) + out.numel()
        return out

    monkeypatch.setattr(loader.LazyTensor, "narrow", counting)
    shards = []
    for rank in range(2):
        ours, cfg = load_model(model.path, MODELS, "cpu", "auto", TensorParallel(rank, 2))
        assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (2, 1, 64)
        shards.append(dict(ours.named_parameters()))
    total = sum(t.numel() for t in full.values())
    replicated = sum(t.numel() for k, t in full.items() if "norm" in k)
    # Every sharded element is read by one rank, every replicated one (the norms) by both.
    assert read[0] + read[1] == total + replicated and max(read.values()) < total / 2 + replicated
    attn, mlp = "layers.1.self_attn", "layers.0.mlp"
    q, k, v = full[f"{attn}.q_proj.weight"], full[f"{attn}.k_proj.weight"], full[f"{attn}.v_proj.weight"]
    for rank, params in enumerate(shards):
        heads, kv_head = slice(rank * 64, rank * 64 + 64), slice(rank * 32, rank * 32 + 32)  # head_dim 32
        assert torch.equal(params[f"{attn}.qkv_proj.weight"], torch.cat([q[heads], k[kv_head], v[kv_head]]))
        assert torch.equal(params[f"{attn}.o_proj.weight"], full[f"{attn}.o_proj.weight"][:, heads])
        assert torch.equal(params[f"{mlp}.gate_up_proj.weight"],
                           torch.cat([full[f"{mlp}.gate_proj.weight"][heads], full[f"{mlp}.up_proj.weight"][heads]]))
    embed = torch.cat([shards[0]["embed_tokens.weight"], shards[1]["embed_tokens.weight"]])
    assert embed.shape[0] == 510 and torch.equal(embed[:509], full["embed_tokens.weight"]) and not embed[509].any()


def test_a_model_that_does_not_split_says_why() -> None:
    cfg = read_model_config(tiny("llama").path)
    assert cfg.per_rank(1) is cfg and cfg.per_rank(4).num_kv_heads == 1
    with pytest.raises(ModelLoadError, match="num_attention_heads \\(4\\) is not a multiple of it"):
        cfg.per_rank(8)
    with pytest.raises(ModelLoadError, match="intermediate_size \\(128\\) is not a multiple of it"):
        cfg.per_rank(3)


class _Host:
    """One rank's side of the host broadcast, recorded instead of sent."""

    sent: torch.Tensor | None = None

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def broadcast_ints(self, values: torch.Tensor) -> torch.Tensor:
        if self.rank == 0:
            _Host.sent = values.clone()
        else:
            values.copy_(_Host.sent)
        return values


def test_the_other_ranks_adopt_rank_zeros_tokens() -> None:
    """Invariant 8 by construction: whatever the other ranks would have sampled, they hold what
    rank 0 sampled (none for a partial prefill, several for a verification)."""
    class Batch:
        req_ids = ["a", "b", "c"]
        sample_rows = [(0, 0), (0, 3), (3, 1)]
        precomputed_logits = torch.zeros(4, 8)  # skips the head, as after a CUDA graph

    class Stage:
        def sample(self, *args: Any, **kwargs: Any) -> SampleResult:
            return SampleResult([[], [5, 6], [7]], None, {})

        def forget(self, finished: Any) -> None:
            pass

    sent = BroadcastSampledTokens(Stage(), _Host(0)).sample(Batch(), None, {}, {})
    got = ReceiveSampledTokens(None, _Host(1)).sample(Batch(), None, {}, {})
    assert got.sampled == sent.sampled == [[], [5, 6], [7]]


def test_an_engine_that_fails_to_build_shuts_its_runner_down() -> None:
    """A tensor-parallel runner holds worker processes and the process's group: a config error
    found after it was built (here, a KV cache too small for one sequence) must release them."""
    class Runner(ScriptedModelRunner):
        closed = False

        def shutdown(self) -> None:
            Runner.closed = True

    config = EngineConfig(model_runner="scripted", num_kv_blocks=4, max_model_len=512)
    with pytest.raises(ValueError, match="cannot hold one max_model_len"):
        EngineCore(config, PluginManager(load_entrypoints=False), runner=Runner(config))
    assert Runner.closed


def test_a_killed_worker_fails_the_engine_at_once(shutdown: Any) -> None:
    llm = LLM(tiny("qwen3").path, **ENGINE, tensor_parallel_size=2)
    shutdown(llm)
    runner = llm.core.runner
    worker = runner.workers[0]
    threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match=f"worker rank 1 \\(pid {worker.pid}\\) exited with code -9"):
        tokens(llm, prompts(8, seed=9, max_len=24), SamplingParams(max_tokens=100, ignore_eos=True))
    assert time.monotonic() - start < 30
    with pytest.raises(WorkerFailedError):  # and stays failed
        tokens(llm, prompts(1), SamplingParams(max_tokens=2))
    start = time.monotonic()
    llm.core.shutdown()
    assert time.monotonic() - start < 5 and not worker.is_alive()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_match_one_through_cuda_graphs(shutdown: Any) -> None:
    """The ``"gpu"`` runner on two GPUs (NCCL, Triton kernels, the all-reduces captured in the
    decode graphs), float32: the tokens of one GPU."""
    model = tiny("qwen3")
    engine = dict(device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=128, skip_tokenizer_init=True)
    batch = prompts(8, seed=5, max_len=24)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    one = LLM(model.path, **engine)
    expected = tokens(one, batch, greedy)
    one.core.shutdown()
    two = LLM(model.path, **engine, tensor_parallel_size=2)
    shutdown(two)
    assert tokens(two, batch, greedy) == expected == [model.greedy(p, 16) for p in batch]
    assert two.core.runner.local.parts.executor.num_replays > 0


def test_a_policy_that_decides_from_timings_is_refused_across_ranks() -> None:
    """Each rank runs the proposer and asks its own policy; the adaptive one decides from timings
    that differ by rank, so the ranks would draft differently (and their collectives part)."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "policy": "adaptive"}
    with pytest.raises(ValueError, match="policy='adaptive'.*tensor_parallel_size > 1"):
        LLM(tiny("qwen3").path, **ENGINE, tensor_parallel_size=2, speculative_config=spec)

"""The ``"gpu"`` model runner against the ``"torch"`` runner on the same device and dtype.

Shared by ``test_triton_kernels.py`` (CPU, in a child process under ``TRITON_INTERPRET=1``) and
``test_gpu_backend.py`` (CUDA, with graphs). Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

from typing import Any

import torch
from hf_models import prompts, tiny
from plans import Plans

from specloop.kernel.config import EngineConfig
from specloop.kernel.plugins import PluginManager
from specloop.kernel.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=100)
SEEDED = SamplingParams(temperature=0.8, min_p=0.05, seed=5, max_tokens=100)


def make_runner(path: str, name: str, device: str, dtype: str, **config: Any) -> Any:
    cfg = EngineConfig(model=path, device=device, dtype=dtype, block_size=4, num_kv_blocks=64, max_num_seqs=8,
                       max_num_batched_tokens=256, **config)
    plugins = PluginManager(load_entrypoints=False)
    runner = plugins.model_runners.create(name, config=cfg, plugins=plugins)
    cfg.resolve(runner.model_max_len)
    runner.initialize()
    return runner


def drive(runner: Any) -> dict[str, list[int]]:
    """Decode, chunked prefill, a prefix-cache hit, a seeded sampled request, preemption and
    resumption, then uniform decode steps (CUDA-graph replays on the GPU)."""
    plans = Plans(runner, 4, 64)
    pa, pb = prompts(2, seed=2, min_len=17, max_len=23)
    plans.add("a", pa, GREEDY)
    plans.run({"a": len(pa)})
    plans.add("b", pb, SEEDED)
    pc = pa[:12] + prompts(1, seed=3, min_len=5, max_len=5)[0]
    plans.add("c", pc, GREEDY, share_prefix_of="a", num_cached_blocks=3)
    plans.run({"a": 1, "b": 7, "c": len(pc) - 12})
    plans.run({"a": 1, "b": 6, "c": 1})
    plans.run({"b": len(pb) - 13, "a": 1, "c": 1})
    plans.preempt("a")
    plans.run({"b": 1, "c": 1})
    plans.run({"a": len(plans.reqs["a"].tokens), "b": 1})
    for _ in range(6):
        plans.run({"a": 1, "b": 1, "c": 1})
    return {rid: req.tokens for rid, req in plans.reqs.items()}


def check_runner_matches_torch(device: str, dtype: str, variant: str = "qwen3") -> Any:
    """Returns the gpu runner, so callers can inspect it (e.g. graph replays)."""
    model = tiny(variant)
    want = drive(make_runner(model.path, "torch", device, dtype))
    runner = make_runner(model.path, "gpu", device, dtype)
    got = drive(runner)
    for rid in want:
        assert got[rid] == want[rid], f"{variant} {dtype} request {rid}: gpu {got[rid]} != torch {want[rid]}"
    return runner


def _main() -> None:
    import sys

    for variant in sys.argv[1].split(","):
        check_runner_matches_torch("cpu", "float32", variant)
    print("ok runner")


if __name__ == "__main__":
    torch.manual_seed(0)
    _main()

"""The GPU backend on a CUDA device: every kernel against its torch reference in bf16 and float32
at model shapes, and end-to-end greedy outputs of the ``"gpu"`` runner (Triton kernels, CUDA
graphs) equal to the ``"torch"`` runner's on the same GPU, through chunked prefill, prefix-cache
hits and preemption (in bf16: equal up to a first difference that must be a near-tie, see
``runner_checks``). Skipped without CUDA."""

from __future__ import annotations

import kernel_checks as kc
import pytest
import runner_checks as rc
import torch
from hf_models import VARIANTS, prompts, tiny

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.float32, torch.bfloat16]

# Model shapes: qwen3-0.6b / llama3-8b attention (head_dim 128, GQA 2 and 4), contexts past 1k
# tokens, page size 16, flash-decoding splits.
LARGE_ATTENTION_CASES = [
    (16, 8, 128, 16, [1] * 7 + [300, 33], [1500, 20, 0, 700, 64, 1, 2047, 0, 129], 1),
    (16, 8, 128, 16, [1, 1], [3000, 17], 16),
    (32, 8, 128, 16, [5, 5, 5, 1], [900, 0, 31, 4000], 4),
    (32, 8, 128, 16, [1000], [24], 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("check", ["paged_attention", "kv_write", "rms_norm", "rotary", "qk_rope_cache",
                                   "silu_and_mul", "token_bitmask"])
def test_kernel_matches_torch_reference(check: str, dtype: torch.dtype) -> None:
    kc.ALL_CHECKS[check]("cuda", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_at_model_shapes(dtype: torch.dtype) -> None:
    kc.check_paged_attention("cuda", dtype, LARGE_ATTENTION_CASES)


def test_gumbel_sample_follows_softmax_and_matches_torch_sampler() -> None:
    kc.check_gumbel_sample("cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_runner_matches_torch_runner(variant: str, dtype: str) -> None:
    runner = rc.check_runner_matches_torch("cuda", dtype, variant)
    assert getattr(runner.parts.executor, "num_replays", 0) > 0, "decode steps did not use CUDA graphs"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_greedy_outputs_match_torch_backend(dtype: str) -> None:
    """Through the whole engine: 24 prompts, a shared prefix (prefix-cache hits), a small token
    budget (chunked prefill) and a KV cache too small for all of them (preemption). Equal in
    float32; in bf16 equal up to a near-tie (see ``runner_checks``)."""
    from specloop import LLM, SamplingParams

    model = tiny("qwen3")
    shared = prompts(1, seed=7, min_len=24, max_len=24)[0]
    batch = [shared + p if i % 3 == 0 else p for i, p in enumerate(prompts(24, seed=8, min_len=5, max_len=60))]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    for runner in ("torch", "gpu"):
        llm = LLM(model.path, model_runner=runner, device="cuda", dtype=dtype, skip_tokenizer_init=True,
                  block_size=4, num_kv_blocks=160, max_num_seqs=16, max_num_batched_tokens=64)
        outputs[runner] = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        stats = llm.get_metrics()
        llm.core.shutdown()
        del llm
        torch.cuda.empty_cache()
    for i, (prompt, got, want) in enumerate(zip(batch, outputs["gpu"], outputs["torch"])):
        rc.assert_same_or_near_tie(model.path, "cuda", dtype, prompt + list(got), prompt + list(want), f"prompt {i}")
    assert stats["num_preemptions"] > 0, "the KV cache was meant to be too small for every request"

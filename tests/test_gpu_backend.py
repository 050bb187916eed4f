"""The GPU backend on a CUDA device: every kernel against its torch reference in bf16 and float32
at model shapes (DeepSeek's MLA and MoE included), and end-to-end greedy outputs of the ``"gpu"``
runner (Triton kernels, CUDA graphs) equal to the ``"torch"`` runner's on the same GPU, through
chunked prefill, prefix-cache hits and preemption, and with MTP drafts equal to without them (in
bf16: equal up to a first difference that must be a near-tie, see ``runner_checks``). Skipped
without CUDA."""

from __future__ import annotations

import batch_invariance_checks as bic
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


# DeepSeek MLA at model shapes: V2-Lite (16 heads) and V3 (128), latent 512 + 64.
LARGE_MLA_CASES = [
    (16, 512, 64, 16, [1] * 7 + [300, 33], [1500, 20, 0, 700, 64, 1, 2047, 0, 129], 1),
    (16, 512, 64, 16, [1, 1], [3000, 17], 8),
    (128, 512, 64, 16, [2, 2, 2, 1], [900, 0, 31, 4000], 4),
    (128, 512, 64, 64, [200], [24], 1),
]
# DeepSeek-V2-Lite's experts (64 of 1408, top 6, hidden 2048) at decode and prefill batch sizes.
LARGE_MOE_CASES = [(1, 2048, 1408, 64, 6), (64, 2048, 1408, 64, 6), (700, 2048, 1408, 64, 6)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("check", ["paged_attention", "attention_rope", "kv_write", "rms_norm", "rotary",
                                   "qk_rope_cache", "silu_and_mul", "skinny_linear", "mla_attention", "mla_rope_cache", "fused_moe", "skinny_moe",
                                   "moe_route", "router_route", "token_bitmask", "argmax_rows", "matmul", "verify", "ngram"])
def test_kernel_matches_torch_reference(check: str, dtype: torch.dtype) -> None:
    kc.ALL_CHECKS[check]("cuda", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_at_model_shapes(dtype: torch.dtype) -> None:
    kc.check_paged_attention("cuda", dtype, LARGE_ATTENTION_CASES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mla_attention_at_model_shapes(dtype: torch.dtype) -> None:
    kc.ALL_CHECKS["mla_attention"]("cuda", dtype, LARGE_MLA_CASES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_moe_at_model_shapes(dtype: torch.dtype) -> None:
    kc.ALL_CHECKS["fused_moe"]("cuda", dtype, LARGE_MOE_CASES)


def test_gumbel_sample_follows_softmax_and_matches_torch_sampler() -> None:
    kc.check_gumbel_sample("cuda")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_runner_matches_torch_runner(variant: str, dtype: str) -> None:
    if dtype == "bfloat16" and variant.startswith("deepseek"):
        # Two kernels' bf16 roundings may pick different experts where two router scores nearly tie,
        # and that moves the output by a whole expert's difference, not by a near-tie: the float32
        # run checks this equivalence.
        pytest.skip("MoE routing parts at near-equal scores in bf16")
    runner = rc.check_runner_matches_torch("cuda", dtype, variant)
    assert getattr(runner.parts.executor, "num_replays", 0) > 0, "decode steps did not use CUDA graphs"
    # Mixed steps (chunked prefill beside decodes, a prefix hit, a resumed request) replay the
    # ragged graphs on dense-attention models.
    ragged = runner.parts.executor.num_ragged_replays
    assert (ragged > 0) is not variant.startswith("deepseek"), ragged


def test_decode_graphs_draw_the_torch_runners_tokens() -> None:
    rc.check_decode_graph_draws("cuda")


@pytest.mark.parametrize("options", [("rope_in_attention",), ("last_sums",), ("rope_in_attention", "last_sums")],
                         ids="+".join)
@pytest.mark.parametrize("variant", ["qwen3", "llama"])
def test_launch_options_decode_the_same_tokens(variant: str, options: tuple[str, ...]) -> None:
    rc.check_launch_options("cuda", variant, options)


def test_async_scheduling_matches_synchronous_torch_runner() -> None:
    rc.check_async_scheduling_matches_sync("cuda", "float32")


def test_an_async_engine_in_this_process_matches_the_offline_engine() -> None:
    rc.check_async_engine_matches_llm("cuda", "bfloat16")


def test_drafts_in_runs_with_async_scheduling_match_synchronous_torch_runner() -> None:
    rc.check_spec_async_matches_sync("cuda", "float32")


@pytest.mark.parametrize("variant", ["qwen3", "llama"])
def test_batch_invariant_mode_is_bit_identical_in_bf16(variant: str) -> None:
    """bf16 with CUDA graphs: tokens and logprobs alone, batched and verifying drafts, bit for bit."""
    bic.check_batch_invariance("cuda", "bfloat16", variant)


def test_structured_outputs_with_async_scheduling_match_synchronous_torch_runner() -> None:
    rc.check_structured_async_matches_sync("cuda", "float32", max_tokens=48)


def test_grammar_masks_reach_the_device_without_waiting_for_it() -> None:
    """The fast sampler stages a step's grammar masks and their rows with no synchronising copy
    (the host fills them while the step's forward still runs on the device: a blocking copy would
    idle the host until it ends), and masks exactly the rows the torch reference masks."""
    from types import SimpleNamespace

    from specloop.backends.gpu.fast_sampling import FastSamplingStage
    from specloop.backends.sampling_stage import SamplingStage
    from specloop.sampling.structured_outputs import GrammarBitmask, apply_token_bitmask_torch, num_words

    vocab, dev = 1000, torch.device("cuda")
    stage = FastSamplingStage(SamplingStage(torch.nn.Identity(), vocab, dev), SimpleNamespace(device=dev), 64)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, vocab, generator=g)
    masks = torch.randint(-2**31, 2**31 - 1, (4, num_words(vocab)), dtype=torch.int32, generator=g)
    batch = SimpleNamespace(req_ids=["a", "b", "c"], sample_rows=[(0, 1), (1, 2), (3, 3)])
    got = logits.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stage._apply_grammar(batch, got, GrammarBitmask(["a", "c"], [1, 3], masks.numpy()))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = logits.clone()
    apply_token_bitmask_torch(want, masks, torch.tensor([0, 3, 4, 5]))
    assert torch.equal(got.cpu(), want)


def test_admitted_requests_reach_the_device_without_waiting_for_it() -> None:
    """A step that admits requests sends their tokens, block tables and sampling parameters with no
    synchronising copy (under asynchronous scheduling the previous step's forward is still running),
    and they land where the batch reads them."""
    from specloop.backends.gpu.persistent_batch import PersistentBatch

    pb = PersistentBatch(max_reqs=4, max_len=64, block_size=16, max_tokens=64, device=torch.device("cuda"))
    pb._token_writes.append((2, 0, [7, 8, 9]))
    pb._block_writes.append((2, 0, [5, 6]))
    pb._param_writes.append((2, 0.5, 0.1, 1234))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pb.flush_writes()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pb.tokens[2, :3].tolist() == [7, 8, 9] and pb.block_table[2, :2].tolist() == [5, 6]
    assert (pb.temperature[2].item(), pb.seeds[2].item()) == (0.5, 1234)
    assert abs(pb.min_p[2].item() - 0.1) < 1e-7


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_keeps_greedy_output_on_the_gpu_runner(dtype: str, tmp_path) -> None:
    """The shipped DeepSeek-V3 model with its MTP layer (K = 3) on the gpu runner: drafts proposed
    with the Triton MLA and MoE kernels, verified in CUDA graphs; the output equals the output
    without drafts (float32). Also with a token map of half the vocabulary (the graphs draft
    through a copy of the head's rows)."""
    from pathlib import Path

    from specloop import LLM, SamplingParams

    path = str(Path(__file__).resolve().parent.parent / "default_models" / "specloop-tiny-mtp")
    token_map = str(tmp_path / "half.pt")
    torch.save(torch.randperm(8192, generator=torch.Generator().manual_seed(3))[:4096], token_map)
    batch = prompts(12, seed=9, min_len=8, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outputs = {}
    for name, spec in [("plain", None), ("mtp", {"method": "mtp", "num_speculative_tokens": 3}),
                       ("mapped", {"method": "mtp", "num_speculative_tokens": 3, "token_map": token_map})]:
        llm = LLM(path, device="cuda", dtype=dtype, skip_tokenizer_init=True, max_model_len=256, speculative_config=spec)
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]
        if spec is not None:
            # (the map holds about half of the tokens the target picks)
            assert llm.get_metrics()["spec_acceptance_rate"] > (0.2 if name == "mtp" else 0.05)
            assert llm.core.runner.parts.executor.num_replays > 0, "verification steps did not use CUDA graphs"
            proposer = llm.core.runner.drafter.proposer
            assert proposer.chain.num_replays > 0, "MTP draft steps did not replay CUDA graphs"
            assert sum(g.num_replays for g in proposer.feed_graphs.values()) > 0, \
                "the MTP layer's first step did not replay CUDA graphs"
            del proposer  # (it holds the engine's graphs and caches)
        llm.core.shutdown()
        del llm
        torch.cuda.empty_cache()
    for name in ("mtp", "mapped"):
        if dtype == "float32":
            assert outputs[name] == outputs["plain"], name
        else:
            # Verification (K + 1 tokens a request) and decode (1) round differently in bf16, and where
            # two experts' router scores nearly tie that can change an expert and part the sequences;
            # most must still agree throughout.
            same = sum(a == b for a, b in zip(outputs["plain"], outputs[name]))
            assert same >= len(batch) // 2, f"{name}: only {same} of {len(batch)} sequences equal"


@pytest.mark.parametrize("variant", ["qwen3", "deepseek_v3"])
def test_programmatic_dependent_launch_changes_no_bit(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``pdl`` option overlaps each kernel with the one before it (``kernels.pdl``); the same
    kernels then run the same sums, so a race (a kernel reading what its predecessor has not
    written yet) is the only way the outputs could differ. bf16, CUDA graphs, one request alone
    (the few-rows kernels) and eight together; token ids and logprobs bit for bit. The decode
    attention tile is fixed (timed at start-up, two engines could pick two tiles)."""
    from specloop.kernels import pdl

    results = _on_and_off(variant, "pdl", monkeypatch)
    assert pdl.enabled(torch.device("cuda")) == pdl.supported(torch.device("cuda"))  # the last engine's: on
    assert results[True] == results[False]


def test_shared_experts_beside_the_routing_change_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``moe_shared_stream`` option runs a one-token MoE's shared experts on a second stream
    while the router and the routing run (``kernels.skinny_moe.shared_beside_routing``), inside
    the decode graphs; the sums are the same, so only a missing wait between the streams could
    change an output. As the PDL test: bf16, one request alone and eight together, bit for bit."""
    from specloop.kernels import skinny_moe

    calls, beside = [], skinny_moe.shared_beside_routing
    monkeypatch.setattr(skinny_moe, "shared_beside_routing", lambda *a, **k: calls.append(1) or beside(*a, **k))
    results = _on_and_off("deepseek_v3", "moe_shared_stream", monkeypatch)
    assert calls, "no step ran the shared experts beside the routing"
    assert results[True] == results[False]


def _on_and_off(variant: str, option: str, monkeypatch: pytest.MonkeyPatch) -> dict[bool, list]:
    """Greedy outputs with logprobs of one request alone, then eight together, with the GPU
    option ``option`` off and then on (the decode attention tile fixed)."""
    from specloop import LLM, SamplingParams
    from specloop.backends.gpu.triton_attention import TritonAttentionBackend

    def first_tile(backend: TritonAttentionBackend, *args: object) -> None:
        backend.decode_config = backend.DECODE_CONFIGS[0]

    monkeypatch.setattr(TritonAttentionBackend, "tune_decode", first_tile)

    model = tiny(variant)
    batch = prompts(8, seed=21, min_len=5, max_len=200)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    results = {}
    for on in (False, True):
        llm = LLM(model.path, device="cuda", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=512,
                  plugin_options={"gpu": {option: on}})
        alone = llm.generate([batch[0]], params, use_tqdm=False)
        together = llm.generate(batch, params, use_tqdm=False)
        results[on] = [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob, o.outputs[0].logprobs)
                       for o in alone + together]
        assert llm.core.runner.parts.executor.num_replays > 0, "the decode steps did not replay CUDA graphs"
        llm.core.shutdown()
        del llm
        torch.cuda.empty_cache()
    return results

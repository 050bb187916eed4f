"""The torch model runner against transformers, driven by hand-built plans: every scheduled
token's logits must equal HF's at that position, for prefills, chunked prefills, prefix-cache hits,
decodes, preemption/resumption and draft verification, alone and mixed in one batch."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hf_models import VARIANTS, make_runner, prompts, tiny
from plans import Plans

from specloop.kernel.config import EngineConfig
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.outputs import ModelRunnerOutput
from specloop.kernel.plugins import PluginManager
from specloop.kernel.sampling_params import SamplingParams
from specloop.proposers.base import DraftProposal, Proposer, ProposerInputs

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=100)


def checked_step(plans: Plans, model: Any, counts: dict[str, int], spec: dict[str, list[int]] | None = None,
                 ) -> ModelRunnerOutput:
    """Run one plan, comparing the logits of every scheduled token with HF's, then commit."""
    spec = spec or {}
    plan = plans.plan(counts, spec)
    runner = plans.runner
    runner.execute_model(plan)
    logits = runner.compute_logits(runner.executed.hidden_states)
    row = 0
    for rid, n in counts.items():
        req = plans.reqs[rid]
        seq = req.tokens + spec.get(rid, [])
        start = req.num_computed
        expected = model.logits(seq[:start + n])[start:]
        torch.testing.assert_close(logits[row:row + n], expected, atol=ATOL, rtol=0)
        row += n
    result = runner.sample_tokens()
    plans.commit(plan, result)
    return result


@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_prompt_matches_hf(name: str) -> None:
    model = tiny(name)
    runner = make_runner(model)
    plans = Plans(runner, 4, 64)
    prompt = prompts(1, seed=1)[0]
    plans.add("a", prompt, GREEDY)
    result = checked_step(plans, model, {"a": len(prompt)})
    for _ in range(5):
        result = checked_step(plans, model, {"a": 1})
    assert result.sampled_token_ids == [plans.reqs["a"].tokens[-1:]]
    assert plans.reqs["a"].tokens[len(prompt):] == model.greedy(prompt, 6)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_mixed_batch_chunks_prefix_hits_and_preemption(name: str) -> None:
    """One batch mixing a decode, a chunked prefill and a prefix-cache hit; then a request is
    preempted mid-decode and resumed (recomputed from scratch into other blocks)."""
    model = tiny(name)
    runner = make_runner(model)
    plans = Plans(runner, 4, 64)
    pa, pb = prompts(2, seed=2, min_len=17, max_len=23)
    plans.add("a", pa, GREEDY)
    checked_step(plans, model, {"a": len(pa)})
    plans.add("b", pb, GREEDY)
    # c shares a's first three full blocks (12 tokens) and computes only the rest of its prompt.
    pc = pa[:12] + prompts(1, seed=3, min_len=5, max_len=5)[0]
    plans.add("c", pc, GREEDY, share_prefix_of="a", num_cached_blocks=3)
    out = checked_step(plans, model, {"a": 1, "b": 7, "c": len(pc) - 12})
    assert out.req_ids == ["a", "b", "c"] and out.sampled_token_ids[1] == []  # b's prefill is partial
    checked_step(plans, model, {"a": 1, "b": 6, "c": 1})
    checked_step(plans, model, {"b": len(pb) - 13, "a": 1, "c": 1})
    plans.preempt("a")
    checked_step(plans, model, {"b": 1, "c": 1})
    checked_step(plans, model, {"a": len(plans.reqs["a"].tokens), "b": 1})  # resumed: prompt + outputs
    checked_step(plans, model, {"a": 1, "b": 1, "c": 1})
    for rid, prompt in (("a", pa), ("b", pb), ("c", pc)):
        req = plans.reqs[rid]
        assert req.tokens[len(prompt):] == model.greedy(prompt, len(req.tokens) - len(prompt))


@pytest.mark.parametrize("chunk", [1, 3, 8, 13])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_chunked_prefill_at_several_chunk_sizes(name: str, chunk: int) -> None:
    model = tiny(name)
    runner = make_runner(model)
    plans = Plans(runner, 4, 64)
    prompt = prompts(1, seed=4, min_len=26, max_len=26)[0]
    plans.add("a", prompt, GREEDY)
    done = 0
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)
        out = checked_step(plans, model, {"a": n})
        done += n
        assert out.sampled_token_ids == [[]] if done < len(prompt) else len(out.sampled_token_ids[0]) == 1
    assert plans.reqs["a"].tokens[len(prompt):] == model.greedy(prompt, 1)


@pytest.mark.parametrize("name", ["llama", "qwen3_tied"])
def test_draft_verification(name: str) -> None:
    """Drafts equal to HF's greedy continuation are all accepted plus a bonus token; a wrong draft
    is replaced by the target's token and the drafts after it are dropped. Logits at every draft
    position match HF's over the drafted sequence."""
    model = tiny(name)
    runner = make_runner(model)
    plans = Plans(runner, 4, 64)
    prompt = prompts(1, seed=5)[0]
    truth = model.greedy(prompt, 12)
    plans.add("a", prompt, GREEDY)
    checked_step(plans, model, {"a": len(prompt)})
    out = checked_step(plans, model, {"a": 4}, spec={"a": truth[1:4]})
    assert out.sampled_token_ids == [truth[1:5]]
    # The scheduler counts accepted drafts as the sampled tokens before the target's own one.
    assert len(out.sampled_token_ids[0]) - 1 == 3
    wrong = [truth[5], (truth[6] + 1) % 512, truth[7]]
    out = checked_step(plans, model, {"a": 4}, spec={"a": wrong})
    assert out.sampled_token_ids == [truth[5:7]]
    assert len(out.sampled_token_ids[0]) - 1 == 1
    checked_step(plans, model, {"a": 1})  # rejected drafts' KV is overwritten
    assert plans.reqs["a"].tokens[len(prompt):] == truth[:8]


def test_logprobs_and_prompt_logprobs_match_hf_log_softmax() -> None:
    model = tiny("qwen2")
    runner = make_runner(model)
    plans = Plans(runner, 4, 64)
    prompt = prompts(1, seed=6, min_len=15, max_len=15)[0]
    plans.add("a", prompt, SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2))
    plans.add("b", prompts(1, seed=7)[0], GREEDY)
    entries: list = []
    sampled_lp = []
    out = checked_step(plans, model, {"a": 6, "b": len(plans.reqs["b"].prompt)})
    entries += out.prompt_logprobs["a"]
    # only b sampled, and it asked for no logprobs
    assert "b" not in out.prompt_logprobs and out.logprobs is None and out.sampled_token_ids[0] == []
    out = checked_step(plans, model, {"a": 9})
    entries += out.prompt_logprobs["a"]
    sampled_lp += out.logprobs[0]
    for _ in range(3):
        out = checked_step(plans, model, {"a": 1})
        sampled_lp += out.logprobs[0]
        assert out.prompt_logprobs == {"a": []}
    seq = plans.reqs["a"].tokens
    ref = model.logits(seq).log_softmax(-1)
    assert entries[0] is None and len(entries) == len(prompt)
    for i, e in enumerate(entries[1:], start=1):
        assert e.token_id == prompt[i]
        assert abs(e.logprob - ref[i - 1, prompt[i]].item()) < ATOL
        assert e.rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1
        assert e.top_token_ids == ref[i - 1].topk(2).indices.tolist()
    for j, e in enumerate(sampled_lp):
        pos = len(prompt) - 1 + j
        assert e.token_id == seq[pos + 1] and e.rank == 1  # greedy picks the top token
        assert abs(e.logprob - ref[pos].max().item()) < ATOL
        torch.testing.assert_close(torch.tensor(e.top_logprobs), ref[pos].topk(3).values, atol=ATOL, rtol=0)
    cumulative = sum(e.logprob for e in sampled_lp)
    expected = sum(ref[len(prompt) - 1 + j, t].item() for j, t in enumerate(seq[len(prompt):]))
    assert abs(cumulative - expected) < ATOL * len(sampled_lp)


class _RecordingProposer(Proposer):
    """Proposes HF's next tokens from a fixed table and records what it was given."""

    needs_hidden_states = True
    hidden_state_layers = (0, 2)
    seen: list[ProposerInputs] = []

    def propose(self, inputs: ProposerInputs) -> DraftProposal:
        type(self).seen.append(inputs)
        return DraftProposal([[7, 8] for _ in inputs.req_ids])


class _ProposerPlugin:
    @hookimpl
    def specloop_register_proposers(self, register: Any) -> None:
        register("recording", _RecordingProposer)


def test_proposer_seam_gets_hidden_states_and_returns_drafts() -> None:
    model = tiny("qwen3")
    plugins = PluginManager([_ProposerPlugin()], load_entrypoints=False)
    cfg = EngineConfig(model=model.path, block_size=4, num_kv_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2})
    cfg.speculative_config.method = "recording"
    runner = plugins.model_runners.create("torch", config=cfg, plugins=plugins)
    cfg.resolve(runner.model_max_len)
    runner.initialize()
    plans = Plans(runner, 4, 64)
    pa, pb = prompts(2, seed=8, min_len=9, max_len=9)
    plans.add("a", pa, GREEDY)
    plans.add("b", pb, GREEDY)
    _RecordingProposer.seen.clear()
    plan, out = plans.run({"a": 9, "b": 4})  # b's prefill is partial: not proposed for
    inputs = _RecordingProposer.seen[-1]
    assert inputs.req_ids == ["a"] and inputs.num_sampled.tolist() == [1]
    assert inputs.token_ids[0].tolist() == pa + out.sampled_token_ids[0]
    hf = model.hf(torch.tensor([pa]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(inputs.hidden_states, hf[-1][0], atol=ATOL, rtol=0)  # post-norm
    torch.testing.assert_close(inputs.aux_hidden_states[0], hf[0][0], atol=ATOL, rtol=0)  # embeddings
    assert inputs.query_start_loc.tolist() == [0, 9] and inputs.sampled_rows.tolist() == [8]
    assert inputs.positions.tolist() == list(range(9))
    drafts = runner.take_draft_token_ids()
    assert drafts.req_ids == ["a"] and drafts.draft_token_ids == [[7, 8]]
    assert runner.take_draft_token_ids() is None


def test_kv_cache_sizing() -> None:
    model = tiny("llama")
    per_block = 2 * 2 * 4 * 2 * 16 * 4  # K and V, 2 layers, block 4, 2 kv heads, head dim 16, float32
    assert make_runner(model, num_kv_blocks=10).kv_caches[0].shape == (2, 10, 4, 2, 16)
    runner = make_runner(model, num_kv_blocks=None, kv_cache_memory=per_block * 37 + 5)
    assert runner.kv_bytes_per_block() == per_block and runner.kv_caches[0].shape[1] == 37
    # The CPU default is capped at max_num_seqs full-length sequences.
    runner = make_runner(model, num_kv_blocks=None, max_num_seqs=3, max_model_len=40)
    assert runner.kv_caches[0].shape[1] == 3 * 10 + 1
    with pytest.raises(ValueError, match="smaller than one block"):
        make_runner(model, num_kv_blocks=None, kv_cache_memory=per_block - 1)


def test_prompt_logprobs_are_reported_once_across_preemption() -> None:
    model = tiny("llama")
    runner = make_runner(model)
    plans = Plans(runner, 4, 64)
    prompt = prompts(1, seed=9, min_len=14, max_len=14)[0]
    plans.add("a", prompt, SamplingParams(temperature=0.0, prompt_logprobs=0))
    entries = list(plans.run({"a": 5})[1].prompt_logprobs["a"])
    entries += plans.run({"a": 4})[1].prompt_logprobs["a"]
    plans.preempt("a")
    _, out = plans.run({"a": 14})  # recomputed from scratch: only tokens 10..13 are new
    assert [e.token_id for e in out.prompt_logprobs["a"]] == prompt[10:]
    entries += out.prompt_logprobs["a"]
    ref = model.logits(prompt).log_softmax(-1)
    assert entries[0] is None and [e.token_id for e in entries[1:]] == prompt[1:]
    for i, e in enumerate(entries[1:], start=1):
        assert abs(e.logprob - ref[i - 1, prompt[i]].item()) < ATOL and e.top_token_ids == []
    plans.finish("a")
    plans.add("a", prompt, SamplingParams(temperature=0.0, prompt_logprobs=0))  # the id is reused
    assert len(plans.run({"a": 14})[1].prompt_logprobs["a"]) == 14


def test_gpu_runner_options_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gpu runner's options take effect or are refused by name (no key silently ignored)."""
    from specloop.backends.gpu.platform import GpuPlatform

    platform = GpuPlatform(EngineConfig(plugin_options={"gpu": {"device_proposals": False, "cuda_graphs": False}}))
    assert platform.device_proposals is False and platform.cuda_graphs is False
    assert GpuPlatform(EngineConfig()).device_proposals is True
    with pytest.raises(ValueError, match="unknown option.*'cuda_graph'.*known: fused, cuda_graphs"):
        GpuPlatform(EngineConfig(plugin_options={"gpu": {"cuda_graph": False}}))
    # skinny_gemv switches every linear layer of the target to the few-rows kernel (on by default on
    # CUDA only, and never by default with batch_invariant).
    from torch import nn

    from specloop.backends.gpu.platform import use_few_rows_linear
    from specloop.kernels.gemv import few_rows_linear
    from specloop.models.parallel import ColumnParallelLinear, RowParallelLinear, Shard

    assert GpuPlatform(EngineConfig()).graph_sampling is True
    assert GpuPlatform(EngineConfig(plugin_options={"gpu": {"graph_sampling": False}})).graph_sampling is False
    # Off until measured faster on a GPU: rotary inside decode attention, split sums by the last program.
    assert not GpuPlatform(EngineConfig()).rope_in_attention and not GpuPlatform(EngineConfig()).last_sums
    on = GpuPlatform(EngineConfig(plugin_options={"gpu": {"rope_in_attention": True, "last_sums": True}}))
    assert on.rope_in_attention and on.last_sums
    assert GpuPlatform(EngineConfig(device="cpu")).skinny_gemv is False
    assert GpuPlatform(EngineConfig(device="cuda")).skinny_gemv is True
    assert GpuPlatform(EngineConfig(device="cuda", batch_invariant=True)).skinny_gemv is False
    assert GpuPlatform(EngineConfig(plugin_options={"gpu": {"skinny_gemv": True}})).skinny_gemv is True
    model = nn.Sequential(ColumnParallelLinear(8, [Shard(16, 0, 16)], bias=False), RowParallelLinear(16, 8, bias=False))
    assert use_few_rows_linear(model) == 2 and all(m.matmul is few_rows_linear for m in model)
    with pytest.raises(ValueError, match="skinny_gemv.*batch_invariant"):
        GpuPlatform(EngineConfig(plugin_options={"gpu": {"skinny_gemv": True}}, batch_invariant=True))
    # skinny_rows: the most rows a step the few-rows kernels take, 1 to MAX_ROWS; by default (None)
    # two for a model of small projections (where programmatic dependent launch pays), else one.
    from specloop.backends.gpu import platform
    from specloop.kernels import gemv, pdl

    # decode_tile: the decode attention tile given (one of the backend's), not timed at start-up.
    from specloop.backends.gpu.triton_attention import TritonAttentionBackend

    assert GpuPlatform(EngineConfig()).decode_tile is None
    for tile in TritonAttentionBackend.DECODE_CONFIGS:
        assert GpuPlatform(EngineConfig(plugin_options={"gpu": {"decode_tile": list(tile)}})).decode_tile == tile
    for bad in ([16, 4, 2], 128, "128,4,2"):
        with pytest.raises(ValueError, match="decode_tile.*must be one of"):
            GpuPlatform(EngineConfig(plugin_options={"gpu": {"decode_tile": bad}}))
    import runner_checks

    runner = runner_checks.make_runner(tiny("qwen3").path, "gpu", "cpu", "float32",
                                       plugin_options={"gpu": {"decode_tile": [32, 4, 2]}})
    assert runner.attn_backend.decode_config == (32, 4, 2)
    runner.shutdown()
    # moe_down_groups: programs over a token's experts in the one-token MoE's down kernel, 1 to 64.
    from specloop.kernels import moe_route, skinny_moe

    assert GpuPlatform(EngineConfig()).moe_down_groups is None  # MOE_DOWN_GROUPS where the kernel runs
    for bad in (0, 65, 2.0, True, "4"):
        with pytest.raises(ValueError, match="moe_down_groups'\\] must be an integer from 1 to 64"):
            GpuPlatform(EngineConfig(plugin_options={"gpu": {"moe_down_groups": bad}}))
    try:
        runner = runner_checks.make_runner(tiny("deepseek_v3").path, "gpu", "cpu", "float32",
                                           plugin_options={"gpu": {"moe_down_groups": 4, "skinny_gemv": True}})
        runner.shutdown()
        assert skinny_moe._down_groups == 4
        runner = runner_checks.make_runner(tiny("deepseek_v3").path, "gpu", "cpu", "float32",
                                           plugin_options={"gpu": {"skinny_gemv": True}})
        runner.shutdown()
        assert skinny_moe._down_groups == platform.MOE_DOWN_GROUPS == 8
        runner = runner_checks.make_runner(tiny("qwen3").path, "gpu", "cpu", "float32",
                                           plugin_options={"gpu": {"skinny_gemv": True}})
        runner.shutdown()
        assert skinny_moe._down_groups == 1
    finally:
        skinny_moe.set_down_groups(1)
    for variant, options in (("qwen3", {"skinny_gemv": True}), ("deepseek_v3", {"skinny_gemv": False})):
        with pytest.raises(ValueError, match="moe_down_groups.*which this engine does not run"):
            runner_checks.make_runner(tiny(variant).path, "gpu", "cpu", "float32",
                                      plugin_options={"gpu": {"moe_down_groups": 4, **options}})
    # moe_shared_stream (a one-token MoE's shared experts beside its routing) and fused_routing (its
    # router and routing in one kernel): on by default, set on the kernels' module as the parts are
    # built, refused without the few-rows kernels and, given True, for a model without experts.
    for option, state, set_state in (("moe_shared_stream", skinny_moe.shared_stream, skinny_moe.set_shared_stream),
                                     ("fused_routing", moe_route.fused, moe_route.set_fused)):
        assert getattr(GpuPlatform(EngineConfig(device="cuda")), option) is True
        with pytest.raises(ValueError, match=f"{option}.*skinny_gemv is off"):
            GpuPlatform(EngineConfig(device="cpu", plugin_options={"gpu": {option: True}}))
        try:
            runner = runner_checks.make_runner(tiny("deepseek_v3").path, "gpu", "cpu", "float32",
                                               plugin_options={"gpu": {option: False, "skinny_gemv": True}})
            runner.shutdown()
            assert state() is False, option
        finally:
            set_state(True)
        with pytest.raises(ValueError, match=f"{option}.*which this engine does not (have|run)"):  # no experts
            runner_checks.make_runner(tiny("qwen3").path, "gpu", "cpu", "float32",
                                      plugin_options={"gpu": {option: True, "skinny_gemv": True}})
    with pytest.raises(ValueError, match="decode_tile.*does not tune"):  # latent attention has its own tile
        runner_checks.make_runner(tiny("deepseek_v3").path, "gpu", "cpu", "float32",
                                  plugin_options={"gpu": {"decode_tile": [32, 4, 2]}})
    assert GpuPlatform(EngineConfig(device="cuda")).skinny_rows is None
    cpu = torch.device("cpu")
    assert platform.default_skinny_rows(model, cpu) == gemv.ROUTED_ROWS == 1
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    monkeypatch.setattr(pdl, "prefetch_budget", lambda device: 16 * 8 * 4)  # both float32 weights fit
    assert platform.default_skinny_rows(model, cpu) == gemv.SMALL_ROUTED_ROWS == 2
    monkeypatch.setattr(pdl, "prefetch_budget", lambda device: 16 * 8 * 4 - 1)
    assert platform.default_skinny_rows(model, cpu) == 1
    assert GpuPlatform(EngineConfig(device="cuda", plugin_options={"gpu": {"skinny_rows": 4}})).skinny_rows == 4
    for bad in (0, gemv.MAX_ROWS + 1, 2.0, True, "4"):
        with pytest.raises(ValueError, match="skinny_rows.*integer from 1 to 16"):
            GpuPlatform(EngineConfig(device="cuda", plugin_options={"gpu": {"skinny_rows": bad}}))
    with pytest.raises(ValueError, match="skinny_rows.*skinny_gemv is off"):
        GpuPlatform(EngineConfig(device="cpu", plugin_options={"gpu": {"skinny_rows": 4}}))
    try:  # the process's routing, which a runner sets as it builds its parts
        gemv.set_routed_rows(4)
        assert gemv.routed_rows() == 4
        with pytest.raises(ValueError, match="1 to 16"):
            gemv.set_routed_rows(17)
    finally:
        gemv.set_routed_rows(gemv.ROUTED_ROWS)


def test_the_device_batch_knows_the_blocks_each_request_holds() -> None:
    # A proposal graph launched after a verification writes its drafts' KV only where a request
    # holds blocks: the persistent batch keeps each slot's count on the device, through added,
    # grown and reused slots; padding rows (the spare slot) hold none.
    from specloop import SamplingParams
    from specloop.backends.gpu.persistent_batch import PersistentBatch
    from specloop.backends.requests import CachedRequestState

    batch = PersistentBatch(max_reqs=4, max_len=64, block_size=4, max_tokens=64, device=torch.device("cpu"))

    def state(rid: str, blocks: list[int]) -> CachedRequestState:
        return CachedRequestState(rid, [1, 2, 3], [1, 2, 3], 3, SamplingParams(), blocks, 0, 0)

    a, b = state("a", [3, 4]), state("b", [7])
    batch.add(a)
    batch.add(b)
    batch.flush_writes()
    b.block_ids = [7, 8, 9]
    batch.update_running(b)
    slot_a = batch.slots["a"]
    batch.remove("a")
    batch.add(state("c", [1]))
    batch.flush_writes()
    assert batch.slots["c"] == slot_a  # a reused slot: its count is the new request's
    batch.req_slots[:3] = torch.tensor([batch.slots["b"], batch.slots["c"], batch.spare], dtype=torch.int32)
    assert batch.writable(3).tolist() == [12, 4, 0]


def test_target_graphs_are_chosen_by_shape() -> None:
    # The GPU runner's graph executor (no capture here: the keys it would replay): a uniform batch
    # takes the graph of its q and the smallest padded size that holds it; any other step the
    # ragged graph of the smallest padded token count that holds it; larger steps, and every
    # non-uniform step when ragged graphs are off (latent attention, MoE, batch-invariant mode),
    # none.
    from specloop.backends.executor import GraphKey
    from specloop.backends.gpu.graphs import GraphExecutor
    from specloop.backends.gpu.persistent_batch import PersistentBatch
    from specloop.kernel.outputs import SchedulerOutput

    batch = PersistentBatch(max_reqs=8, max_len=96, block_size=4, max_tokens=512, device=torch.device("cpu"))

    def plan(counts: list[int]) -> SchedulerOutput:
        tokens = {f"r{i}": n for i, n in enumerate(counts)}
        return SchedulerOutput(0, [], [], [], tokens, sum(counts))

    for ragged in (True, False):
        eager = SimpleNamespace(model=torch.nn.Linear(2, 2), aux_layers=())
        graphs = GraphExecutor(eager, batch, [1, 2, 3], 16, 32, lambda *_: 1, ragged=ragged)  # type: ignore[arg-type]
        assert graphs.ragged == ([128, 256, 384, 512] if ragged else [])
        graphs.graphs = {**{(q, s): None for q in (1, 2, 3) for s in graphs.sizes},
                         **{(0, t): None for t in graphs.ragged}}
        graphs.splits = dict.fromkeys(graphs.graphs, 1)
        assert graphs.graph_for(plan([1] * 3)) == GraphKey(1, 4, 1)
        assert graphs.graph_for(plan([3] * 8)) == GraphKey(3, 8, 1)
        mixed = graphs.graph_for(plan([1, 1, 200]))
        assert mixed == (GraphKey(0, 8, 1, 256) if ragged else None)
        assert graphs.graph_for(plan([5, 5])) == (GraphKey(0, 8, 1, 128) if ragged else None)
        assert graphs.graph_for(plan([1, 600])) is None
        assert graphs.max_tokens == (512 if ragged else 24)


def test_long_context_decode_graphs_split_more_and_replay_over_long_contexts() -> None:
    """The gpu runner's ``long_context_graphs`` option: the decode graphs of sizes whose sequences
    fill the chip alone (one split) get a variant with more splits, replayed when the step's
    longest context gives each split two 64-key tiles (qwen3-0.6b's 8 KV heads, 132 SMs)."""
    import functools

    from specloop.backends.executor import GraphKey
    from specloop.backends.gpu.graphs import GraphExecutor
    from specloop.backends.gpu.persistent_batch import PersistentBatch
    from specloop.backends.gpu.triton_attention import TritonAttentionBackend
    from specloop.kernel.outputs import SchedulerOutput

    backend, mc = TritonAttentionBackend(), SimpleNamespace(num_kv_heads=8, mla=None)
    backend.num_sms = 132
    batch = PersistentBatch(max_reqs=96, max_len=2048, block_size=16, max_tokens=512, device=torch.device("cpu"))
    eager = SimpleNamespace(model=torch.nn.Linear(2, 2), aux_layers=())
    short = functools.partial(backend.decode_splits, mc)
    assert [short(s, 2048) for s in (1, 16, 32, 96)] == [16, 4, 1, 1]
    off = GraphExecutor(eager, batch, [1, 2], 16, 32, short)  # type: ignore[arg-type]
    assert off.long_variants() == {}
    graphs = GraphExecutor(eager, batch, [1, 2], 16, 32, short,  # type: ignore[arg-type]
                           long_splits=functools.partial(backend.long_decode_splits, mc))
    assert graphs.sizes == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96]
    assert graphs.long_variants() == {32: 8, 48: 4, 64: 4, 80: 4}  # 96: 2 splits, not worth a graph
    graphs.long = graphs.long_variants()
    graphs.graphs = {(q, s): None for q in (1, 2) for s in graphs.sizes}
    graphs.splits = dict.fromkeys(graphs.graphs, 1)
    plan = SchedulerOutput(0, [], [], [], {f"r{i}": 1 for i in range(20)}, 20)
    assert graphs.graph_for(plan, lambda: 1023) == GraphKey(1, 32, 1)
    assert graphs.graph_for(plan, lambda: 1024) == GraphKey(1, 32, 8, long=True)
    assert graphs.graph_for(plan) == GraphKey(1, 32, 1)  # no context given: the graph of the size
    verify = SchedulerOutput(0, [], [], [], {f"r{i}": 2 for i in range(20)}, 40)
    assert graphs.graph_for(verify, lambda: 4096) == GraphKey(2, 32, 1)  # decode graphs only
    small = SchedulerOutput(0, [], [], [], {f"r{i}": 1 for i in range(9)}, 9)
    assert graphs.graph_for(small, lambda: 4096) == GraphKey(1, 16, 1)  # 16 splits itself


def test_programmatic_dependent_launch_is_chosen_where_it_pays(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gpu runner's ``pdl`` option: explicit True/False, or (default) on for a model whose
    projections past the bytes a kernel may prefetch hold at most a quarter of the projections'
    bytes, on a device that has it; never on a CPU."""
    from torch import nn

    from specloop.backends.gpu.platform import GpuPlatform, pdl_pays
    from specloop.kernels import pdl
    from specloop.models.parallel import ColumnParallelLinear, RowParallelLinear, Shard

    assert GpuPlatform(EngineConfig()).pdl is None
    assert GpuPlatform(EngineConfig(plugin_options={"gpu": {"pdl": False}})).pdl is False
    model = nn.Sequential(ColumnParallelLinear(8, [Shard(16, 0, 16)], bias=False), RowParallelLinear(16, 8, bias=False))
    cpu = torch.device("cpu")
    assert pdl_pays(model, cpu) is False and pdl.launch_options(cpu) == {"PDL": False}
    monkeypatch.setattr(pdl, "supported", lambda device: True)
    monkeypatch.setattr(pdl, "prefetch_budget", lambda device: 16 * 8 * 4)  # both float32 weights: 512 bytes
    assert pdl_pays(model, cpu) is True
    monkeypatch.setattr(pdl, "prefetch_budget", lambda device: 16 * 8 * 4 - 1)
    assert pdl_pays(model, cpu) is False
    # Only the decoder layers' projections count: not an LM head after them, whichever class holds it
    # (DeepSeek's is a ReplicatedLinear, Llama's a ParallelLMHead).
    from specloop.models.parallel import ReplicatedLinear

    lm = nn.Module()
    lm.layers, lm.lm_head = nn.ModuleList([model]), ReplicatedLinear(8, 1024, bias=False)
    monkeypatch.setattr(pdl, "prefetch_budget", lambda device: 16 * 8 * 4)
    assert pdl_pays(lm, cpu) is True
    lm.layers.append(ReplicatedLinear(8, 17, bias=False))  # 544 bytes, past the budget: 52% of them
    assert pdl_pays(lm, cpu) is False
    # A few projections past the budget (DeepSeek's dense first layer): on while they hold at most a
    # quarter of the bytes.
    lm.layers.extend(ReplicatedLinear(8, 16, bias=False) for _ in range(3))  # 3 x 512 within: 544 of 2,592 past
    assert pdl_pays(lm, cpu) is True
    lm.layers.append(ReplicatedLinear(8, 17, bias=False))  # 1,088 of 3,136
    assert pdl_pays(lm, cpu) is False
    pdl.set_enabled(True)
    try:
        assert pdl.launch_options(cpu) == {"PDL": True, "launch_pdl": True}
    finally:
        pdl.set_enabled(False)


def test_kv_budget_on_a_cpu_follows_gpu_memory_utilization(monkeypatch) -> None:
    """On a CPU the KV cache is 512 MiB unless ``gpu_memory_utilization`` is given, when it is what
    that fraction of the machine leaves after what is in use; either way no more than ``max_num_seqs``
    full sequences need. Given beside an explicit size, the fraction would do nothing: any engine
    refuses it."""
    from specloop.backends import kv_memory

    gib, per_block = 1 << 30, 1 << 20
    monkeypatch.setattr(kv_memory, "host_memory", lambda: (8 * gib, 6 * gib))  # 2 GiB in use

    def blocks(**kw: Any) -> int:
        config = EngineConfig(**{"max_model_len": 1024, "max_num_seqs": 256, **kw})
        return kv_memory.num_kv_blocks(config, torch.device("cpu"), per_block, 16, lambda: None)

    assert blocks() == 512  # 512 MiB
    assert blocks(gpu_memory_utilization=0.5) == 2 * 1024  # 6 GiB available less the 4 GiB left to the rest
    assert blocks(gpu_memory_utilization=0.9) == 5324  # 6 GiB less 0.8 GiB: 5,324.8 MiB
    assert blocks(gpu_memory_utilization=0.9, max_num_seqs=2) == 2 * 64 + 1  # what two sequences need
    with pytest.raises(ValueError, match="smaller than one block.*gpu_memory_utilization"):
        blocks(gpu_memory_utilization=0.2)  # 6 GiB available, 6.4 GiB to leave
    from specloop import LLM

    for size in ({"num_kv_blocks": 100}, {"kv_cache_memory": gib}):  # refused before anything loads
        with pytest.raises(ValueError, match=f"gpu_memory_utilization has no effect when {next(iter(size))}"):
            LLM(model_runner="scripted", skip_tokenizer_init=True, gpu_memory_utilization=0.5, **size)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_host_memory_keeps_within_a_cgroup_limit(monkeypatch) -> None:
    """A CPU engine's fraction is of the memory the process may use: the machine's, or its
    container's limit (cgroup v2) less what the container uses, whichever is smaller."""
    import io

    from specloop.backends import kv_memory

    gib = 1 << 30
    files = {"/proc/meminfo": f"MemTotal: {8 * gib // 1024} kB\nMemFree: 1 kB\nMemAvailable: {6 * gib // 1024} kB\n",
             "/sys/fs/cgroup/memory.max": f"{4 * gib}\n", "/sys/fs/cgroup/memory.current": f"{gib}\n"}

    def fake_open(path: str, *args: Any, **kwargs: Any) -> io.StringIO:
        if path not in files:
            raise FileNotFoundError(path)
        return io.StringIO(files[path])

    monkeypatch.setattr(kv_memory, "open", fake_open, raising=False)
    assert kv_memory.host_memory() == (4 * gib, 3 * gib)
    files["/sys/fs/cgroup/memory.max"] = "max\n"  # no limit
    assert kv_memory.host_memory() == (8 * gib, 6 * gib)
    del files["/sys/fs/cgroup/memory.max"]  # no cgroup v2
    assert kv_memory.host_memory() == (8 * gib, 6 * gib)

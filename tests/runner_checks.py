"""The ``"gpu"`` model runner against the ``"torch"`` runner on the same device and dtype.

float32: the token sequences must be equal. bfloat16: two different kernels cannot round alike
everywhere (the torch attention rounds its scores to bf16, cuBLAS picks other algorithms for
padded batch sizes), so greedy sequences must be equal up to their first difference, and that
difference must be a near-tie: re-scored by the torch runner, the token it chose beats the gpu
runner's by less than ``BF16_TIE`` of the largest logit. A wrong position, mask or cache slot fails
that at once; rounding does not.

Shared by ``test_triton_kernels.py`` (CPU, in a child process under ``TRITON_INTERPRET=1``) and
``test_gpu_backend.py`` (CUDA, with graphs). Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

import pytest
import torch
from hf_models import prompts, tiny
from eager_graphs import eager_captures, eager_target_graphs
from plans import Plans
import fast_interpreter

from specloop.kernel.config import EngineConfig
from specloop.kernel.plugins import PluginManager
from specloop.kernel.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=100)
SEEDED = SamplingParams(temperature=0.8, min_p=0.05, seed=5, max_tokens=100)
BF16_TIE = 0.02


fast_interpreter.install()  # a no-op unless TRITON_INTERPRET=1


def make_runner(path: str, name: str, device: str, dtype: str, **config: Any) -> Any:
    """A runner driven step by step by ``Plans``, which commits each step's tokens before planning
    the next: synchronous scheduling unless asked otherwise (asynchronous scheduling is checked
    through the engine, in ``check_async_scheduling_matches_sync``)."""
    config.setdefault("async_scheduling", False)
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


def torch_logits_at_end(path: str, device: str, dtype: str, tokens: list[int]) -> torch.Tensor:
    """The torch runner's logits after ``tokens`` (one prefill)."""
    runner = make_runner(path, "torch", device, dtype)
    plans = Plans(runner, 4, 64)
    plans.add("x", list(tokens), GREEDY)
    runner.execute_model(plans.plan({"x": len(tokens)}))
    return runner.compute_logits(runner.executed.hidden_states)[-1].float().cpu()


def assert_same_or_near_tie(path: str, device: str, dtype: str, got: list[int], want: list[int], label: str) -> None:
    if got == want:
        return
    assert dtype == "bfloat16", f"{label}: gpu {got} != torch {want}"
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert k < min(len(got), len(want)), f"{label}: lengths differ ({len(got)} vs {len(want)})"
    logits = torch_logits_at_end(path, device, dtype, got[:k])
    gap = float(logits[want[k]] - logits[got[k]])
    bound = BF16_TIE * float(logits.abs().max())
    assert gap <= bound, (f"{label}: first difference at token {k} is no near-tie: torch prefers {want[k]} over "
                          f"{got[k]} by {gap:.4f} > {bound:.4f}")


def check_runner_matches_torch(device: str, dtype: str, variant: str = "qwen3", ragged_stand_ins: bool = False) -> Any:
    """Returns the gpu runner, so callers can inspect it (e.g. graph replays). With
    ``ragged_stand_ins`` (CPU) every step replays an eager stand-in of its ragged target graph."""
    model = tiny(variant)
    want = drive(make_runner(model.path, "torch", device, dtype))
    runner = make_runner(model.path, "gpu", device, dtype)
    if ragged_stand_ins:
        eager_target_graphs(runner)
    got = drive(runner)
    if ragged_stand_ins:  # every step of drive() fits a ragged graph of 128 or 256 tokens
        assert runner.parts.executor.num_ragged_replays >= 10, runner.parts.executor.num_ragged_replays
    for rid in want:
        if rid == "b" and dtype == "bfloat16":
            continue  # sampled: after a rounding difference the draws legitimately part
        assert_same_or_near_tie(model.path, device, dtype, got[rid], want[rid], f"{variant} {dtype} request {rid}")
    return runner


def check_few_rows_decode(device: str, variant: str) -> None:
    """The few-rows kernels (``skinny_gemv``: one-row linear layers with their norm or activation
    fused in, and for DeepSeek the one-token MoE and latent attention's fused products, over
    contexts of one flash-decoding split and of two) decode a lone request in float16 to the same
    tokens as the gpu runner without them."""
    import specloop.kernels.gemv as gemv
    import specloop.kernels.latent_heads as latent_heads
    import specloop.kernels.moe_route as moe_route
    import specloop.kernels.skinny_moe as skinny_moe

    model = tiny(variant)
    calls = {"linear": 0, "moe": 0, "rope_uk": 0, "merged_uv": 0, "router": 0}
    launch, moe, rope_uk, uv = gemv._launch, skinny_moe.skinny_moe, latent_heads.rope_cache_uk, latent_heads.head_gemv
    router = moe_route.router_route  # a one-token MoE's router with its routing (fused_routing)
    beside = skinny_moe.shared_beside_routing  # a one-token MoE with shared experts (moe_shared_stream)

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    def merged_uv(x: Any, *args: Any, **kwargs: Any) -> Any:
        calls["merged_uv"] += isinstance(x, latent_heads.SplitParts)
        return uv(x, *args, **kwargs)

    outs = {}
    gemv._launch, skinny_moe.skinny_moe = counted("linear", launch), counted("moe", moe)
    skinny_moe.shared_beside_routing, moe_route.router_route = counted("moe", beside), counted("router", router)
    latent_heads.rope_cache_uk, latent_heads.head_gemv = counted("rope_uk", rope_uk), merged_uv
    try:
        # without the few-rows kernels; with them, latent attention's products and the routing
        # fused, then not
        for options in ({"skinny_gemv": False}, {"skinny_gemv": True},
                        {"skinny_gemv": True, "fused_latent": False, "fused_routing": False}):
            before = dict(calls)
            runner = make_runner(model.path, "gpu", device, "float16", plugin_options={"gpu": options})
            plans = Plans(runner, 4, 64)
            (prompt,) = prompts(1, seed=2, min_len=28, max_len=28)  # 29-36 keys: one split, then two
            plans.add("a", prompt, GREEDY)
            plans.run({"a": len(prompt)})
            for _ in range(8):
                plans.run({"a": 1})
            outs[str(options)] = plans.reqs["a"].tokens
            if not options["skinny_gemv"]:
                assert not any(calls.values()), calls
            if "fused_latent" in options:
                assert all(calls[k] == before[k] for k in ("rope_uk", "merged_uv", "router")), calls
            if "deepseek" in variant and len(options) == 1 and options["skinny_gemv"]:
                assert calls["rope_uk"] >= 8 and calls["merged_uv"] >= 1 and calls["router"] >= 8, calls
    finally:
        gemv._launch, skinny_moe.skinny_moe, skinny_moe.shared_beside_routing = launch, moe, beside
        moe_route.router_route = router
        latent_heads.rope_cache_uk, latent_heads.head_gemv = rope_uk, uv
    assert calls["linear"] >= 8 * 4 and (calls["moe"] >= 8 or "deepseek" not in variant), calls
    assert len(set(map(tuple, outs.values()))) == 1, (variant, outs)


def check_launch_options(device: str, variant: str, options: tuple[str, ...] = ("rope_in_attention",)) -> None:
    """The GPU options that save launches (``rope_in_attention``: a decode step's q/k norms, rotary
    embedding and KV write inside the attention kernel; ``last_sums``: split sums added by the last
    program to finish) decode two requests in float16 to the tokens of the separate kernels, and
    with ``rope_in_attention`` the decode steps take the fused path (prefill steps do not)."""
    import specloop.backends.gpu.triton_attention as pa
    import specloop.kernels.last_sums as last_sums

    model = tiny(variant)
    fused = []
    attention = pa.paged_attention

    def counted(*args: Any, **kwargs: Any) -> Any:
        fused.append(kwargs.get("rope") is not None)
        return attention(*args, **kwargs)

    outs = {}
    pa.paged_attention = counted
    try:
        for on in (False, True):
            fused.clear()
            runner = make_runner(model.path, "gpu", device, "float16",
                                 plugin_options={"gpu": {name: on for name in options}})
            plans = Plans(runner, 4, 64)
            batch = dict(zip("ab", prompts(2, seed=3, min_len=5, max_len=11)))
            for rid, prompt in batch.items():
                plans.add(rid, prompt, GREEDY)
            plans.run({rid: len(prompt) for rid, prompt in batch.items()})
            for _ in range(8):
                plans.run({"a": 1, "b": 1})
            outs[on] = {rid: plans.reqs[rid].tokens for rid in "ab"}
            if "rope_in_attention" in options:
                assert any(fused) == on and (not on or fused.count(True) >= 8), (on, fused)
            if "last_sums" in options:
                assert last_sums.enabled() == on
                assert not last_sums.counts(torch.device(device)).any(), "arrival counts left non-zero"
            runner.shutdown()
    finally:
        pa.paged_attention = attention
        last_sums.set_enabled(False)
    assert outs[True] == outs[False], (variant, options, outs)


def check_decode_graph_draws(device: str) -> None:
    """Decode graphs that draw each row's token (eager stand-ins on the CPU): a greedy, a seeded and
    a seeded min-p request decode the torch runner's tokens; the first two take the graph's draws,
    the min-p one draws again outside it, over the graph's write into its token row. On the CPU
    also through the graphs' long-context variants (16 splits over contexts of ~20 keys: most of
    them empty)."""
    model = tiny("qwen3")
    params = [GREEDY, SamplingParams(temperature=0.9, seed=11, max_tokens=100), SEEDED]
    outs = {}
    for name in ("torch", "gpu", "gpu-long") if device == "cpu" else ("torch", "gpu"):
        runner = make_runner(model.path, name.split("-")[0], device, "float32")
        executor = None
        if name != "torch":  # on the CPU, eager stand-ins for the graphs
            executor = eager_target_graphs(runner, ragged=False, decode=True, long_splits=16 * (name == "gpu-long")) \
                if device == "cpu" else runner.parts.executor
        plans = Plans(runner, 4, 64)
        for rid, p, sp in zip("abc", prompts(3, seed=4, min_len=5, max_len=9), params):
            plans.add(rid, p, sp)
        plans.run({rid: len(req.tokens) for rid, req in plans.reqs.items()})
        for _ in range(5):
            plans.run({"a": 1, "b": 1})  # plain: the graph's draws
        for _ in range(3):
            plans.run({"a": 1, "b": 1, "c": 1})  # min-p: drawn again
        outs[name] = {rid: req.tokens for rid, req in plans.reqs.items()}
        if executor is not None:
            assert runner.parts.sampler.num_presampled == 5, runner.parts.sampler.num_presampled
            assert executor.num_replays - executor.num_ragged_replays == 8, executor.num_replays
            assert executor.num_long_replays == 8 * (name == "gpu-long"), executor.num_long_replays
    assert all(out == outs["torch"] for out in outs.values()), outs


def check_async_scheduling_matches_sync(device: str, dtype: str) -> None:
    """The gpu runner with asynchronous scheduling (the next step reads this step's tokens on the
    device; the host learns them a step late) against the synchronous torch runner, through the
    engine: greedy and seeded requests, chunked prefill, a shared prefix and preemption."""
    from specloop import LLM, SamplingParams

    model = tiny("qwen3")
    prompts_ = [p[:9] for p in prompts(6, seed=21, min_len=9, max_len=20)]
    params = [SamplingParams(max_tokens=12, temperature=0.0), SamplingParams(max_tokens=9, temperature=0.8, seed=3)] * 3
    outs = {}
    for runner, mode in (("torch", False), ("gpu", True)):
        llm = LLM(model.path, model_runner=runner, async_scheduling=mode, device=device, dtype=dtype,
                  skip_tokenizer_init=True, block_size=4, num_kv_blocks=24, max_model_len=32,
                  max_num_batched_tokens=16)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts_], params, use_tqdm=False)
        assert llm.config.async_scheduling is mode
        outs[runner] = [o.outputs[0].token_ids for o in got]
        llm.core.shutdown()
    assert outs["gpu"] == outs["torch"], (outs["gpu"], outs["torch"])


def check_async_engine_matches_llm(device: str, dtype: str) -> None:
    """An in-process :class:`AsyncEngine` builds its core on its step thread (CUDA graphs captured
    and replayed there, asynchronous scheduling on): its greedy outputs equal the offline LLM's,
    and the model was loaded on that thread, not the caller's."""
    import asyncio
    import threading

    from specloop import LLM, AsyncEngine, SamplingParams
    from specloop.backends import runner as runner_module

    model = tiny("qwen3")
    prompts_ = [p[:9] for p in prompts(4, seed=23, min_len=9, max_len=20)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    args = dict(model=model.path, device=device, dtype=dtype, skip_tokenizer_init=True, block_size=4,
                num_kv_blocks=40, max_model_len=32)
    llm = LLM(**args)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts_], params,
                                                        use_tqdm=False)]
    llm.core.shutdown()
    loaded: set[int] = set()
    load = runner_module.load_model

    def recording_load(*a, **k):
        loaded.add(threading.get_ident())
        return load(*a, **k)

    async def run() -> list[list[int]]:
        engine = AsyncEngine.from_engine_args(**args)
        try:
            assert engine.config.async_scheduling is (device == "cuda")

            async def one(i: int, p: list[int]) -> list[int]:
                outs = [o async for o in engine.generate(p, params, f"r{i}")]
                return list(outs[-1].outputs[0].token_ids)

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts_)))
        finally:
            await engine.shutdown()

    runner_module.load_model = recording_load
    try:
        got = asyncio.run(run())
    finally:
        runner_module.load_model = load
    assert got == want, (got, want)
    assert len(loaded) == 1 and threading.get_ident() not in loaded


def check_spec_async_matches_sync(device: str, dtype: str) -> None:
    """n-gram drafts in runs (a scripted policy) on the gpu runner with asynchronous scheduling:
    the steps without drafts deferred and overlapped, those with drafts committed before the next
    plan; greedy output equal to the synchronous torch runner's without drafts, through chunked
    prefill and preemption."""
    from scripted_policy import Alternating, OverlapCounter

    from specloop import LLM, SamplingParams

    model = tiny("qwen3")
    base = [p[:9] for p in prompts(3, seed=21, min_len=9, max_len=20)]
    prompts_ = [p + p[:6] + p for p in base]  # repeats for n-gram lookup to find
    params = SamplingParams(max_tokens=14, temperature=0.0)
    outs, overlapped = {}, None
    for runner, mode in (("torch", False), ("gpu", True)):
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} if mode else None
        llm = LLM(model.path, model_runner=runner, async_scheduling=mode, device=device, dtype=dtype,
                  skip_tokenizer_init=True, block_size=4, num_kv_blocks=40, max_model_len=64,
                  max_num_batched_tokens=16, speculative_config=spec)
        try:
            core = llm.core
            if mode:
                core.runner.drafter.policy = Alternating()
                overlapped = OverlapCounter(core)
            got = llm.generate([{"prompt_token_ids": p} for p in prompts_], params, use_tqdm=False)
            outs[runner] = [o.outputs[0].token_ids for o in got]
            if mode:
                assert llm.get_metrics()["spec_num_drafts"] > 0
        finally:
            llm.core.shutdown()
    assert outs["gpu"] == outs["torch"], (outs["gpu"], outs["torch"])
    assert overlapped.count > 0


def check_launch(device: str, method: str = "ngram") -> None:
    """Drafts launched from the device after each greedy verification (n-gram: searched there,
    ``NgramProposer.launch``, ``kernels.ngram``; Medusa: the heads over the verification's states,
    ``MedusaProposer.launch``), from their graphs' eager stand-ins on the CPU, synchronously and with asynchronous scheduling (its verifications
    read a step late), against the host's proposals (``device_proposals`` off) and the target
    without drafts: the same greedy output, the same drafts verified at each request and position
    but for a request's last steps (there the host drafts fewer and pads them with the last; a step
    planned before the verification is read keeps fewer of them), and most proposals launched."""
    from pathlib import Path

    from specloop import LLM, SamplingParams

    base = [p[:7] for p in prompts(4, seed=31, min_len=7, max_len=12)]  # 4: a graph size, no padding
    batch = [{"prompt_token_ids": p + p[:4] + p} for p in base]  # repeats for the lookup to find
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    if method == "ngram":
        path = tiny("qwen3").path
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:
        root = Path(__file__).resolve().parent.parent / "default_models"
        path = str(root / "specloop-tiny")
        spec = {"method": method, "num_speculative_tokens": 3, "model": str(root / f"specloop-tiny-{method}")}
    outs, at, launched, replays = {}, {}, {}, {}
    # Medusa: what launching changes only (the rest of the path is the n-gram run's).
    modes = ("none", "host", "device", "async") if method == "ngram" else ("host", "device")
    for mode in modes:
        with pytest.MonkeyPatch.context() as monkeypatch:
            if device == "cpu":  # the launch graphs' stand-ins
                eager_captures(monkeypatch)
            llm = LLM(path, model_runner="gpu", device=device, dtype="float32", skip_tokenizer_init=True,
                      max_model_len=64, max_num_seqs=4, async_scheduling=mode == "async",
                      speculative_config=None if mode == "none" else spec,
                      plugin_options={"gpu": {"device_proposals": mode != "host"}})
        try:
            if mode != "none":
                runner = llm.core.runner
                runner.drafter.pad_drafts = True  # uniform batches, as when the target replays graphs
                at[mode] = {}
                runner.parts.sampler.sample = _recording(runner.parts.sampler.sample, [], at[mode])
                prop, calls = runner.drafter.proposer, []
                launch = prop.launch
                prop.launch = lambda step: calls.append(launch(step)) or calls[-1]
            outs[mode] = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
            if mode != "none":
                launched[mode] = (sum(d is not None for d in calls), len(calls))
                replays[mode] = sum(g.num_replays for g in prop.launch_graphs.values())
        finally:
            llm.core.shutdown()
    assert all(outs[m] == outs[modes[0]] for m in outs), outs
    launching = [m for m in modes if m in ("device", "async")]
    assert launched["host"] == (0, 0) and all(launched[m][0] > 5 for m in launching), launched
    assert all(replays[m] > 5 for m in launching), replays  # one graph replay a launch
    for mode in launching:
        # Not the last steps, where the host drafts fewer than K and pads them with the last.
        k = spec["num_speculative_tokens"]
        common = [key for key in at[mode] if key in at["host"]
                  and key[1] + 2 * k < len(batch[int(key[0])]["prompt_token_ids"]) + params.max_tokens]
        assert len(common) > 5, (mode, len(common))
        # Planned before the verification is read (async), a step near a request's end keeps fewer.
        differ = [(key, at[mode][key], at["host"][key]) for key in common
                  if at[mode][key] != at["host"][key][:len(at[mode][key])]]
        assert not differ, (mode, differ)


def check_structured_async_matches_sync(device: str, dtype: str, max_tokens: int = 24) -> None:
    """Grammar-constrained requests on the gpu runner with asynchronous scheduling (masks applied
    on the device by the fast sampler, tokens deferred) against the synchronous torch runner, on
    the default model: JSON-schema and regex requests, greedy and seeded, beside a plain one."""
    from specloop import LLM, SamplingParams

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 50}},
              "required": ["name", "n"], "additionalProperties": False}
    prompts_ = ["The record:", "def f(x):\n    return", "JSON please", "A name and a number:"]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs={"json": schema}),
              SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=3, structured_outputs={"json": schema}),
              SamplingParams(max_tokens=max_tokens, temperature=0.0,
                             structured_outputs={"regex": "[a-z]{2,8} [0-9]{1,3}"}),
              SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=4)]
    outs = {}
    for runner, mode in (("torch", False), ("gpu", True)):
        llm = LLM(model_runner=runner, async_scheduling=mode, device=device, dtype=dtype, max_model_len=64)
        try:
            got = llm.generate(prompts_, params, use_tqdm=False)
            assert llm.config.async_scheduling is mode
            outs[runner] = [o.outputs[0].token_ids for o in got]
        finally:
            llm.core.shutdown()
    assert outs["gpu"] == outs["torch"], (outs["gpu"], outs["torch"])


MODES = ("none", "eager", "graphs", "async")


def check_draft_graphs_match_eager(device: str, method: str, max_tokens: int = 16, read_late: bool = False) -> None:
    """The greedy graph paths of a proposer (EAGLE-3 and MTP: the whole proposal of a uniform step,
    its first step over every target row, after a verification launched from the device with the
    drafts left there and read a step late; the draft model: its first step over its newest one or
    two tokens, then the further steps; all: the further steps after an eager first step as one
    chain), run eagerly on the graphs' static buffers under the Triton kernels, positions and slots
    computed on the device: the same drafts, step by step, as the proposer's eager path, and the
    same output as without drafts. Drafting runs in runs (a scripted policy): after the steps
    without drafts EAGLE-3 and MTP are skipped, then catch up from the states the target's forward
    recorded. EAGLE-1 (``eagle+map``) drafts from a token map of every other id. EAGLE-3 runs while
    requests come and go, with a preemption and a sampled request, and again in mode ``async``: ``graphs`` with asynchronous scheduling, its
    launched verifications read a step late, the next step planned as if every draft were accepted
    and pulled back on the device by the rejected ones."""
    from pathlib import Path

    from scripted_policy import Alternating

    from specloop import LLM, SamplingParams

    root = Path(__file__).resolve().parent.parent / "default_models"
    if method == "mtp":
        path, spec = str(root / "specloop-tiny-mtp"), {"method": "mtp", "num_speculative_tokens": 3}
    elif method == "draft_model":
        path, spec = str(root / "specloop-tiny"), {"method": method, "num_speculative_tokens": 3,
                                                   "model": str(root / "specloop-tiny-draft")}
    else:  # eagle+map: EAGLE-1 drafting from a token map (a copy of those rows of the target's head)
        name = method.split("+")[0]
        path, spec = str(root / "specloop-tiny"), {"method": name, "num_speculative_tokens": 3,
                                                   "model": str(root / f"specloop-tiny-{name}")}
        if method.endswith("+map"):
            spec["token_map"] = str(Path(tempfile.mkdtemp()) / "map.json")
            Path(spec["token_map"]).write_text(json.dumps(list(range(0, 8192, 2))))  # every other id
    if method == "eagle3":
        # Requests come and go: two run at a time out of four, in a KV pool small enough to preempt,
        # and one samples (its steps verify on the reference path, which needs the placeholders'
        # values).
        batch = [{"prompt_token_ids": p} for p in prompts(4, seed=9, min_len=6, max_len=12)]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (28, 8, 26)]
        params.append(SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True))
        engine, modes, greedy = dict(max_num_seqs=2, block_size=16, num_kv_blocks=5), MODES, 3
    else:
        # EAGLE-1 with a map: four requests, a graph size, so that its launches are fed from the
        # device whichever requests finish first
        count = 4 if method.endswith("+map") else 3
        batch = [{"prompt_token_ids": p} for p in prompts(count, seed=5, min_len=6, max_len=14)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine, modes, greedy = dict(max_num_seqs=4), MODES if read_late else MODES[:3], count
    outs, drafts, replays, preempted, accepted, at = {}, {}, {}, 0, {}, {}
    proposed: list[int] = []  # every draft the proposer made, in any mode
    for mode in modes:
        proposals: list = []
        with pytest.MonkeyPatch.context() as monkeypatch:
            captured = eager_captures(monkeypatch) if mode in ("graphs", "async") else []
            llm = LLM(path, model_runner="gpu", device=device, dtype="float32", skip_tokenizer_init=True,
                      max_model_len=64, **engine, speculative_config=None if mode == "none" else spec,
                      async_scheduling=mode == "async")
        try:
            if mode != "none":
                runner = llm.core.runner
                prop = runner.drafter.proposer
                runner.drafter.pad_drafts = True  # uniform batches, as when the target replays graphs
                runner.drafter.policy = Alternating(on=3, off=2)
                # the feeds' graph sets, then the chain's, then (EAGLE) the ragged feeds'
                assert prop.graphs_on is (mode in ("graphs", "async"))
                order = [*prop.feed_graphs.values(), *getattr(prop, "launch_graphs", {}).values(), prop.chain,
                         getattr(prop, "ragged", None)]
                assert captured == ([g for g in order if g is not None] if prop.graphs_on else []), captured
                seen: list = []
                at[mode] = {}
                runner.parts.sampler.sample = _recording(runner.parts.sampler.sample, seen, at[mode])
                launched = []
                launch = prop.launch
                # the drafts as launched (a copy: the graphs' output buffers take the next launch's)
                prop.launch = lambda step: (launched.append(None if (d := launch(step)) is None else d.clone())
                                            or d)
                propose = prop.propose
                prop.propose = lambda inputs: proposals.append(propose(inputs)) or proposals[-1]
                late = []
                read_later = runner._read_later
                runner._read_later = lambda *a: late.append(1) or read_later(*a)
            got = llm.generate(batch, params, use_tqdm=False)
            outs[mode] = [o.outputs[0].token_ids for o in got]
            if mode != "none":
                proposed += [t for d in launched if d is not None for t in d.flatten().tolist()]
                proposed += [t for p in proposals for d in p.draft_token_ids for t in d]
            if mode != "none":
                drafts[mode] = seen
                accepted[mode] = llm.get_metrics()["spec_num_accepted_tokens"]
            if mode == "graphs":
                preempted = llm.get_metrics()["num_preemptions"]
                replays = {"steps": prop.chain.num_replays,
                           **{f"feed q={q}": g.num_replays for q, g in prop.feed_graphs.items()},
                           "launched": sum(d is not None for d in launched),
                           "fed from the device": sum(getattr(g, "num_device_replays", 0) for g in
                                                      [*prop.feed_graphs.values(),
                                                       *getattr(prop, "launch_graphs", {}).values()])}
                if method != "draft_model":
                    replays["skipped"] = prop.recorded.skips
                if getattr(prop, "ragged", None) is not None:
                    replays["ragged"] = prop.ragged.num_replays
            elif mode == "eager":
                assert not any(d is not None for d in launched), (method, mode, "launched")
            if mode != "none":
                # Read a step late only with asynchronous scheduling, and then after every launch.
                assert (len(late) > 0) is (mode == "async"), (method, mode, len(late))
        finally:
            llm.core.shutdown()
    # Greedy outputs are the target's; a sampled one is the same whichever path drafted for it.
    assert all(outs[m][:greedy] == outs["none"][:greedy] and outs[m] == outs["eager"] for m in modes[1:]), outs
    # The drafts each step verified: placeholders of a launched proposal read back as its drafts.
    # Past what a request's max_tokens lets it keep, a step pads: an eager proposal by repeating
    # its last draft, a launched one with its own later drafts (both verified, neither kept).
    lens = [len(p["prompt_token_ids"]) for p in batch]
    limits = [p.max_tokens for p in params] if isinstance(params, list) else [params.max_tokens] * len(batch)
    kept = {m: [[d[:max(0, limits[int(rid)] - (start - lens[int(rid)] + 1) - 1)] for rid, start, d in step]
                for step in drafts[m]] for m in ("eager", "graphs")}
    assert kept["graphs"] == kept["eager"] and len(drafts["eager"]) > 5, (method, drafts)
    assert [[len(d) for *_, d in step] for step in drafts["graphs"]] == \
        [[len(d) for *_, d in step] for step in drafts["eager"]], (method, drafts)
    if method.endswith("+map"):  # the proposer's drafts (not the padding of a step's) from the map's even ids
        assert proposed and all(t % 2 == 0 for t in proposed), proposed
    if "async" in modes:
        # Planned earlier, the asynchronous run groups requests into steps differently, and its
        # policy alternates over other steps: the drafts verified at the same request and position
        # (the greedy ones: a sampled request's draw depends on the step) are the same.
        greedy = {str(i) for i, p in enumerate(params if isinstance(params, list) else [params] * len(batch))
                  if p.temperature == 0}  # LLM.generate numbers its requests from "0"
        common = [key for key in at["async"] if key in at["eager"] and key[0] in greedy]
        assert len(common) >= len(at["async"]) // 3 and accepted["async"] > 0, (len(common), len(at["async"]))
        # Near a request's end a step planned before the verification is read keeps fewer.
        differ = [(key, at["async"][key], at["eager"][key]) for key in common
                  if at["async"][key] != at["eager"][key][:len(at["async"][key])]]
        assert not differ, differ
    assert method != "eagle3" or preempted > 0, "the pool never preempted"
    # After a uniform verification every method launches its proposal from the device, in one
    # graph that reads the step's own tensors (the draft model: the tokens of its token rows).
    assert replays["launched"] > 0 and replays["fed from the device"] > 0, replays
    # The heads and MTP feed all K + 1 = 4 rows of a verification step; after the steps it skipped
    # the draft model feeds what it missed eagerly, then the chain.
    assert replays["steps"] > 0 and (method == "draft_model" or replays["feed q=4"] > 0), replays
    # At length 0 EAGLE-3 and MTP skip the step and catch up later.
    assert method == "draft_model" or replays["skipped"] > 0, replays
    # EAGLE-3 and MTP catch up (new prompts, skipped steps) in their ragged feed graphs.
    assert method == "draft_model" or replays["ragged"] > 0, replays


def check_controlled_launch_follows_alpha(device: str, alpha: float = 0.2) -> None:
    """The acceptance-controlled proposer wrapping EAGLE-3 on the launched path (its graphs run
    eagerly, as above): it pays the head's launch and swaps in drafts that follow the known
    continuation with probability alpha, predicted on the host before the step's tokens are read.
    Outputs stay the target's, no request leaves its continuation, and the first position is
    accepted at about alpha."""
    from pathlib import Path

    from specloop import LLM, SamplingParams

    root = Path(__file__).resolve().parent.parent / "default_models"
    engine = dict(model_runner="gpu", device=device, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
                  max_num_seqs=4)
    batch = [{"prompt_token_ids": p} for p in prompts(2, seed=7, min_len=6, max_len=10)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(root / "specloop-tiny"), **engine)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(batch, params, use_tqdm=False)]
    finally:
        plain.core.shutdown()
    truth = {tuple(b["prompt_token_ids"]): list(w) for b, w in zip(batch, want)}
    with pytest.MonkeyPatch.context() as monkeypatch:
        eager_captures(monkeypatch)
        llm = LLM(str(root / "specloop-tiny"), **engine, plugin_options={"controlled": {"continuations": truth}},
                  speculative_config={"method": "controlled", "num_speculative_tokens": 3,
                                      "model": str(root / "specloop-tiny-eagle3"),
                                      "extra": {"wraps": "eagle3", "alpha": alpha}})
    try:
        runner = llm.core.runner
        runner.drafter.pad_drafts = True
        prop = runner.drafter.proposer
        launched = []
        launch = prop.launch
        prop.launch = lambda step: launched.append(launch(step)) or launched[-1]
        got = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        m = llm.get_metrics()
    finally:
        llm.core.shutdown()
    assert got == want and not prop.diverged, (got, want, prop.diverged)
    assert sum(d is not None for d in launched) > 10, len(launched)
    first = m["spec_num_accepted_tokens_per_pos"][0] / m["spec_num_drafts"]
    assert m["spec_num_drafts"] > 30 and abs(first - alpha) < 0.15, (first, m["spec_num_drafts"])


def check_half_precision_drafts(device: str) -> None:
    """MTP (K = 3) in float16 through its graph paths (stand-ins on the graphs' buffers): the rows
    that pad a catch-up feed, a proposal or a chain belong to no request and hold whatever their
    buffers hold, NaN included, so the router and the argmax must still give experts and tokens that
    exist (a NaN row once gave expert ids twice over and a token id of 2^31 - 1)."""
    from pathlib import Path

    from specloop import LLM, SamplingParams

    path = str(Path(__file__).resolve().parent.parent / "default_models" / "specloop-tiny-mtp")
    batch = [{"prompt_token_ids": p} for p in prompts(4, seed=9, min_len=8, max_len=40)]
    with pytest.MonkeyPatch.context() as monkeypatch:
        eager_captures(monkeypatch)
        llm = LLM(path, model_runner="gpu", device=device, dtype="float16", skip_tokenizer_init=True,
                  max_model_len=128, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    try:
        assert llm.core.runner.drafter.proposer.graphs_on
        got = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        m = llm.get_metrics()
    finally:
        llm.core.shutdown()
    vocab = llm.core.runner.model_config.vocab_size
    assert all(len(o.outputs[0].token_ids) == 8 and all(0 <= t < vocab for t in o.outputs[0].token_ids)
               for o in got), [o.outputs[0].token_ids for o in got]
    assert m["spec_num_drafts"] > 0 and m["spec_num_accepted_tokens"] > 0, m


def _recording(sample: Any, seen: list, at: dict | None = None) -> Any:
    """``sample`` that records, for each step that verifies drafts, every request's (id, first
    position, drafts) in ``seen`` (values only: a placeholder left here would fail the comparison),
    and the drafts in ``at`` by (request, first position)."""
    def wrapped(batch: Any, *args: Any, **kwargs: Any) -> Any:
        if any(batch.spec_token_ids):
            seen.append([(rid, start, list(d)) for rid, start, d in
                         zip(batch.req_ids, batch.layout.starts, batch.spec_token_ids)])
            if at is not None:
                at.update(((rid, start), list(d)) for rid, start, d in
                          zip(batch.req_ids, batch.layout.starts, batch.spec_token_ids) if d)
        return sample(batch, *args, **kwargs)
    return wrapped


def _main() -> None:
    """``runner_checks.py VARIANT,...``: the runner against the torch runner per model variant, and
    its other paths (ragged and decode-graph stand-ins, asynchronous scheduling, grammar masks);
    ``runner_checks.py launch:NAME,...``: proposals launched from the device (ngram, medusa);
    ``runner_checks.py few_rows:VARIANT,...``: the few-rows kernels decoding (float16);
    ``runner_checks.py rope:VARIANT,...``: rotary and KV write inside decode attention (float16);
    ``runner_checks.py drafts[:NAME,...]``: the proposers' graph paths (eagle3, mtp, draft_model,
    eagle+map: EAGLE-1 with a token map) and the acceptance-controlled proposer on the launched path (controlled), all of them or
    those named; ``runner_checks.py half_drafts``: MTP's graph paths in float16."""
    import sys

    if sys.argv[1].startswith("drafts"):  # drafts[:eagle3,eagle+map,mtp,draft_model,controlled]
        _, _, which = sys.argv[1].partition(":")
        for name in (which or "eagle3,eagle+map,mtp,draft_model,controlled").split(","):
            if name == "controlled":
                check_controlled_launch_follows_alpha("cpu")
            else:
                check_draft_graphs_match_eager("cpu", name)
        print("ok drafts")
        return
    if sys.argv[1] == "half_drafts":
        check_half_precision_drafts("cpu")
        print("ok half_drafts")
        return
    if sys.argv[1].startswith("few_rows:"):
        for variant in sys.argv[1].partition(":")[2].split(","):
            check_few_rows_decode("cpu", variant)
        print("ok few_rows")
        return
    if sys.argv[1].startswith("rope:"):
        for variant in sys.argv[1].partition(":")[2].split(","):
            check_launch_options("cpu", variant)
        print("ok rope")
        return
    if sys.argv[1].startswith("launch:"):
        for name in sys.argv[1].partition(":")[2].split(","):
            check_launch("cpu", name)
        print("ok launch")
        return
    for variant in sys.argv[1].split(","):
        check_runner_matches_torch("cpu", "float32", variant)
    check_runner_matches_torch("cpu", "float32", "qwen3", ragged_stand_ins=True)
    check_decode_graph_draws("cpu")
    check_async_scheduling_matches_sync("cpu", "float32")
    check_spec_async_matches_sync("cpu", "float32")
    check_structured_async_matches_sync("cpu", "float32", max_tokens=8)
    print("ok runner")


if __name__ == "__main__":
    torch.manual_seed(0)
    _main()

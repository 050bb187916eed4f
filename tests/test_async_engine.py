import asyncio

import pytest
from tokenizer_helpers import build_tokenizer

from specloop import AsyncEngine, EngineConfig, SamplingParams
from specloop.backends.scripted import ScriptedModelRunner, scripted_continuation
from specloop.kernel import EngineDeadError, PluginManager, hookimpl

VOCAB = 400


def expected_tokens(prompt_ids, n):
    return scripted_continuation(prompt_ids, n, VOCAB)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=VOCAB)


def make_engine(tok_dir=None, plugins=None, **kw):
    kw.setdefault("max_model_len", 256)
    opts = {"scripted": {"vocab_size": VOCAB, **kw.pop("scripted", {})}}
    config = EngineConfig(model_runner="scripted", tokenizer=tok_dir, skip_tokenizer_init=tok_dir is None,
                          plugin_options=opts, **kw)
    return AsyncEngine(config, PluginManager(plugins) if plugins else None)


async def collect(engine, prompt, params, rid, **kw):
    return [out async for out in engine.generate(prompt, params, rid, **kw)]


class Recorder:
    def __init__(self):
        self.added = []

    @hookimpl
    def specloop_request_added(self, requests):
        self.added.extend(requests)


async def test_token_id_prompts_without_tokenizer():
    engine = make_engine()
    assert engine.tokenizer is None and engine.vocab_size == VOCAB and engine.model_name == "scripted"
    try:
        outs = await collect(engine, [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True), "a")
        assert outs[-1].finished and all(not o.finished for o in outs[:-1])
        final = outs[-1].outputs[0]
        assert final.token_ids == expected_tokens([5, 6, 7], 6)
        assert final.text == "" and final.finish_reason == "length"
        outs = await collect(engine, {"prompt_token_ids": [9, 9]}, SamplingParams(max_tokens=3, ignore_eos=True), "b")
        assert outs[-1].outputs[0].token_ids == expected_tokens([9, 9], 3) and outs[-1].prompt_token_ids == [9, 9]
        with pytest.raises(ValueError, match="tokenizer"):
            await collect(engine, "text needs a tokenizer", SamplingParams(), "c")
    finally:
        await engine.shutdown()


async def test_text_prompt_cumulative_and_delta_agree(tok_dir):
    engine = make_engine(tok_dir)
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        prompt_ids = engine.tokenizer.encode("Hello world")
        cumulative = await collect(engine, "Hello world", params, "c")
        deltas = await collect(engine, "Hello world", params, "d", delta=True)
        tokens = expected_tokens(prompt_ids, 40)
        final = cumulative[-1].outputs[0]
        assert final.token_ids == tokens and final.text == engine.tokenizer.decode(tokens)
        assert "".join(o.outputs[0].text for o in deltas) == final.text
        assert [t for o in deltas for t in o.outputs[0].token_ids] == tokens
        assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
        # Cumulative outputs only grow.
        for a, b in zip(cumulative, cumulative[1:]):
            assert b.outputs[0].text.startswith(a.outputs[0].text)
        m = cumulative[-1].metrics
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    finally:
        await engine.shutdown()


async def test_stop_string_finishes_and_aborts_in_core(tok_dir):
    engine = make_engine(tok_dir)
    tok = engine.tokenizer
    try:
        prompt_ids = tok.encode("The quick")
        tokens = expected_tokens(prompt_ids, 60)
        pieces = [tok.decode([t]) for t in tokens]
        # A two-character stop string across a token boundary, at the first clean boundary.
        j = next(j for j in range(3, len(pieces) - 1) if pieces[j] and pieces[j + 1]
                 and "\ufffd" not in pieces[j] + pieces[j + 1])
        stop = pieces[j][-1] + pieces[j + 1][0]
        full = tok.decode(tokens)
        at = full.find(stop)
        params = SamplingParams(max_tokens=60, ignore_eos=True, stop=[stop])
        outs = await collect(engine, "The quick", params, "s", delta=True)
        text = "".join(o.outputs[0].text for o in outs)
        last = outs[-1].outputs[0]
        assert text == full[:at] and last.finish_reason == "stop" and last.stop_reason == stop
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        assert n_out < 60 and tok.decode(tokens[:n_out]).find(stop) == at
        await asyncio.sleep(0.05)
        assert not engine.core.has_unfinished_requests()
        assert engine.get_metrics()["num_requests_finished"] == {"stop": 1}
    finally:
        await engine.shutdown()


async def test_n_completions_fan_out_with_child_seeds(tok_dir):
    rec = Recorder()
    engine = make_engine(tok_dir, plugins=[rec])
    try:
        params = SamplingParams(n=3, max_tokens=5, ignore_eos=True, seed=100)
        outs = await collect(engine, [7, 8, 9], params, "par")
        final = outs[-1]
        assert final.finished and [o.index for o in final.outputs] == [0, 1, 2]
        assert all(o.token_ids == expected_tokens([7, 8, 9], 5) for o in final.outputs)
        assert sorted(r.request_id for r in rec.added) == ["0_par", "1_par", "2_par"]
        assert {r.request_id: r.sampling_params.seed for r in rec.added} == {"0_par": 100, "1_par": 101, "2_par": 102}
        assert all(r.sampling_params.n == 1 for r in rec.added)
        deltas = await collect(engine, [7, 8, 9], SamplingParams(n=2, max_tokens=4, ignore_eos=True), "par2",
                               delta=True)
        per_index = {0: [], 1: []}
        for out in deltas:
            for o in out.outputs:
                per_index[o.index] += o.token_ids
        assert per_index[0] == per_index[1] == expected_tokens([7, 8, 9], 4)
        assert deltas[-1].finished
    finally:
        await engine.shutdown()


async def test_client_going_away_aborts_only_its_request(tok_dir):
    engine = make_engine(tok_dir, max_model_len=4096)
    try:
        long_params = SamplingParams(max_tokens=3000, ignore_eos=True)
        other = asyncio.create_task(collect(engine, [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), "o"))
        gen = engine.generate([4, 5, 6], long_params, "gone", delta=True)
        got = [await gen.__anext__() for _ in range(3)]
        assert not got[-1].finished
        await gen.aclose()  # the client closed the stream
        task = asyncio.create_task(collect(engine, [4, 5, 7], long_params, "cancelled"))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        done = await other
        assert done[-1].outputs[0].token_ids == expected_tokens([1, 2, 3], 50)
        await asyncio.sleep(0.05)
        assert not engine.core.has_unfinished_requests()
        assert engine.get_metrics()["num_requests_finished"] == {"abort": 2, "length": 1}
    finally:
        await engine.shutdown()


async def test_abort_by_id_ends_the_stream(tok_dir):
    engine = make_engine(tok_dir, max_model_len=4096)
    try:
        outs = []

        async def consume():
            async for out in engine.generate([4, 5, 6], SamplingParams(max_tokens=3000, n=2), "ab"):
                outs.append(out)

        task = asyncio.create_task(consume())
        while not outs:
            await asyncio.sleep(0.005)
        await engine.abort("ab")
        await asyncio.wait_for(task, 5)
        assert outs[-1].finished and {o.finish_reason for o in outs[-1].outputs} == {"abort"}
        assert len(outs[-1].outputs[0].token_ids) < 3000
        await engine.abort("no-such-request")  # ignored
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "empty"),
    ("", SamplingParams(), "empty"),
    ([1, 2, VOCAB], SamplingParams(), "out of vocabulary"),
    ([-1], SamplingParams(), "out of vocabulary"),
    (list(range(5, 69)), SamplingParams(), "maximum context length is 64 tokens.*64 input tokens"),
    (list(range(5, 55)), SamplingParams(max_tokens=20), "maximum context length is 64 tokens.*70 tokens "
                                                         r"\(50 in the input, 20 in the completion\)"),
    ([5], SamplingParams(logit_bias={VOCAB + 5: 1.0}), "logit_bias"),
    ([5], SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
    ({"prompt_ids": [1]}, SamplingParams(), "prompt keys"),
    (3.5, SamplingParams(), "a prompt must be"),
])
async def test_bad_input_is_rejected_and_others_unaffected(tok_dir, prompt, params, match):
    engine = make_engine(tok_dir, max_model_len=64)
    try:
        good = asyncio.create_task(collect(engine, [3, 4], SamplingParams(max_tokens=30, ignore_eos=True), "good"))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match=match):
            await collect(engine, prompt, params, "bad")
        assert (await good)[-1].outputs[0].token_ids == expected_tokens([3, 4], 30)
        assert engine.get_metrics()["num_requests_added"] == 1
    finally:
        await engine.shutdown()


async def test_validate_and_default_max_tokens(tok_dir):
    engine = make_engine(tok_dir, max_model_len=64)
    try:
        assert engine.default_max_tokens(10) == 54
        engine.validate([1] * 10, SamplingParams(max_tokens=54))
        with pytest.raises(ValueError, match="65 tokens"):
            engine.validate([1] * 10, SamplingParams(max_tokens=55))
        # max_tokens=None: generate until the context is full.
        outs = await collect(engine, [5] * 60, SamplingParams(max_tokens=None, ignore_eos=True), "fill")
        assert len(outs[-1].outputs[0].token_ids) == 4 and outs[-1].outputs[0].finish_reason == "length"
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            make_engine(None, max_model_len=64).validate([5], SamplingParams(stop=["x"]))
    finally:
        await engine.shutdown()


async def test_duplicate_request_id_is_refused(tok_dir):
    engine = make_engine(tok_dir, max_model_len=4096)
    try:
        gen = engine.generate([4], SamplingParams(max_tokens=1000), "dup")
        await gen.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, [4], SamplingParams(max_tokens=2), "dup")
        await gen.aclose()
    finally:
        await engine.shutdown()


async def test_speculative_counters_reach_outputs_and_metrics(tok_dir):
    engine = make_engine(tok_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        outs = await collect(engine, [5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True), "spec")
        final = outs[-1]
        assert final.outputs[0].token_ids == expected_tokens([5, 6, 7], 30)
        assert final.metrics.spec_num_draft_tokens > 0
        assert final.metrics.spec_num_accepted_tokens == final.metrics.spec_num_draft_tokens  # accuracy 1.0
        metrics = engine.get_metrics()
        assert metrics["spec_num_draft_tokens"] == final.metrics.spec_num_draft_tokens
        assert metrics["spec_num_accepted_tokens"] == final.metrics.spec_num_accepted_tokens
        assert metrics["num_generation_tokens"] == 30 and metrics["num_prompt_tokens"] == 3
    finally:
        await engine.shutdown()


class FailingRunner(ScriptedModelRunner):
    def sample_tokens(self, grammar=None):
        if self.num_executed > 3:
            raise RuntimeError("device on fire")
        return super().sample_tokens(grammar)


class FailingRunnerPlugin:
    @hookimpl
    def specloop_register_model_runners(self, register):
        register("failing", FailingRunner)


async def test_engine_failure_raises_and_is_visible():
    config = EngineConfig(model_runner="failing", skip_tokenizer_init=True, max_model_len=256,
                          plugin_options={"scripted": {"vocab_size": VOCAB}})
    engine = AsyncEngine(config, PluginManager([FailingRunnerPlugin()]))
    try:
        await engine.start()
        assert engine.is_running and engine.errored is None
        with pytest.raises(EngineDeadError, match="device on fire"):
            await collect(engine, [5, 6], SamplingParams(max_tokens=50), "x")
        assert not engine.is_running and isinstance(engine.errored, RuntimeError)
        with pytest.raises(EngineDeadError):
            await collect(engine, [5, 6], SamplingParams(max_tokens=5), "y")
    finally:
        await engine.shutdown()


async def test_from_engine_args_without_a_default_model_explains(monkeypatch):
    import specloop.frontend.model_path as model_path

    monkeypatch.setattr(model_path, "default_model_dir", lambda name="": None)
    with pytest.raises(FileNotFoundError, match="pass a local Hugging Face model directory"):
        AsyncEngine.from_engine_args(None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AsyncEngine.from_engine_args("/nonexistent/model")
    with pytest.raises(TypeError, match="unknown engine argument"):
        AsyncEngine.from_engine_args(None, model_runner="scripted", max_num_seq=3)

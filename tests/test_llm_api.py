import pytest
from tokenizer_helpers import build_tokenizer

from specloop import LLM, CompletionOutput, RequestOutput, SamplingParams
from specloop.backends.scripted import scripted_continuation
from specloop.frontend.output_processor import RequestTracker
from specloop.kernel import EngineCoreOutput, FinishReason, Request, TokenLogprobs

VOCAB = 400


def expected_tokens(prompt_ids, n):
    return scripted_continuation(prompt_ids, n, VOCAB)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def llm(tok_dir):
    return LLM(None, model_runner="scripted", tokenizer=tok_dir, max_model_len=128, max_num_seqs=4,
               plugin_options={"scripted": {"vocab_size": VOCAB}})


def test_generate_mixed_prompts_in_input_order(llm):
    tok = llm.get_tokenizer()
    prompts = ["Hello world", {"prompt_token_ids": [7, 8, 9]}, "你好", {"prompt": "The quick"}] * 3
    params = [SamplingParams(max_tokens=5 + i, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == len(prompts) and len({o.request_id for o in outs}) == len(prompts)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) and "prompt_token_ids" in prompt else \
            tok.encode(prompt if isinstance(prompt, str) else prompt["prompt"])
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == expected_tokens(ids, 5 + i)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        assert out.finished and out.outputs[0].finish_reason == "length"
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    # One prompt, one params, and a bare token-id list.
    single = llm.generate("Hello world", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids[:3]
    assert llm.generate([7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids == expected_tokens([7, 8, 9], 2)


def test_eos_and_stop_token_ids(llm):
    prompt = [7, 8, 9]
    tokens = expected_tokens(prompt, 20)
    stop_id = tokens[4]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=20, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    cut = tokens.index(stop_id) + 1
    assert out.token_ids == tokens[:cut] and out.finish_reason == "stop" and out.stop_reason == stop_id
    # The stop token's own text is not part of the output text.
    assert out.text == llm.get_tokenizer().decode(tokens[:cut - 1], skip_special_tokens=True)


def test_chat(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "Hi there"}]
    outs = llm.chat(conv, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1  # the template's BOS, not a second one
    assert outs[0].prompt == text and outs[0].prompt_token_ids == ids
    assert outs[0].outputs[0].token_ids == expected_tokens(ids, 4)
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "Yo"}, {"role": "user", "content": "?"}]],
                   SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(two) == 2 and two[1].prompt.endswith("<|im_start|>assistant\n")


def test_bad_input_raises_before_anything_is_enqueued(llm):
    before = llm.get_metrics()["num_requests_added"]
    with pytest.raises(ValueError, match="prompt 1: The prompt cannot be empty"):
        llm.generate(["fine", ""], use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 128 tokens"):
        llm.generate([{"prompt_token_ids": [5] * 100}], SamplingParams(max_tokens=29), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([{"prompt_token_ids": [5] * 128}], use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([{"prompt_token_ids": [5, VOCAB + 1]}], use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["a"], SamplingParams(temperature=-1.0), use_tqdm=False)
    # Wrong kinds of argument are named, not an AttributeError deep inside.
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them, got dict"):
        llm.generate(["a"], {"max_tokens": 2}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params .* got list"):
        llm.generate(["a", "b"], [SamplingParams(), None], use_tqdm=False)
    with pytest.raises(ValueError, match="prompts must be .* got int"):
        llm.generate(5, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens must be an integer of at least 1, got 2.0"):
        SamplingParams(max_tokens=2.0)
    assert llm.get_metrics()["num_requests_added"] == before
    assert not llm.core.has_unfinished_requests()
    # The engine still serves.
    assert llm.generate("ok", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_n_and_metrics(llm):
    before = llm.get_metrics()
    out = llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(n=3, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == expected_tokens([3, 4], 6) for o in out.outputs)
    after = llm.get_metrics()
    assert after["num_requests_added"] - before["num_requests_added"] == 3
    assert after["num_generation_tokens"] - before["num_generation_tokens"] == 18
    assert after["num_prompt_tokens"] - before["num_prompt_tokens"] == 6


def test_default_model_missing_is_explained(monkeypatch):
    import specloop.frontend.model_path as model_path

    monkeypatch.setattr(model_path, "default_model_dir", lambda name="": None)
    with pytest.raises(FileNotFoundError, match="--model"):
        LLM()


def test_logprobs_and_prompt_logprobs_processing(tmp_path):
    from specloop.frontend.tokenizer import Tokenizer

    tok = Tokenizer(build_tokenizer(str(tmp_path), vocab_size=VOCAB))
    params = SamplingParams(logprobs=2, prompt_logprobs=1, max_tokens=3)
    req = Request("r", [10, 11, 12], params)
    state = RequestTracker("r", None, [req], tok)
    lp = [TokenLogprobs(20, -0.5, 1, [20, 21], [-0.5, -1.5]), TokenLogprobs(30, -2.0, 3, [31, 32], [-0.1, -1.0])]
    prompt_lp = [None, TokenLogprobs(11, -3.0, 7, [40], [-0.2]), TokenLogprobs(12, -1.0, 1, [12], [-1.0])]
    state.process([EngineCoreOutput("r", [20], new_logprobs=lp[:1], new_prompt_logprobs=prompt_lp)])
    delta = state.delta_output()
    assert delta.prompt_logprobs[0] is None and delta.prompt_logprobs[1][11].rank == 7
    assert delta.prompt_logprobs[1][40].logprob == -0.2 and delta.prompt_logprobs[1][40].decoded_token == tok.token_text(40)
    state.process([EngineCoreOutput("r", [30], new_logprobs=lp[1:], finish_reason=FinishReason.LENGTH)])
    final = state.output()
    c = final.outputs[0]
    assert c.token_ids == [20, 30] and c.cumulative_logprob == pytest.approx(-2.5)
    assert list(c.logprobs[0]) == [20, 21] and c.logprobs[0][21].rank == 2
    # The sampled token comes first with its own rank, then the top-k.
    assert list(c.logprobs[1]) == [30, 31, 32] and c.logprobs[1][30].rank == 3
    assert c.logprobs[1][31].decoded_token == tok.token_text(31)
    assert len(final.prompt_logprobs) == 3 and final.finished
    second = state.delta_output()
    assert second.prompt_logprobs is None and second.outputs[0].logprobs[0][30].logprob == -2.0


def test_eos_ids_are_resolved_once_from_tokenizer_and_model_directory(tmp_path, tok_dir):
    """The engine's EOS ids come from the tokenizer and the model directory's generation config,
    never from the model runner, and every request the frontend builds carries them."""
    import json

    from specloop.backends.scripted import ScriptedModelRunner
    from specloop.kernel import PluginManager, hookimpl

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))

    class RunnerWithEos(ScriptedModelRunner):
        eos_token_ids = (99,)

    class Plugin:
        @hookimpl
        def specloop_register_model_runners(self, register):
            register("runner_with_eos", RunnerWithEos)

    options = dict(model_runner="runner_with_eos", max_model_len=64,
                   plugin_options={"scripted": {"vocab_size": VOCAB}})
    llm = LLM(str(model_dir), tokenizer=tok_dir, plugins=PluginManager([Plugin()], load_entrypoints=False),
              **options)
    tok = llm.get_tokenizer()
    assert llm.processor.eos_token_ids == (tok.eos_token_id, 5, 7)
    (request,) = llm.processor.make_requests("r", [1, 2, 3], SamplingParams(max_tokens=4))
    assert request.eos_token_ids == (tok.eos_token_id, 5, 7)
    # Without a tokenizer only the model directory's ids remain; config.json's only without them.
    bare = LLM(str(model_dir), skip_tokenizer_init=True,
               plugins=PluginManager([Plugin()], load_entrypoints=False), **options)
    assert bare.processor.eos_token_ids == (5, 7)
    (model_dir / "generation_config.json").unlink()
    bare = LLM(str(model_dir), skip_tokenizer_init=True,
               plugins=PluginManager([Plugin()], load_entrypoints=False), **options)
    assert bare.processor.eos_token_ids == (9,)

"""Structured outputs offline: the parameters, the manager's masks and commits (drafts consumed
and rolled back, only committed tokens kept, through rejections and preemption), greedy identity
with drafts, and the cheap request parameters that share the mask path."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from specloop import LLM, SamplingParams, StructuredOutputsParams
from specloop.frontend.model_path import default_model_dir
from specloop.kernel.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerOutput
from specloop.kernel.request import Request, RequestStatus
from specloop.sampling.grammar import StructuredOutputs
from specloop.sampling.llguidance_backend import LLGuidanceBackend

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "kind": {"enum": ["cat", "dog", "fish"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
    "required": ["name", "kind", "age", "tags"], "additionalProperties": False}
PROMPTS = ["The pet record:", "def f(x):\n    return", "JSON please"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_model_len=256)


@pytest.fixture(scope="module")
def llm_ngram() -> LLM:
    return LLM(device="cpu", max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                    "prompt_lookup_min": 1})


def test_params_want_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="unknown fields"):
        StructuredOutputsParams.from_any({"jsn": {}})
    assert StructuredOutputsParams(json={"b": 1, "a": 2}).key == StructuredOutputsParams(json='{"a": 2, "b": 1}').key


def _manager() -> tuple[StructuredOutputs, object]:
    backend = LLGuidanceBackend(default_model_dir(), 8192)
    return StructuredOutputs(backend, 8192), backend


def _ids(text: str) -> list[int]:
    from specloop.frontend.tokenizer import Tokenizer

    return Tokenizer(default_model_dir()).encode(text, add_special_tokens=False)


def _allowed(bitmask: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def test_masks_follow_the_drafts_and_the_matcher_keeps_only_committed_tokens():
    so, backend = _manager()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes please", "no thanks"]))
    request = Request("r", [5, 6, 7], params, eos_token_ids=(0,))
    so.add_request(request)
    assert request.status == RequestStatus.WAITING_FOR_GRAMMAR and so.has_pending()
    ready, failed = so.take_ready(wait=True)
    while not ready and not failed:
        ready, failed = so.take_ready(wait=True)
    assert ready == [request] and request.status == RequestStatus.WAITING
    yes, no = _ids("yes"), _ids("no")
    drafts = [yes[0], no[0], yes[0]]  # the second draft is refused after the first
    request.num_computed_tokens = request.num_tokens + len(drafts)  # the plan reaches its end: it samples
    plan = SchedulerOutput(1, [], [], [], {"r": 4}, 4, scheduled_spec_decode_tokens={"r": drafts})
    grammar = so.grammar_bitmask(plan)
    assert grammar.req_ids == ["r"] and grammar.num_rows == [4]
    mask = grammar.bitmask
    assert _allowed(mask, 0, yes[0]) and _allowed(mask, 0, no[0])  # the start: either choice
    assert not _allowed(mask, 1, no[0])  # after "yes" comes " please", never "no"
    # The target rejected the second draft and chose the rest of "yes please" itself.
    rest = _ids("yes please")[1:]
    request.num_computed_tokens = request.num_tokens + 1
    so.commit(EngineCoreOutputs([EngineCoreOutput("r", [yes[0], *rest])]))
    fresh = backend.matcher(backend.compile(params.structured_outputs, (0,)))
    assert backend.accept(fresh, [yes[0], *rest])
    request.num_computed_tokens = request.num_tokens
    after = so.grammar_bitmask(SchedulerOutput(2, [], [], [], {"r": 1}, 1)).bitmask
    reference = np.full_like(after, -1)
    backend.fill_bitmask(reference, [(fresh, 0, [])])
    assert np.array_equal(after, reference) and _allowed(after, 0, 0)  # complete: EOS only
    so.commit(EngineCoreOutputs([EngineCoreOutput("r", [0], finish_reason="stop")]))
    assert not so.matchers


def test_accept_many_equals_accept_one_by_one():
    """The batched commit (single tokens on llguidance's threads) leaves every matcher where
    one-by-one ``accept`` does and reports the same refusals: single and several tokens, a
    refused token, a complete grammar given EOS."""
    _, backend = _manager()
    params = StructuredOutputsParams(choice=["yes please", "no thanks"])
    compiled = backend.compile(params, (0,))
    yes, no = _ids("yes please"), _ids("no thanks")
    feeds = [[yes[0]], yes[:2], [no[0]], [yes[0], no[0]], [no[0]], []]
    done = backend.matcher(compiled)
    assert backend.accept(done, yes)
    many, one = [backend.matcher(compiled) for _ in feeds] + [done], \
        [backend.matcher(compiled) for _ in feeds] + [done.deep_copy()]
    feeds.append([0])
    refused = backend.accept_many(list(zip(many, feeds)))
    assert refused == [not backend.accept(m, t) for m, t in zip(one, feeds)]
    assert refused[3] and not any(refused[:3])
    masks = [np.full((len(feeds), 256), -1, dtype=np.int32) for _ in range(2)]
    for mask, matchers in zip(masks, (many, one)):
        backend.fill_bitmask(mask, [(m, i, []) for i, m in enumerate(matchers) if not m.is_error()])
    assert np.array_equal(masks[0], masks[1])


def test_invalid_constraints_are_refused_and_the_engine_lives_on(llm):
    for bad, match in (({"type": "nonsense"}, "schema"), ({"type": "object", "properties": {"a": {"uniqueItems": True,
                                                                                                    "type": "array"}}},
                                                             "uniqueItems")):
        with pytest.raises(ValueError, match=match):
            llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json=bad)), use_tqdm=False)
    with pytest.raises(ValueError, match="regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b")), use_tqdm=False)
    out = llm.generate("x", SamplingParams(max_tokens=12, temperature=0.0,
                                           structured_outputs={"regex": "[0-9]{3}-[0-9]{2}"}), use_tqdm=False)
    assert out[0].outputs[0].text[:6].replace("-", "").isdigit() and out[0].outputs[0].text[3] == "-"


def test_allowed_token_ids_the_grammar_never_allows_first_are_refused(llm):
    """Every token such a request could sample would be one its grammar forbids (it used to sample
    token 0 and log the grammar's refusal); one the grammar allows first is served, constrained."""
    choice = {"choice": ["yes please", "no thanks"]}
    first = [_ids("yes please")[0], _ids("no thanks")[0]]
    with pytest.raises(ValueError, match="allowed_token_ids holds no token the structured_outputs grammar allows"):
        llm.generate("x", SamplingParams(structured_outputs=choice, allowed_token_ids=[5, 6, 7]), use_tqdm=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=choice,
                            allowed_token_ids=sorted(set(first + _ids("yes please") + _ids("no thanks"))))
    assert llm.generate("x", params, use_tqdm=False)[0].outputs[0].text in ("yes please", "no thanks")


async def test_the_async_engine_takes_a_dict_of_fields_too():
    """``AsyncEngine.generate`` compiles the grammar before it validates the rest: a dict of the
    params' fields is taken there as ``LLM.generate`` takes it, and an unknown field is a
    ``ValueError`` naming it, not an ``AttributeError``."""
    from specloop import AsyncEngine

    engine = AsyncEngine.from_engine_args(device="cpu", max_model_len=256)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs={"regex": "[0-9]{3}-[0-9]{2}"})
        outs = [o async for o in engine.generate("x", params, "a")]
        text = outs[-1].outputs[0].text
        assert text[:3].isdigit() and text[3] == "-" and text[4:6].isdigit()
        with pytest.raises(ValueError, match="unknown fields.*'regexp'"):
            bad = SamplingParams(structured_outputs={"regexp": "[0-9]+"})
            [o async for o in engine.generate("x", bad, "b")]
        with pytest.raises(ValueError, match="sampling params must be a SamplingParams, got dict"):
            [o async for o in engine.generate("x", {"max_tokens": 2}, "c")]
        assert engine.is_running
    finally:
        await engine.shutdown()


def _json_params(temperature: float, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=120, seed=7,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA), **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm, temperature):
    for out in llm.generate(PROMPTS, _json_params(temperature), use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_greedy_is_identical_with_drafts_under_a_grammar(llm, llm_ngram):
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _json_params(0.0), use_tqdm=False)]
    before = llm_ngram.get_metrics()
    spec = [o.outputs[0].token_ids for o in llm_ngram.generate(PROMPTS, _json_params(0.0), use_tqdm=False)]
    after = llm_ngram.get_metrics()
    assert spec == plain
    drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert drafted > 0 and accepted < drafted  # drafts were verified, and the grammar rejected some


def test_rows_after_an_ended_grammar_s_eos_draft_allow_only_what_it_ends_with():
    """A complete grammar allows only EOS; with ``ignore_eos`` or ``min_tokens`` the request goes on
    and drafts may hold EOS. llguidance leaves the rows after it unmasked, which would sample
    anything there: they get the ended grammar's mask, as steps without drafts do."""
    _, backend = _manager()
    params = StructuredOutputsParams(choice=["no", "yes"])
    (no,) = _ids("no")
    for committed, drafts, ended_from in (([no], [0, 5, 7], 0), ([], [no, 0, 5], 1)):
        matcher = backend.matcher(backend.compile(params, (0,)))
        assert backend.accept(matcher, committed)
        mask = np.full((4, 256), -1, dtype=np.int32)
        backend.fill_bitmask(mask, [(matcher, 0, drafts)])
        for row in range(ended_from, 4):
            assert _allowed(mask, row, 0) and not any(_allowed(mask, row, t) for t in range(1, 8192)), (drafts, row)
    ended = backend.matcher(backend.compile(params, (0,)))
    assert backend.accept(ended, [no, 0, 0]) and not backend.accept(ended, [5])  # past the end: EOS only
    mask = np.full((4, 256), -1, dtype=np.int32)  # a draft refused before the end: the rows after it stay as they were
    backend.fill_bitmask(mask, [(backend.matcher(backend.compile(params, (0,))), 0, [no, 7, 5])])
    assert not _allowed(mask, 1, 7) and (mask[2] == -1).all()


def test_greedy_past_an_ended_grammar_is_identical_with_drafts(llm, llm_ngram):
    """ignore_eos past a complete grammar: EOS after EOS without drafts, and the same with n-gram
    drafts (which propose EOS there; the rows after an accepted EOS draft sampled anything)."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                            structured_outputs={"choice": ["yes", "no"]})
    plain = llm.generate(PROMPTS, params, use_tqdm=False)
    before = llm_ngram.get_metrics()
    spec = llm_ngram.generate(PROMPTS, params, use_tqdm=False)
    accepted = llm_ngram.get_metrics()["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain] and accepted > 0
    assert all(o.outputs[0].text in ("yes", "no") and len(o.outputs[0].token_ids) == 16 for o in plain)


def test_preempted_requests_keep_their_grammar(llm):
    small = LLM(device="cpu", max_model_len=128, num_kv_blocks=14, block_size=16)
    params = _json_params(0.0)
    params.max_tokens = 100
    prompts = [p * 3 for p in PROMPTS] + ["Another pet:" * 3]
    want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].text for o in small.generate(prompts, params, use_tqdm=False)]
    assert small.get_metrics()["num_preemptions"] > 0
    assert got == want


def test_allowed_token_ids_and_bad_words(llm):
    allowed = _ids(" the cat")
    out = llm.generate("Once upon", SamplingParams(max_tokens=8, temperature=1.0, seed=3, allowed_token_ids=allowed),
                       use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    greedy = llm.generate("def f(x):\n    return", SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    word = greedy[0].outputs[0].text.split()[0]
    banned = llm.generate("def f(x):\n    return", SamplingParams(max_tokens=6, temperature=0.0, bad_words=[word]),
                          use_tqdm=False)[0].outputs[0].text
    assert word not in banned.split()[:1]


def test_get_tokenizer_has_the_hugging_face_methods(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("hello world")
    assert tok(["hello world"])["input_ids"] == [ids] and tok.decode(ids) == "hello world"
    assert tok.batch_decode([ids, ids]) == ["hello world"] * 2 and len(tok) == 8192
    assert "".join(tok.convert_ids_to_tokens(ids)).replace("Ġ", " ") == "hello world"
    conv = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(conv, add_generation_prompt=True) == tok.encode(text, add_special_tokens=False)
    assert tok.eos_token_id == 0 and tok.eos_token == "<|endoftext|>"


# vLLM's SamplingParams arguments: each works, or raises an error that names it.
VLLM_SAMPLING_ARGS = {
    "n": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "temperature": 0.5,
    "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 1, "stop": ["x"], "stop_token_ids": [5], "ignore_eos": True,
    "max_tokens": 4, "min_tokens": 1, "logprobs": 2, "prompt_logprobs": 1, "detokenize": True,
    "skip_special_tokens": False, "spaces_between_special_tokens": True, "include_stop_str_in_output": True,
    "truncate_prompt_tokens": 3, "structured_outputs": StructuredOutputsParams(regex="a"), "logit_bias": {5: 1.0},
    "allowed_token_ids": [5, 6], "bad_words": ["x"], "extra_args": {"k": 1},
    "best_of": 2, "logits_processors": [], "output_kind": 1, "guided_decoding": None,
}


@pytest.mark.parametrize("name", sorted(VLLM_SAMPLING_ARGS))
def test_every_vllm_sampling_argument_works_or_is_refused_by_name(name):
    try:
        params = SamplingParams(**{name: VLLM_SAMPLING_ARGS[name]})
    except (TypeError, ValueError) as e:
        assert name in str(e)
        return
    assert getattr(params, name) is not None


def test_misspelt_speculative_config_keys_are_refused():
    from specloop.kernel.config import SpeculativeConfig

    with pytest.raises(ValueError, match="num_speculative_token"):
        SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 2, "num_speculative_token": 3})


def test_cache_salt_separates_prefix_caches(llm):
    prompt = "x = 1\n" * 40  # several full blocks
    params = SamplingParams(max_tokens=1)

    def hits(**salt) -> int:
        before = llm.get_metrics()["prefix_cache_hits"]
        llm.generate([{"prompt": prompt, **salt}], params, use_tqdm=False)
        return llm.get_metrics()["prefix_cache_hits"] - before

    hits()
    assert hits() > 0  # the same prompt again: cached
    assert hits(cache_salt="tenant-a") == 0  # another salt: not shared
    assert hits(cache_salt="tenant-a") > 0


def test_a_grammar_that_fails_in_the_engine_finishes_its_request_only(llm):
    core = llm.core
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a(b"))
    good = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    core.add_requests([Request("bad", [5, 6], bad, eos_token_ids=(0,)), Request("good", [5, 6], good, eos_token_ids=(0,))])
    outs = {}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            outs.setdefault(out.req_id, []).append(out)
        core.post_step()
    assert outs["bad"][-1].finish_reason == "abort" and "regex" in outs["bad"][-1].error
    assert outs["good"][-1].finished and outs["good"][-1].finish_reason != "error"


def test_constraints_that_leave_no_token_mid_generation_finish_the_request_with_an_error(llm):
    """A grammar whose next token the request's ``allowed_token_ids`` all forbid, past the first
    token: the request finishes there as aborted with an error naming the constraints (it used to
    sample token 0 and go on), without that step's token, its blocks freed; others go on."""
    a, b = _ids("a"), _ids("b")
    assert len(a) == len(b) == 1
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs={"regex": "[ab]{2}c"},
                            allowed_token_ids=a + b)
    good = SamplingParams(max_tokens=6, temperature=0.0, structured_outputs={"regex": "[ab]{2}c"})
    bad, fine = llm.generate(["x", "x"], [params, good], use_tqdm=False)
    out = bad.outputs[0]
    assert out.finish_reason == "abort" and out.token_ids and set(out.token_ids) <= set(a + b)
    assert len(out.token_ids) == 2 and "after 2 generated tokens" in bad.error and "allowed_token_ids" in bad.error
    assert fine.error is None and fine.outputs[0].text.endswith("c") and fine.outputs[0].finish_reason == "stop"
    kv = llm.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks - 1 and not llm.core.has_unfinished_requests(), "KV blocks leaked"


async def test_the_async_engine_raises_a_value_error_for_a_request_it_refused_while_running():
    from specloop import AsyncEngine

    a, b = _ids("a"), _ids("b")
    engine = AsyncEngine.from_engine_args(device="cpu", max_model_len=256)
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs={"regex": "[ab]{2}c"},
                                allowed_token_ids=a + b)
        with pytest.raises(ValueError, match="structured_outputs: after 2 generated tokens"):
            async for _ in engine.generate("x", params, "a"):
                pass
        good = SamplingParams(max_tokens=4, temperature=0.0)
        assert [o async for o in engine.generate("x", good, "b")][-1].finished
    finally:
        await engine.shutdown()

"""The frontends end to end on a tiny random Qwen2 checkpoint (the torch runner), with transformers'
greedy generation and log-softmax as the oracle and the test tokenizer as ``tokenizer=``."""

import asyncio

import hf_models
import pytest
import torch
from tokenizer_helpers import build_tokenizer

from specloop import LLM, AsyncEngine, SamplingParams
from specloop.frontend.tokenizer import Tokenizer

GREEDY = dict(temperature=0.0, ignore_eos=True)


def hf_greedy(model, prompt, n):
    """transformers' greedy tokens. The attention mask is explicit: the test tokenizer's BOS is id 0,
    which ``generate`` would otherwise take for padding."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model():
    return hf_models.tiny("qwen2")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=hf_models.VOCAB)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer(tok_dir)


@pytest.fixture(scope="module")
def llm(model, tok_dir):
    return LLM(model.path, tokenizer=tok_dir, max_model_len=256, num_kv_blocks=96, block_size=8, max_num_seqs=4)


def test_llm_greedy_matches_transformers(llm, model, tok):
    texts = ["Hello world", "你好，世界", "The quick brown fox 😀", "Numbers 0123"]
    id_prompts = hf_models.prompts(4, seed=1)
    prompts = [*texts, *({"prompt_token_ids": p} for p in id_prompts)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)
    assert llm.model_name == "qwen2" and llm.processor.eos_token_ids == (tok.eos_token_id, 2, 3)
    seen = set()
    for i, (prompt, out) in enumerate(zip([tok.encode(t) for t in texts] + id_prompts, outs)):
        expected = hf_greedy(model, prompt, 10)
        completion = out.outputs[0]
        assert out.prompt_token_ids == prompt and completion.token_ids == expected
        if i < len(texts):
            assert completion.text == tok.decode(expected)
        else:
            # Random ids may end the prompt mid-character; that character then starts the output.
            full = tok.decode(prompt + expected)
            assert full.endswith(completion.text) and tok.decode(prompt).startswith(full[:-len(completion.text)])
        seen.add(tuple(expected))
    assert len(seen) == len(prompts)  # the comparison is not vacuous: every prompt continues differently


def test_chat_prompt_greedy_matches_transformers(llm, model, tok):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]
    out = llm.chat(conv, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    ids = tok.encode(tok.apply_chat_template(conv), add_special_tokens=False)
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == hf_greedy(model, ids, 8)


def test_logprobs_match_transformers(llm, model):
    prompt = hf_models.prompts(1, seed=2)[0]
    params = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, **GREEDY)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    full = prompt + completion.token_ids
    ref = torch.log_softmax(model.logits(full), dim=-1)
    for i, (tid, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert entry[tid].logprob == pytest.approx(row[tid].item(), abs=1e-4) and entry[tid].rank == 1
        top = row.topk(3)
        assert [t for t in entry if entry[t].rank <= 3] == top.indices.tolist()
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t].logprob == pytest.approx(lp, abs=1e-4)
        assert entry[tid].decoded_token == llm.get_tokenizer().token_text(tid)
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                              zip(completion.token_ids, completion.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        assert out.prompt_logprobs[pos][prompt[pos]].logprob == pytest.approx(ref[pos - 1][prompt[pos]].item(),
                                                                             abs=1e-4)


def test_stop_string_on_real_output(llm, model, tok):
    prompt = tok.encode("The quick brown fox")
    expected = hf_greedy(model, prompt, 24)
    pieces = [tok.decode([t]) for t in expected]
    j = next(j for j in range(2, len(pieces) - 1)
             if pieces[j] and pieces[j + 1] and "\ufffd" not in pieces[j] + pieces[j + 1])
    stop = pieces[j][-1] + pieces[j + 1][0]
    full = tok.decode(expected)
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=24, stop=[stop], **GREEDY),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == full[:full.find(stop)]
    assert out.token_ids == expected[:len(out.token_ids)] and len(out.token_ids) < 24
    assert not llm.core.has_unfinished_requests()


def test_seeded_n_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = {"prompt_token_ids": hf_models.prompts(1, seed=3)[0]}
    alone = llm.generate(prompt, params, use_tqdm=False)[0]
    crowd = llm.generate([{"prompt_token_ids": p} for p in hf_models.prompts(3, seed=4)] + [prompt],
                         SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True), use_tqdm=False)
    batched = llm.generate([prompt, crowd[0].prompt_token_ids], [params, SamplingParams(max_tokens=5)],
                           use_tqdm=False)[0]
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in batched.outputs]
    # Each child has its own seed, so the completions differ.
    assert len({tuple(o.token_ids) for o in alone.outputs}) > 1


async def test_async_engine_streams_match_transformers(model, tok_dir):
    engine = AsyncEngine.from_engine_args(model.path, tokenizer=tok_dir, max_model_len=128, num_kv_blocks=96,
                                          block_size=8)
    try:
        prompts = hf_models.prompts(4, seed=5)

        async def stream(i, p):
            deltas = [o async for o in engine.generate(p, SamplingParams(max_tokens=10, **GREEDY), f"r{i}",
                                                       delta=True)]
            return [t for o in deltas for t in o.outputs[0].token_ids], "".join(o.outputs[0].text for o in deltas)

        async def bad():
            await asyncio.sleep(0.01)
            with pytest.raises(ValueError, match="maximum context length is 128"):
                async for _ in engine.generate([5] * 120, SamplingParams(max_tokens=20), "bad"):
                    pass

        *results, _ = await asyncio.gather(*(stream(i, p) for i, p in enumerate(prompts)), bad())
        for p, (tokens, text) in zip(prompts, results):
            assert tokens == hf_greedy(model, p, 10)
            full = engine.tokenizer.decode(p + tokens)
            assert full.endswith(text) and engine.tokenizer.decode(p).startswith(full[:-len(text)])
    finally:
        await engine.shutdown()

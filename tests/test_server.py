"""The OpenAI-compatible server, driven through the official ``openai`` client against the real
server (uvicorn on a loopback port) on a tiny Qwen3 model."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest
from server_fixtures import ServerThread, make_engine, scrape, tiny_model_dir
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import specloop
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.plugins import PluginManager
from specloop.server.app import build_app

MODEL = "tiny"
GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


class HelloRoute:
    """A third-party plugin adding a route through the same hook the built-in routes use."""

    @hookimpl
    def specloop_register_routes(self, register: Any) -> None:
        def factory(state: Any) -> Route:
            async def hello(request: Request) -> JSONResponse:
                return JSONResponse({"hello": state.model_name, "max_model_len": state.max_model_len})
            return Route("/plugin/hello", hello, methods=["GET"])
        register("hello", factory)


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def server(request: Any) -> Any:
    """The engine in this process, and in its own (``specloop serve``'s default), where the routes,
    tokenization and output processing still run here."""
    engine = make_engine(tiny_model_dir(), plugins=PluginManager([HelloRoute()]),
                         engine_process=request.param == "engine-process")
    with ServerThread(build_app(engine, served_model_name=MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def tokenize(server: ServerThread, **body: Any) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_models_health_version(server: ServerThread, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": specloop.__version__}


def test_completion_stream_matches_non_stream_and_usage_is_exact(server: ServerThread, client: openai.OpenAI) -> None:
    prompt = "The quick brown fox"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, extra_body=NO_EOS, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == len(tokenize(server, prompt=prompt))
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.id.startswith("cmpl-") and full.object == "text_completion" and full.model == MODEL

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True, logprobs=0,
                                       stream_options={"include_usage": True}, extra_body=NO_EOS, **GREEDY)
    chunks = list(stream)
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0] and chunks[-1].choices == []
    streamed_tokens = sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices)
    assert usage_chunks[0].usage.completion_tokens == streamed_tokens == 12
    assert usage_chunks[0].usage.prompt_tokens == full.usage.prompt_tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]


def test_chat_stream_and_non_stream(server: ServerThread, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                          extra_body=NO_EOS, **GREEDY)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10
    flat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert full.usage.prompt_tokens == len(tokenize(server, messages=flat))

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n2_completions_and_chat(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello", n=2, max_tokens=6, temperature=1.0, seed=7,
                                    extra_body=NO_EOS)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 12

    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                            max_tokens=5, temperature=1.0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS)
    finishes: dict[int, list[str]] = {0: [], 1: []}
    chunks = list(stream)
    for c in chunks:
        for ch in c.choices:
            if ch.finish_reason:
                finishes[ch.index].append(ch.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"]}
    assert chunks[-1].usage.completion_tokens == 10


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    prompt = "Numbers 0123"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, extra_body=NO_EOS, **GREEDY)
    text = base.choices[0].text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 2)
                if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    expected = text[:text.index(stop)]
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stop=[stop], stream=stream,
                                        extra_body=NO_EOS, **GREEDY)
        chunks = list(out) if stream else [out]
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        assert got == expected
        last = [c.choices[0] for c in chunks if c.choices][-1]
        assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == stop


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, logprobs=3,
                                    extra_body=NO_EOS, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # The chosen token plus the top 3; tokens that decode to the same text share one key.
        assert chosen <= 0.0 and 1 <= len(top) <= 4
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-5)  # greedy picks the argmax
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                         logprobs=True, top_logprobs=2, extra_body=NO_EOS, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-5)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token


def test_token_id_prompts_match_text_prompts(server: ServerThread, client: openai.OpenAI) -> None:
    texts = ["Hello world", "A paged KV cache"]
    ids = [tokenize(server, prompt=t) for t in texts]
    by_text = [client.completions.create(model=MODEL, prompt=t, max_tokens=8, extra_body=NO_EOS, **GREEDY)
               .choices[0].text for t in texts]
    single = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=8, extra_body=NO_EOS, **GREEDY)
    assert single.choices[0].text == by_text[0]
    assert single.usage.prompt_tokens == len(ids[0])
    batch = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, extra_body=NO_EOS, **GREEDY)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == by_text
    assert batch.usage.prompt_tokens == len(ids[0]) + len(ids[1]) and batch.usage.completion_tokens == 16


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, extra_body=NO_EOS, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, echo=True, extra_body=NO_EOS,
                                       **GREEDY)
    assert echoed.choices[0].text == "Hello" + plain.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(server: ServerThread, client: openai.OpenAI) -> None:
    prompt_len = len(tokenize(server, prompt="Hello world"))
    out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, echo=True, logprobs=1,
                                    extra_body=NO_EOS, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == prompt_len + 3
    assert lp.token_logprobs[0] is None and all(v <= 0.0 for v in lp.token_logprobs[1:])
    stream = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, echo=True, logprobs=1,
                                            stream=True, extra_body=NO_EOS, **GREEDY))
    first = stream[0].choices[0]
    assert first.text == "Hello world" and first.logprobs.token_logprobs == lp.token_logprobs[:prompt_len]
    streamed = [v for c in stream for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_max_tokens_defaults_to_what_fits(server: ServerThread, client: openai.OpenAI) -> None:
    ids = tokenize(server, prompt="Hello world")
    room = 16
    prompt = (ids * 100)[:server.app.state.specloop.max_model_len - room]
    out = client.completions.create(model=MODEL, prompt=prompt, extra_body=NO_EOS, **GREEDY)
    assert out.usage.completion_tokens == room and out.choices[0].finish_reason == "length"


def test_tokenize_detokenize_round_trip(server: ServerThread) -> None:
    text = "Hello world! 你好"
    tokens = tokenize(server, prompt=text, add_special_tokens=False)
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens})
    assert r.status_code == 200 and r.json() == {"prompt": text}


def test_plugin_route(server: ServerThread) -> None:
    r = httpx.get(f"{server.url}/plugin/hello")
    assert r.status_code == 200 and r.json() == {"hello": MODEL, "max_model_len": 256}


def test_metrics_parse_and_count(server: ServerThread, client: openai.OpenAI) -> None:
    before = scrape(server.url)
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, extra_body=NO_EOS, **GREEDY)
    after = scrape(server.url)
    for name in ("specloop:num_requests_running", "specloop:num_requests_waiting", "specloop:kv_cache_usage_perc",
                 "specloop:prefix_cache_queries_total", "specloop:prefix_cache_hits_total",
                 "specloop:num_preemptions_total", "specloop:spec_decode_num_drafts_total",
                 "specloop:spec_decode_num_draft_tokens_total", "specloop:spec_decode_num_accepted_tokens_total"):
        assert name in after, name
    assert after["specloop:generation_tokens_total"] - before.get("specloop:generation_tokens_total", 0) == 5
    assert after["specloop:prompt_tokens_total"] > before.get("specloop:prompt_tokens_total", 0)
    key = "specloop:request_success_total{finished_reason=length}"
    assert after[key] - before.get(key, 0) == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        name = f"specloop:{hist}_count"
        assert after[name] - before.get(name, 0) == 1, name
    assert after["specloop:num_requests_running"] == 0

"""Bad input gets a 4xx in OpenAI's error shape (never a 500); API keys, limits, and an engine that
dies mid-stream."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from server_fixtures import MAX_MODEL_LEN, VOCAB_SIZE, ServerThread, make_engine, tiny_model_dir

from specloop.backends.scripted import ScriptedModelRunner
from specloop.frontend.async_engine import AsyncEngine
from specloop.kernel.config import EngineConfig
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.plugins import PluginManager
from specloop.server.app import ServerLimits, build_app

MODEL = "tiny"
BAD = "invalid_request_error"


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def server(request: Any) -> Any:
    engine = make_engine(tiny_model_dir(), engine_process=request.param == "engine-process")
    with ServerThread(build_app(engine, served_model_name=MODEL)) as srv:
        yield srv


def assert_error_shape(r: httpx.Response, status: int, type_: str, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == type_
    assert error["param"] == param, error
    return error


LONG = [5] * MAX_MODEL_LEN
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (endpoint, body: raw bytes or a JSON value, status, error type, param)
CASES: list[tuple[str, Any, int, str, str | None]] = [
    (C, b"{", 400, BAD, None),
    (C, b"not json at all", 400, BAD, None),
    (C, b"", 400, BAD, None),
    (C, [1, 2], 400, BAD, None),
    (C, "a string", 400, BAD, None),
    (C, None, 400, BAD, None),
    (C, {}, 400, BAD, "prompt"),
    (C, {"prompt": 5}, 400, BAD, "prompt"),
    (C, {"prompt": [1, "a"]}, 400, BAD, "prompt"),
    (C, {"prompt": "x", "max_tokens": "ten"}, 400, BAD, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": True}, 400, BAD, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 2.5}, 400, BAD, "max_tokens"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, BAD, "temperature"),
    (C, {"prompt": "x", "stop": 5}, 400, BAD, "stop"),
    (C, {"prompt": "x", "stop": ["ok", 3]}, 400, BAD, "stop"),
    (C, {"prompt": "x", "n": 1.5}, 400, BAD, "n"),
    (C, {"prompt": "x", "stream": "yes"}, 400, BAD, "stream"),
    (C, {"prompt": "x", "seed": "s"}, 400, BAD, "seed"),
    (C, {"prompt": "x", "logit_bias": [1]}, 400, BAD, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"a": 1}}, 400, BAD, "logit_bias"),
    (C, {"prompt": "x", "logit_bias": {"1": "up"}}, 400, BAD, "logit_bias"),
    (C, {"prompt": "x", "echo": 1}, 400, BAD, "echo"),
    (C, {"prompt": "x", "stop_token_ids": "1"}, 400, BAD, "stop_token_ids"),
    (C, {"prompt": "x", "temperature": -1}, 400, BAD, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, BAD, "top_p"),
    (C, {"prompt": "x", "top_p": 1.5}, 400, BAD, "top_p"),
    (C, {"prompt": "x", "top_k": -2}, 400, BAD, "top_k"),
    (C, {"prompt": "x", "min_p": 2}, 400, BAD, "min_p"),
    (C, {"prompt": "x", "n": 0}, 400, BAD, "n"),
    (C, {"prompt": "x", "n": 17}, 400, BAD, "n"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, BAD, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": -5}, 400, BAD, "max_tokens"),
    (C, {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, BAD, "min_tokens"),
    (C, {"prompt": "x", "presence_penalty": 3}, 400, BAD, "presence_penalty"),
    (C, {"prompt": "x", "frequency_penalty": -3}, 400, BAD, "frequency_penalty"),
    (C, {"prompt": "x", "repetition_penalty": 0}, 400, BAD, "repetition_penalty"),
    (C, {"prompt": "x", "logprobs": 21}, 400, BAD, "logprobs"),
    (C, {"prompt": "x", "logprobs": -1}, 400, BAD, "logprobs"),
    (C, {"prompt": "x", "logit_bias": {"1": 200}}, 400, BAD, "logit_bias"),
    (C, {"prompt": ""}, 400, BAD, "prompt"),
    (C, {"prompt": []}, 400, BAD, "prompt"),
    (C, {"prompt": [""]}, 400, BAD, "prompt"),
    (C, {"prompt": [[]]}, 400, BAD, "prompt"),
    (C, {"prompt": ["ok", ""]}, 400, BAD, "prompt"),
    (C, {"prompt": LONG}, 400, BAD, "prompt"),
    (C, {"prompt": LONG[:200], "max_tokens": 100}, 400, BAD, "max_tokens"),
    (C, {"prompt": "x", "logit_bias": {"1000000": 1}}, 400, BAD, "logit_bias"),
    (C, {"prompt": "x", "stop_token_ids": [1000000]}, 400, BAD, "stop_token_ids"),
    (C, {"prompt": [1000000]}, 400, BAD, "prompt"),
    (C, {"prompt": [[3, 4], [-1]]}, 400, BAD, "prompt"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, BAD, "stream_options"),
    (C, {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}}, 400, BAD, "stream_options"),
    (C, {"prompt": "x", "stream": True, "stream_options": True}, 400, BAD, "stream_options"),
    (C, {"prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}}, 400, BAD,
     "stream_options.include_usage"),
    (C, {"prompt": "x", "suffix": "y"}, 400, BAD, "suffix"),
    (C, {"prompt": "x", "best_of": 3}, 400, BAD, "best_of"),
    (C, {"prompt": ["x"] * 65}, 400, BAD, "prompt"),
    (C, {"prompt": "x", "model": "no-such-model"}, 404, BAD, "model"),
    (CHAT, {}, 400, BAD, "messages"),
    (CHAT, {"messages": []}, 400, BAD, "messages"),
    (CHAT, {"messages": "hi"}, 400, BAD, "messages"),
    (CHAT, {"messages": ["hi"]}, 400, BAD, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, BAD, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, BAD, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     BAD, "messages"),
    (CHAT, {"messages": [{"role": "developer", "content": "hi"}]}, 400, BAD, "messages"),  # the template refuses it
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, BAD, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, BAD, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": "yes"}, 400, BAD, "logprobs"),
    (CHAT, {"messages": USER, "max_completion_tokens": "x"}, 400, BAD, "max_completion_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 10_000}, 400, BAD, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hello world " * 200}]}, 400, BAD, "messages"),
    (CHAT, {"messages": USER, "temperature": -0.5}, 400, BAD, "temperature"),
    (CHAT, {"messages": USER, "stream_options": {"include_usage": True}}, 400, BAD, "stream_options"),
    (CHAT, {"messages": USER, "model": "gpt-4"}, 404, BAD, "model"),
    ("/tokenize", {}, 400, BAD, "prompt"),
    ("/tokenize", {"prompt": 3}, 400, BAD, "prompt"),
    ("/detokenize", {}, 400, BAD, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, 400, BAD, "tokens"),
    ("/detokenize", {"tokens": [1000000]}, 400, BAD, "tokens"),
]


@pytest.mark.parametrize("path,body,status,type_,param", CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[-1]}" for i, c in enumerate(CASES)])
def test_bad_input(server: ServerThread, path: str, body: Any, status: int, type_: str, param: str | None) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"})
    assert_error_shape(r, status, type_, param)


def test_context_errors_say_the_numbers(server: ServerThread) -> None:
    r = httpx.post(server.url + C, json={"prompt": LONG[:200], "max_tokens": 100})
    error = assert_error_shape(r, 400, BAD, "max_tokens")
    assert error["code"] == "context_length_exceeded"
    for number in ("256", "300", "200", "100"):
        assert number in error["message"]
    r = httpx.post(server.url + C, json={"prompt": LONG})
    error = assert_error_shape(r, 400, BAD, "prompt")
    assert "256" in error["message"] and error["code"] == "context_length_exceeded"


def test_wrong_routes_and_methods(server: ServerThread) -> None:
    assert_error_shape(httpx.get(server.url + "/v1/nothing-here"), 404, BAD, None)
    assert_error_shape(httpx.get(server.url + C), 405, BAD, None)


def test_server_survives_the_table(server: ServerThread) -> None:
    r = httpx.post(server.url + C, json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# --- API key and limits ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def guarded() -> Any:
    limits = ServerLimits(max_body_bytes=4096, max_n=2, max_prompts=2, max_prompt_tokens=50)
    app = build_app(make_engine(tiny_model_dir()), served_model_name=MODEL, api_key="sekret", limits=limits)
    with ServerThread(app) as srv:
        yield srv


def test_api_key(guarded: ServerThread) -> None:
    body = {"prompt": "Hello", "max_tokens": 2}
    error = assert_error_shape(httpx.post(guarded.url + C, json=body), 401, BAD, None)
    assert error["code"] == "invalid_api_key"
    wrong = {"Authorization": "Bearer nope"}
    assert_error_shape(httpx.post(guarded.url + C, json=body, headers=wrong), 401, BAD, None)
    assert_error_shape(httpx.get(guarded.url + "/v1/models"), 401, BAD, None)
    right = {"Authorization": "Bearer sekret"}
    assert httpx.post(guarded.url + C, json=body, headers=right).status_code == 200
    assert httpx.get(guarded.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0).models.list()
    models = openai.OpenAI(base_url=guarded.url + "/v1", api_key="sekret", max_retries=0).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_limits(guarded: ServerThread) -> None:
    auth = {"Authorization": "Bearer sekret"}
    big = {"prompt": "x" * 8000, "max_tokens": 2}
    error = assert_error_shape(httpx.post(guarded.url + C, json=big, headers=auth), 413, BAD, None)
    assert "4096" in error["message"]
    assert_error_shape(httpx.post(guarded.url + C, json={"prompt": "x", "n": 3}, headers=auth), 400, BAD, "n")
    assert_error_shape(httpx.post(guarded.url + C, json={"prompt": ["a", "b", "c"]}, headers=auth), 400, BAD,
                       "prompt")
    error = assert_error_shape(httpx.post(guarded.url + C, json={"prompt": [5] * 60}, headers=auth), 400, BAD,
                               "prompt")
    assert "50" in error["message"] and "60" in error["message"]
    ok = httpx.post(guarded.url + C, json={"prompt": [5] * 50, "max_tokens": 2}, headers=auth)
    assert ok.status_code == 200


# --- an engine that dies mid-stream ---------------------------------------------------------

class FailingRunner(ScriptedModelRunner):
    """The scripted runner, failing from its fifth step on (a stand-in for a device error)."""

    def execute_model(self, plan: Any) -> None:
        if self.num_executed >= 4:
            raise RuntimeError("simulated device failure")
        super().execute_model(plan)


class FailingPlugin:
    @hookimpl
    def specloop_register_model_runners(self, register: Any) -> None:
        register("failing", FailingRunner)


def test_engine_error_mid_stream() -> None:
    config = EngineConfig(model_runner="failing", tokenizer=tiny_model_dir(), max_model_len=MAX_MODEL_LEN,
                          plugin_options={"scripted": {"vocab_size": VOCAB_SIZE}})
    engine = AsyncEngine(config, PluginManager([FailingPlugin()]))
    with ServerThread(build_app(engine, served_model_name=MODEL)) as srv:
        events = []
        with httpx.stream("POST", srv.url + C, json={"prompt": "Hello", "max_tokens": 50, "stream": True,
                                                     "ignore_eos": True}) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        error = json.loads(events[-2])
        assert set(error) == {"error"} and "simulated device failure" in error["error"]["message"]
        assert error["error"]["type"] == "server_error"
        assert all("choices" in json.loads(e) for e in events[:-2])
        # The server stays up and says the engine is gone.
        dead = httpx.get(srv.url + "/health")
        assert_error_shape(dead, 503, "server_error", None)
        assert httpx.get(srv.url + "/v1/models").status_code == 200
        assert_error_shape(httpx.post(srv.url + C, json={"prompt": "Hello"}), 503, "server_error", None)
        with pytest.raises(openai.APIError):
            stream = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0).completions.create(
                model=MODEL, prompt="Hello", stream=True)
            list(stream)


def test_engine_error_during_a_non_streaming_request() -> None:
    config = EngineConfig(model_runner="failing", tokenizer=tiny_model_dir(), max_model_len=MAX_MODEL_LEN,
                          plugin_options={"scripted": {"vocab_size": VOCAB_SIZE}})
    engine = AsyncEngine(config, PluginManager([FailingPlugin()]))
    with ServerThread(build_app(engine, served_model_name=MODEL)) as srv:
        r = httpx.post(srv.url + CHAT, json={"messages": USER, "max_tokens": 50, "ignore_eos": True})
        error = assert_error_shape(r, 500, "server_error", None)
        assert "simulated device failure" in error["message"] and error["code"] == "engine_error"
        assert_error_shape(httpx.get(srv.url + "/health"), 503, "server_error", None)

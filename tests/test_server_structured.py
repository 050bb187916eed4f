"""Structured outputs, tool calls and the client details through the official ``openai`` client,
against the real server on the default model, plain and with ngram speculation."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_fixtures import ServerThread

from specloop.frontend.async_engine import AsyncEngine
from specloop.server.app import build_app

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "color": {"enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 1, "maximum": 50},
    "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
    "required": ["name", "color", "count", "items"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "Describe a thing as JSON."}]


@pytest.fixture(scope="module", params=["plain", "ngram", "process"])
def server(request: Any) -> Any:
    """The engine in this process, with and without drafts, and in its own process as ``specloop
    serve`` runs it (grammars and tool calls are then read apart from the core)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} if request.param == "ngram" else None
    engine = AsyncEngine.from_engine_args(None, device="cpu", max_model_len=512, speculative_config=spec,
                                          engine_process=request.param == "process")
    with ServerThread(build_app(engine)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(client: openai.OpenAI, temperature: float) -> None:
    r = client.chat.completions.create(model=_model(client), messages=MESSAGES, temperature=temperature, seed=3,
                                       max_tokens=150, n=2, response_format={"type": "json_schema", "json_schema": {
                                           "name": "thing", "schema": SCHEMA}})
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_choice_and_regex(client: openai.OpenAI) -> None:
    model = _model(client)
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=120, temperature=0.0,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=model, prompt="Answer:", max_tokens=10, temperature=1.0, n=3, seed=1,
                                  extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    assert all(c.text in ("alpha", "beta", "gamma") for c in r.choices)
    r = client.completions.create(model=model, prompt="Phone:", max_tokens=12, temperature=1.0,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text)
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, temperature=0.0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")


def test_invalid_constraints_are_400_naming_the_field(client: openai.OpenAI) -> None:
    model = _model(client)
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
              "response_format"),
             ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
             ({"extra_body": {"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}},
              "structured_outputs"),
             # no token the grammar allows first is allowed: refused before any stream starts
             ({"extra_body": {"guided_choice": ["yes", "no"], "allowed_token_ids": [5, 6]}}, "guided_choice")]
    for kwargs, param in cases:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, stream=stream, **kwargs)
            assert e.value.body["param"] == param
    assert client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3).choices  # still serving


def test_constraints_that_conflict_mid_generation_are_a_400(server: ServerThread, client: openai.OpenAI) -> None:
    """allowed_token_ids that hold the grammar's first tokens but not a later one: the request is a
    400 naming the conflict (streamed: an error event, then [DONE]), not tokens the grammar refused;
    the server serves on."""
    model = _model(client)
    tok = httpx.post(f"{server.url}/tokenize", json={"model": model, "prompt": "a"}).json()["tokens"] + \
        httpx.post(f"{server.url}/tokenize", json={"model": model, "prompt": "b"}).json()["tokens"]
    body = {"model": model, "prompt": "x", "max_tokens": 8, "temperature": 0.0, "allowed_token_ids": tok,
            "structured_outputs": {"regex": "[ab]{2}c"}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "after 2 generated tokens" in error["message"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "after 2 generated tokens" in json.loads(events[-2])["error"]["message"]
    assert client.completions.create(model=model, prompt="x", max_tokens=3).choices  # still serving


def test_forced_tool_calls_validate(client: openai.OpenAI) -> None:
    model = _model(client)
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], max_tokens=120,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], max_tokens=200,
                                       tool_choice="required", temperature=1.0, seed=5)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    # Streamed: the deltas, accumulated as a client does, are the same call.
    stream = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=120,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            stream=True)
    name, arguments, finish = "", "", None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            name += d.function.name or ""
            arguments += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_a_named_call_cut_short_is_the_same_call_streamed_or_not(client: openai.OpenAI) -> None:
    """A named function's arguments cut short by ``max_tokens`` (finish_reason "length"): the whole
    response holds them as that call's arguments, as the stream's deltas do (it used to return them
    as content while the stream sent a call)."""
    model = _model(client)
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], max_tokens=4,
                  temperature=0.0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length" and whole.message.content is None
    (call,) = whole.message.tool_calls
    streamed, names, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                names += [d.function.name] if d.function.name else []
                streamed += d.function.arguments or ""
            assert not c.delta.content
            finish = c.finish_reason or finish
    assert call.function.name == "get_weather" and names == ["get_weather"] and finish == "length"
    assert call.function.arguments == streamed and streamed.startswith("{")


def test_a_tool_round_trip_is_accepted(client: openai.OpenAI) -> None:
    model = _model(client)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=120,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'})
    r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=8)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # "auto" (the default with tools): the server's tool-call parser reads the text, streamed or not.
    for stream in (False, True):
        r = client.chat.completions.create(model=model, messages=messages[:1], tools=[WEATHER], tool_choice="auto",
                                           max_tokens=8, temperature=0.0, stream=stream)
        finish = ([c.choices[0].finish_reason for c in r if c.choices] if stream else [r.choices[0].finish_reason])[-1]
        assert finish in ("stop", "length", "tool_calls")


def test_client_details(server: ServerThread, client: openai.OpenAI) -> None:
    model = _model(client)
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    # echo with max_tokens 0: the prompt scored, nothing generated.
    r = client.completions.create(model=model, prompt="s = 1", max_tokens=0, echo=True, logprobs=1)
    assert r.choices[0].text == "s = 1" and r.usage.completion_tokens == 0
    assert r.choices[0].logprobs.token_logprobs[0] is None
    # text_offset counts characters of the text, also after multi-byte ones.
    prompt = "s = '中文é 😀'"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.text_offset[-1] == prompt.rindex("'")
    # Chat logprob bytes are the token's own (a token may hold part of a character).
    raw = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, max_tokens=4,
                                                           logprobs=True, top_logprobs=1,
                                                           logit_bias={"163": 100})
    assert raw.headers.get("x-request-id")
    content = raw.parse().choices[0].logprobs.content
    assert content[0].bytes != [239, 191, 189] and bytes(sum((c.bytes for c in content), []))
    r = httpx.post(f"{server.url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1},
                   headers={"X-Request-Id": "mine-123"})
    assert r.headers["x-request-id"] == "mine-123"


def test_refused_fields_name_themselves(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=_model(client), messages=MESSAGES, max_tokens=3,
                                       extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "use_beam_search"

"""Every request field OpenAI or vLLM defines for completions and chat either takes effect or is a
400 naming it: none is silently ignored."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_fixtures import ServerThread, make_engine, tiny_model_dir

from specloop.server import request_fields
from specloop.server.app import build_app

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}}, "required": ["a"]}}}
# OpenAI's fields and vLLM's extra ones, each with a value a client might send.
COMMON = {
    "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"5": 1}, "n": 1, "seed": 1, "stop": ["zz"],
    "stream": False, "stream_options": {"include_usage": True}, "temperature": 0.5, "top_p": 0.9, "user": "u", "max_tokens": 3,
    "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "stop_token_ids": [5], "ignore_eos": True, "min_tokens": 1,
    "include_stop_str_in_output": True, "skip_special_tokens": False, "spaces_between_special_tokens": True,
    "priority": 0, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"},
    "guided_json": {"type": "object"}, "guided_regex": "b+", "guided_choice": ["x", "y"], "guided_grammar": 'start: "q"',
    "guided_whitespace_pattern": " ", "guided_decoding_backend": "xgrammar", "bad_words": ["the"],
    "allowed_token_ids": [5, 6, 7], "truncate_prompt_tokens": 2, "prompt_logprobs": 1,
    "return_tokens_as_token_ids": True, "cache_salt": "s", "add_special_tokens": True, "request_id": "rid-1",
    "use_beam_search": True, "length_penalty": 2.0, "logits_processors": ["x"], "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1}, "prompt_embeds": "AAAA", "return_token_ids": True, "disable_any_whitespace": True,
    "mm_processor_kwargs": {"a": 1}, "logprobs": 1, "echo": True, "model": None,
}
COMPLETION = {**COMMON, "prompt": "hi", "best_of": 2, "suffix": "end"}
CHAT = {**COMMON, "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 3, "tools": [TOOL],
        "tool_choice": "auto", "parallel_tool_calls": False, "functions": [TOOL["function"]], "function_call": "auto",
        "add_generation_prompt": True, "continue_final_message": False, "chat_template_kwargs": {"x": 1},
        "documents": [{"title": "t", "text": "d"}], "chat_template": "{{ x }}", "metadata": {"k": "v"}, "store": True,
        "service_tier": "auto", "audio": {"voice": "x"}, "modalities": ["text", "audio"], "prediction": {"type": "content"},
        "web_search_options": {}, "reasoning_effort": "low", "verbosity": "low"}
CHAT.pop("guided_json")  # one constraint per request: the constraint fields are exercised one at a time below
COMPLETION.pop("guided_json")
# What a field needs beside it to make sense.
NEEDS = {"top_logprobs": {"logprobs": True}, "stream_options": {"stream": True}, "tool_choice": {"tools": [TOOL]},
         "parallel_tool_calls": {"tools": [TOOL]}, "function_call": {"functions": [TOOL["function"]]}}
CONSTRAINTS = ("response_format", "structured_outputs", "guided_regex", "guided_choice", "guided_grammar")


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def server(request: Any) -> Any:
    engine = make_engine(tiny_model_dir(), engine_process=request.param == "engine-process")
    with ServerThread(build_app(engine)) as srv:
        yield srv


def _send(server: ServerThread, path: str, base: dict[str, Any], name: str, value: Any) -> httpx.Response:
    body = dict(base)
    if name in CONSTRAINTS or name == "guided_json":
        for other in CONSTRAINTS:
            body.pop(other, None)
    if name in ("functions", "function_call"):
        body.pop("tools", None)
        body.pop("tool_choice", None)
    body.update(NEEDS.get(name, {}))
    body[name] = value
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_field_takes_effect_or_is_refused_by_name(server: ServerThread, endpoint: str) -> None:
    fields = COMPLETION if endpoint == "completions" else {**CHAT, "guided_json": {"type": "object"}}
    known = request_fields.COMPLETION_FIELDS if endpoint == "completions" else request_fields.CHAT_FIELDS
    if endpoint == "completions":
        fields = {**fields, "guided_json": {"type": "object"}}
    base = ({"prompt": "hello there", "max_tokens": 2} if endpoint == "completions"
            else {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    for name, value in fields.items():
        assert name in known or name in request_fields.REFUSED, f"{name} is neither handled nor refused"
        r = _send(server, path, base, name, value)
        if name in request_fields.REFUSED or name in ("guided_whitespace_pattern", "guided_decoding_backend", "suffix",
                                                      "best_of", "prompt_embeds"):
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
        else:
            assert r.status_code == 200, (name, r.text)


def test_cheap_fields_take_effect(server: ServerThread) -> None:
    url = server.url
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "prompt_logprobs": 1, "echo": True,
                                                       "return_tokens_as_token_ids": True, "logprobs": True}).json()
    assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) == r["usage"]["prompt_tokens"]
    assert r["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
    full = httpx.post(f"{url}/v1/completions", json={"prompt": "one two three four", "max_tokens": 1}).json()
    cut = httpx.post(f"{url}/v1/completions", json={"prompt": "one two three four", "max_tokens": 1,
                                                    "truncate_prompt_tokens": 2}).json()
    assert cut["usage"]["prompt_tokens"] == 2 < full["usage"]["prompt_tokens"]
    cont = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well, I"}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": cont, "max_tokens": 2, "echo": True,
                                                       "continue_final_message": True}).json()
    assert r["choices"][0]["message"]["content"].startswith("Well, I")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 1.0,
                                                  "allowed_token_ids": [7, 8], "logprobs": 0,
                                                  "return_tokens_as_token_ids": True}).json()
    assert set(r["choices"][0]["logprobs"]["tokens"]) <= {"token_id:7", "token_id:8"}

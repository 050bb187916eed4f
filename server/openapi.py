"""The OpenAPI 3.1 description of the built-in routes, served at ``GET /openapi.json``.

Written beside the parsers it describes (:mod:`specloop.server.protocol`, :mod:`specloop.server.responses`):
request fields with their JSON types (ranges and cross-field rules are the parsers' to check, and
their refusals are the documented 4xx), and every response's shape, the error object included. The
test suite fuzzes every route from this document (Schemathesis), so it has to stay exact.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_NULLABLE_STR = {"type": ["string", "null"]}
_INTS = {"type": "array", "items": _INT}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _range(kind: dict[str, Any], **bounds: float) -> dict[str, Any]:
    return _nullable({**kind, **bounds})


_INT64 = {"minimum": -(1 << 63), "maximum": (1 << 63) - 1}

# The ranges SamplingParams accepts (cross-field rules, such as min_tokens <= max_tokens or the
# context length, are checked by the parsers and refused with 400).
_SAMPLING = {
    "n": _range(_INT, minimum=1), "temperature": _range(_NUM, minimum=0), "top_p": _range(_NUM, exclusiveMinimum=0, maximum=1),
    "top_k": _range(_INT, minimum=-1, maximum=(1 << 63) - 1), "min_p": _range(_NUM, minimum=0, maximum=1),
    "seed": _range(_INT, **_INT64),
    "presence_penalty": _range(_NUM, minimum=-2, maximum=2), "frequency_penalty": _range(_NUM, minimum=-2, maximum=2),
    "repetition_penalty": _range(_NUM, exclusiveMinimum=0, maximum=2),
    "stop": _nullable({"anyOf": [{"type": "string", "minLength": 1},
                                 {"type": "array", "items": {"type": "string", "minLength": 1}}]}),
    "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0}}),
    "ignore_eos": _nullable(_BOOL), "min_tokens": _range(_INT, minimum=0, maximum=(1 << 63) - 1),
    "logit_bias": _nullable({"type": "object", "additionalProperties": {"type": "number", "minimum": -100,
                                                                        "maximum": 100}}),
    "include_stop_str_in_output": _nullable(_BOOL), "skip_special_tokens": _nullable(_BOOL),
    "spaces_between_special_tokens": _nullable(_BOOL), "priority": _range(_INT, **_INT64), "user": _NULLABLE_STR,
    "max_tokens": _range(_INT, minimum=1, maximum=(1 << 63) - 1), "stream": _nullable(_BOOL),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": _nullable(_BOOL)}}),
}

_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant"]},
        "content": _nullable({"anyOf": [_STR, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": _STR}}}]}),
    },
}

_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT}}
_FINISH = {"enum": ["stop", "length", "abort", None]}
_STOP_REASON = {"type": ["integer", "string", "null"]}
_TOP = {"type": "array", "items": {"type": "object", "required": ["token", "logprob", "bytes"],
                                   "properties": {"token": _STR, "logprob": _nullable(_NUM),
                                                  "bytes": _nullable(_INTS)}}}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object", "required": ["error"], "additionalProperties": False,
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
            "properties": {"message": _STR, "type": _STR, "param": _NULLABLE_STR, "code": _NULLABLE_STR}}},
    },
    "CompletionRequest": {
        "type": "object", "required": ["prompt"],
        "properties": {
            **_SAMPLING, "model": _NULLABLE_STR,
            "prompt": {"anyOf": [_STR, {"type": "array", "items": _STR}, _INTS, {"type": "array", "items": _INTS}]},
            "logprobs": _range(_INT, minimum=0, maximum=20), "echo": _nullable(_BOOL), "best_of": _nullable(_INT),
            "suffix": {"type": "null", "description": "not supported"},
        },
    },
    "ChatCompletionRequest": {
        "type": "object", "required": ["messages"],
        "properties": {
            **_SAMPLING, "model": _NULLABLE_STR,
            "messages": {"type": "array", "items": _MESSAGE},
            "max_completion_tokens": _range(_INT, minimum=1, maximum=(1 << 63) - 1), "logprobs": _nullable(_BOOL),
            "top_logprobs": _range(_INT, minimum=0, maximum=20),
            "add_generation_prompt": _nullable(_BOOL), "chat_template_kwargs": _nullable({"type": "object"}),
        },
    },
    "Completion": {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR, "usage": _USAGE,
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "text", "logprobs", "finish_reason", "stop_reason"],
                "properties": {
                    "index": _INT, "text": _STR, "finish_reason": _FINISH, "stop_reason": _STOP_REASON,
                    "logprobs": _nullable({
                        "type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
                        "properties": {
                            "tokens": {"type": "array", "items": _STR},
                            "token_logprobs": {"type": "array", "items": _nullable(_NUM)},
                            "top_logprobs": {"type": "array", "items": _nullable(
                                {"type": "object", "additionalProperties": _NUM})},
                            "text_offset": _INTS}}),
                }}},
        },
    },
    "ChatCompletion": {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR, "usage": _USAGE,
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "message", "logprobs", "finish_reason", "stop_reason"],
                "properties": {
                    "index": _INT, "finish_reason": _FINISH, "stop_reason": _STOP_REASON,
                    "message": {"type": "object", "required": ["role", "content"],
                                "properties": {"role": {"const": "assistant"}, "content": _STR}},
                    "logprobs": _nullable({"type": "object", "required": ["content"], "properties": {
                        "content": {"type": "array", "items": {
                            "type": "object", "required": ["token", "logprob", "bytes", "top_logprobs"],
                            "properties": {"token": _STR, "logprob": _nullable(_NUM), "bytes": _nullable(_INTS),
                                           "top_logprobs": _TOP}}}}}),
                }}},
        },
    },
    "Model": {
        "type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len"],
        "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR,
                       "root": _NULLABLE_STR, "parent": _NULLABLE_STR, "max_model_len": _INT},
    },
    "ModelList": {
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"},
                       "data": {"type": "array", "items": {"$ref": "#/components/schemas/Model"}}},
    },
    "TokenizeRequest": {
        "type": "object",
        "properties": {"model": _NULLABLE_STR, "prompt": _NULLABLE_STR, "add_special_tokens": _nullable(_BOOL),
                       "messages": _nullable({"type": "array", "items": _MESSAGE}),
                       "add_generation_prompt": _nullable(_BOOL)},
    },
    "TokenizeResponse": {"type": "object", "required": ["count", "max_model_len", "tokens"],
                         "properties": {"count": _INT, "max_model_len": _INT, "tokens": _INTS}},
    "DetokenizeRequest": {"type": "object", "required": ["tokens"],
                          "properties": {"model": _NULLABLE_STR, "tokens": _INTS}},
    "DetokenizeResponse": {"type": "object", "required": ["prompt"], "properties": {"prompt": _STR}},
    "Version": {"type": "object", "required": ["version"], "properties": {"version": _STR}},
}

_ERROR_CONTENT = {"application/json": {"schema": _ref("Error")}}


def _errors(*statuses: int) -> dict[str, Any]:
    reasons = {400: "invalid request", 401: "missing or wrong API key", 404: "unknown model",
               408: "the body did not arrive in time", 413: "the body is too large",
               500: "the engine failed", 503: "the engine is not running, or the server is shutting down"}
    return {str(s): {"description": reasons[s], "content": _ERROR_CONTENT} for s in statuses}


def _generation(summary: str, request: str, response: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the result, or with `stream: true` a stream of `data: {chunk}` events "
                                   "ending with `data: [DONE]`",
                    "content": {"application/json": {"schema": _ref(response)},
                                "text/event-stream": {"schema": _STR}}},
            **_errors(400, 401, 404, 408, 413, 500, 503)}}}


def _post(summary: str, request: str, response: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": {"description": "the result", "content": {"application/json": {"schema": _ref(response)}}},
                      **_errors(400, 401, 404, 408, 413)}}}


def _get(summary: str, response: dict[str, Any], *errors: int) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": response, **_errors(*errors)}}}


def openapi(*, api_key: bool, models: list[str] | None = None) -> dict[str, Any]:
    """The document; with ``api_key`` the routes that need one say so; ``models``: the served names
    (``model`` must be one of them)."""
    schemas = SCHEMAS
    if models:
        model = _nullable({"enum": list(models)})
        schemas = {name: {**schema, "properties": {**schema["properties"], "model": model}}
                   if "model" in schema.get("properties", {}) else schema for name, schema in SCHEMAS.items()}
    paths = {
        "/v1/completions": _generation("Text completions", "CompletionRequest", "Completion"),
        "/v1/chat/completions": _generation("Chat completions through the chat template", "ChatCompletionRequest",
                                            "ChatCompletion"),
        "/v1/models": _get("The served model names", {"description": "the models",
                                                      "content": {"application/json": {"schema": _ref("ModelList")}}},
                           401),
        "/v1/models/{model}": {"get": {
            "summary": "One served model", "parameters": [{"name": "model", "in": "path", "required": True,
                                                          "schema": _STR}],
            "responses": {"200": {"description": "the model",
                                  "content": {"application/json": {"schema": _ref("Model")}}},
                          **_errors(401, 404)}}},
        "/tokenize": _post("Token ids of a prompt or a conversation", "TokenizeRequest", "TokenizeResponse"),
        "/detokenize": _post("The text of token ids", "DetokenizeRequest", "DetokenizeResponse"),
        "/health": _get("200 while the engine runs", {"description": "healthy (empty body)"}, 503),
        "/metrics": _get("Prometheus metrics", {"description": "text exposition format",
                                                "content": {"text/plain": {"schema": _STR}}}),
        "/version": _get("The server's version", {"description": "the version",
                                                  "content": {"application/json": {"schema": _ref("Version")}}}),
        "/openapi.json": _get("This document", {"description": "OpenAPI 3.1",
                                                "content": {"application/json": {"schema": {"type": "object"}}}}),
    }
    if api_key:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}", "/tokenize",
                     "/detokenize"):
            for operation in paths[path].values():
                operation["security"] = [{"bearer": []}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "specloop", "version": importlib.metadata.version("specloop"),
                 "description": "An OpenAI-compatible inference server"},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }

"""The built-in HTTP endpoints and their route factories: ``factory(state)`` returns a Starlette
route bound to the app's :class:`~specloop.server.state.ServerState`. :mod:`specloop.server.plugin`
registers them through ``specloop_register_routes``, as a third-party plugin registers its own.
"""

from __future__ import annotations

import importlib.metadata
import time
from functools import partial
from typing import Any, Awaitable, Callable

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from . import chat, json_body, openapi, protocol, responses
from .chat_serving import ChatContext, collect_chat, stream_chat
from .errors import BadRequest, NotFound, PayloadTooLarge
from .metrics import CONTENT_TYPE
from .request_options import check_grammar, generation_defaults, token_id_text
from .serving import (ClientDisconnected, CompletionContext, EventStream, Generation, PromptInput,
                      collect_completion, engine_unavailable, stream_completion, unless_disconnected)
from .state import ServerState

Handler = Callable[[ServerState, Request], Awaitable[Response]]


def json_response(data: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status_code, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (before reading it all when the
    client announces its length)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"The request body has {length} bytes, more than this server's limit of {limit}.")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"The request body is larger than this server's limit of {limit} bytes.")
            chunks.append(chunk)
    except ClientDisconnect:
        # Gone mid-upload (or cut off by the server: a body deadline, shutdown): nobody to answer.
        raise ClientDisconnected() from None
    return b"".join(chunks)


def _json_body(state: ServerState, body: bytes) -> dict[str, Any]:
    return json_body.parse_json_object(body, state.limits.max_json_objects)


def _ready(state: ServerState) -> None:
    error = engine_unavailable(state)
    if error is not None:
        raise error


async def _collected(request: Request, gen: Generation, work: Awaitable[dict[str, Any]]) -> Response:
    try:
        return json_response(await unless_disconnected(request, work))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        await gen.cancel()


# Each request is parsed, checked and tokenized by a ``_prepare_*`` function on a worker thread
# (``state.off_loop``): that work grows with the request, and the event loop serves everyone.

def _prepare_completion(state: ServerState, body: bytes
                        ) -> tuple[protocol.CompletionRequest, str, list[PromptInput], bool]:
    raw = _json_body(state, body)
    req = protocol.parse_completion_request(raw)
    generation_defaults(state, raw, req)
    model = state.resolve_model(req.model)
    state.check_n(req.sampling["n"])
    state.check_stop(req.sampling["stop"])
    if len(req.prompts) > state.limits.max_prompts:
        raise BadRequest(f"'prompt' may hold at most {state.limits.max_prompts} prompts on this server, "
                         f"got {len(req.prompts)}.", param="prompt")
    _ready(state)
    common = req.common
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    if common.prompt_logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, common.prompt_logprobs)
    prompt_only = req.echo and req.max_tokens == 0
    inputs = []
    for prompt in req.prompts:
        if isinstance(prompt, str) and common.add_special_tokens is False:
            ids, text = state.require_tokenizer("A text prompt").encode(prompt, add_special_tokens=False), prompt
        else:
            ids, text = state.encode_prompt(prompt, echo=req.echo)
        if req.sampling["truncate_prompt_tokens"] is not None:
            ids = ids[-req.sampling["truncate_prompt_tokens"]:]
        params = state.sampling_params(req.sampling, 1 if prompt_only else req.max_tokens, ids,
                                       prompt_param="prompt", logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)
        inputs.append(PromptInput(ids, text, params))
    return req, model, inputs, prompt_only


async def create_completion(state: ServerState, request: Request) -> Response:
    arrival = time.perf_counter()
    body = await read_body(request, state.limits.max_body_bytes)
    req, model, inputs, prompt_only = await state.off_loop(_prepare_completion, state, body)
    common = req.common
    await check_grammar(state, inputs[0].params, common.constraint_param)
    request_id = state.request_id(common.request_id, "cmpl")
    ctx = CompletionContext(request_id, responses.now(), model, req.echo, req.logprobs, req.include_usage,
                            prompt_only=prompt_only, token_text=token_id_text if common.return_tokens_as_token_ids
                            else None, prompt_logprobs=common.prompt_logprobs is not None)
    gen = Generation(state, request_id, inputs, arrival=arrival, priority=req.priority, cache_salt=common.cache_salt)
    if req.stream:
        return EventStream(stream_completion(state, gen, ctx), gen.cancel)
    return await _collected(request, gen, collect_completion(state, gen, ctx))


def _render_chat(state: ServerState, messages: list[dict[str, str]], add_generation_prompt: bool,
                 kwargs: dict[str, Any], max_tokens: int | None = None) -> list[int]:
    """The conversation's token ids; ``max_tokens``: what must fit (default: a prompt's limit)."""
    tokenizer = state.require_tokenizer("A chat request")
    # The template adds to the messages' text, never removes from it.
    state.check_text_fits(sum(len(m["content"]) for m in messages), "messages", max_tokens)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    except (ValueError, TypeError) as e:
        raise BadRequest(f"The messages could not be rendered with the chat template: {e}", param="messages") from None
    state.check_text_fits(len(text), "messages", max_tokens)
    # The template already spells the special tokens (BOS, role markers).
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise BadRequest("The rendered conversation is empty.", param="messages")
    return ids


def _prepare_chat(state: ServerState, body: bytes) -> tuple[protocol.ChatRequest, str, PromptInput]:
    raw = _json_body(state, body)
    req = protocol.parse_chat_request(raw, state.limits.max_messages)
    generation_defaults(state, raw, req)
    model = state.resolve_model(req.model)
    state.check_n(req.sampling["n"])
    state.check_stop(req.sampling["stop"])
    _ready(state)
    common = req.common
    # The template adds to the messages' text, never removes from it: too much text is refused unrendered.
    state.check_text_fits(sum(len(m.get("content") or "") for m in req.messages
                              if isinstance(m.get("content") or "", str)), "messages")
    chat.constrain_tool_calls(req)
    ids, _ = chat.render(state, req)
    if req.sampling["truncate_prompt_tokens"] is not None:
        ids = ids[-req.sampling["truncate_prompt_tokens"]:]
    params = state.sampling_params(req.sampling, req.max_tokens, ids, prompt_param="messages",
                                   logprobs=req.logprobs, prompt_logprobs=common.prompt_logprobs)
    return req, model, PromptInput(ids, None, params)


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    arrival = time.perf_counter()
    body = await read_body(request, state.limits.max_body_bytes)
    req, model, prompt = await state.off_loop(_prepare_chat, state, body)
    common = req.common
    await check_grammar(state, prompt.params, common.constraint_param)
    request_id = state.request_id(common.request_id, "chatcmpl")
    parser = state.tool_parser() if req.tools.choice == "auto" else None
    extras = chat.ChatExtras(chat.ToolOutput(req.tools.choice, req.tools.named, parser), chat.echo_prefix(req),
                             common.prompt_logprobs is not None)
    ctx = ChatContext(request_id, responses.now(), model, req.logprobs, req.include_usage, extras,
                      token_id_text if common.return_tokens_as_token_ids else None)
    gen = Generation(state, request_id, [prompt], arrival=arrival, priority=req.priority, cache_salt=common.cache_salt)
    if req.stream:
        return EventStream(stream_chat(state, gen, ctx), gen.cancel)
    return await _collected(request, gen, collect_chat(state, gen, ctx))


async def list_models(state: ServerState, request: Request) -> Response:
    root = getattr(state.engine.config, "model", None)
    data = [{"id": name, "object": "model", "created": state.created, "owned_by": "specloop", "root": root,
             "parent": None, "max_model_len": state.max_model_len} for name in state.served_model_names]
    return json_response({"object": "list", "data": data})


async def retrieve_model(state: ServerState, request: Request) -> Response:
    name = request.path_params["model"]
    if name not in state.served_model_names:
        raise NotFound(f"The model `{name}` does not exist.", param="model", code="model_not_found")
    return json_response({"id": name, "object": "model", "created": state.created, "owned_by": "specloop",
                          "root": getattr(state.engine.config, "model", None), "parent": None,
                          "max_model_len": state.max_model_len})


async def health(state: ServerState, request: Request) -> Response:
    error = engine_unavailable(state)
    return error.to_response() if error is not None else Response(status_code=200)


async def metrics(state: ServerState, request: Request) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def version(state: ServerState, request: Request) -> Response:
    return json_response({"version": importlib.metadata.version("specloop")})


def _tokenize(state: ServerState, body: bytes) -> dict[str, Any]:
    data = _json_body(state, body)
    f = protocol.Fields(data)
    state.resolve_model(f.str("model"))
    # As vLLM: up to the whole context, since nothing is generated.
    limit = state.max_model_len
    if data.get("messages") is not None:
        messages = protocol.parse_messages(data["messages"], state.limits.max_messages)
        ids = _render_chat(state, messages, f.bool("add_generation_prompt", True), {}, limit)
        param = "messages"
    else:
        prompt = f.str("prompt")
        if prompt is None:
            raise BadRequest("'prompt' (a string) or 'messages' is required.", param="prompt")
        tokenizer = state.require_tokenizer("Tokenizing")
        state.check_text_fits(len(prompt), "prompt", limit)
        ids = tokenizer.encode(prompt, add_special_tokens=f.bool("add_special_tokens", True))
        param = "prompt"
    if len(ids) > limit:
        raise BadRequest(f"This model's maximum context length is {limit} tokens. However, the input has "
                         f"{len(ids)} tokens. Please reduce the length of the input.", param=param,
                         code="context_length_exceeded")
    return {"count": len(ids), "max_model_len": limit, "tokens": ids}


async def tokenize(state: ServerState, request: Request) -> Response:
    """``{"prompt": str}`` or ``{"messages": [...]}`` -> ``{"count", "max_model_len", "tokens"}``."""
    body = await read_body(request, state.limits.max_body_bytes)
    return json_response(await state.off_loop(_tokenize, state, body))


def _detokenize(state: ServerState, body: bytes) -> dict[str, Any]:
    data = _json_body(state, body)
    f = protocol.Fields(data)
    state.resolve_model(f.str("model"))
    if data.get("tokens") is None:
        raise BadRequest("'tokens' (a list of token ids) is required.", param="tokens")
    ids = f.int_list("tokens")
    if len(ids) > state.max_model_len:
        raise BadRequest(f"This model's maximum context length is {state.max_model_len} tokens. However, "
                         f"'tokens' has {len(ids)}.", param="tokens", code="context_length_exceeded")
    state.check_token_ids(ids, "tokens")
    return {"prompt": state.require_tokenizer("Detokenizing").decode(ids)}


async def detokenize(state: ServerState, request: Request) -> Response:
    """``{"tokens": [int]}`` -> ``{"prompt": str}``."""
    body = await read_body(request, state.limits.max_body_bytes)
    return json_response(await state.off_loop(_detokenize, state, body))


async def openapi_description(state: ServerState, request: Request) -> Response:
    return json_response(openapi.openapi(api_key=state.requires_api_key, models=state.served_model_names))


def _route(path: str, handler: Handler, methods: list[str]) -> Callable[[ServerState], Route]:
    def factory(state: ServerState) -> Route:
        return Route(path, partial(handler, state), methods=methods)
    return factory


# The factories :mod:`specloop.server.plugin` registers, one per endpoint.
completions_route = _route("/v1/completions", create_completion, ["POST"])
chat_completions_route = _route("/v1/chat/completions", create_chat_completion, ["POST"])
models_route = _route("/v1/models", list_models, ["GET"])
model_route = _route("/v1/models/{model:path}", retrieve_model, ["GET"])
health_route = _route("/health", health, ["GET"])
metrics_route = _route("/metrics", metrics, ["GET"])
version_route = _route("/version", version, ["GET"])
tokenize_route = _route("/tokenize", tokenize, ["POST"])
detokenize_route = _route("/detokenize", detokenize, ["POST"])
openapi_route = _route("/openapi.json", openapi_description, ["GET"])

"""The OpenAI wire format, request side: request bodies parsed and checked into typed requests (the
response side is :mod:`specloop.server.responses`).

Parsing is strict about types (an integer field refuses ``true``, ``"3"`` and ``3.0``, and takes
64-bit signed integers) and lenient about unknown fields (ignored, as OpenAI-compatible servers do).
Every problem raises :class:`BadRequest` naming the field in ``param``.

Parsing costs time in proportion to the body, with the GIL held whatever thread parses it, so the
body's size is bounded before it is parsed (:func:`specloop.server.json_body.parse_json_object`);
the server parses on a worker thread (:mod:`specloop.server.routes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from specloop.kernel.sampling_params import SamplingParams

from . import request_fields
from .errors import BadRequest, from_value_error
from .request_fields import ToolRequest

_MISSING = object()
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

class Fields:
    """Typed reads of one JSON object; ``None`` (JSON null) reads as the default."""

    def __init__(self, body: dict[str, Any], prefix: str = "") -> None:
        self.body = body
        self.prefix = prefix

    def _raw(self, name: str) -> Any:
        value = self.body.get(name)
        return _MISSING if value is None else value

    def _bad(self, name: str, want: str, value: Any) -> BadRequest:
        return BadRequest(f"'{self.prefix}{name}' must be {want}, got {_show(value)}.", param=self.prefix + name)

    def int(self, name: str, default: int | None = None) -> int | None:
        v = self._raw(name)
        if v is _MISSING:
            return default
        if not _is_int(v):
            raise self._bad(name, "an integer", v)
        if not INT64_MIN <= v <= INT64_MAX:
            raise self._bad(name, "an integer in [-2**63, 2**63 - 1]", v)
        return v

    def float(self, name: str, default: float | None = None) -> float | None:
        v = self._raw(name)
        if v is _MISSING:
            return default
        if not (isinstance(v, (int, float)) and not isinstance(v, bool)):
            raise self._bad(name, "a number", v)
        return float(v)

    def bool(self, name: str, default: bool = False) -> bool:
        v = self._raw(name)
        if v is _MISSING:
            return default
        if not isinstance(v, bool):
            raise self._bad(name, "a boolean", v)
        return v

    def str(self, name: str, default: str | None = None) -> str | None:
        v = self._raw(name)
        if v is _MISSING:
            return default
        if not isinstance(v, str):
            raise self._bad(name, "a string", v)
        return v

    def str_list(self, name: str) -> list[str]:
        """A string or a list of strings (``stop``)."""
        v = self._raw(name)
        if v is _MISSING:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise self._bad(name, "a string or a list of strings", v)
        return v

    def int_list(self, name: str) -> list[int]:
        v = self._raw(name)
        if v is _MISSING:
            return []
        if not isinstance(v, list) or not all(_is_int(t) for t in v):
            raise self._bad(name, "a list of integers", v)
        return v

    def object(self, name: str) -> dict[str, Any] | None:
        v = self._raw(name)
        if v is _MISSING:
            return None
        if not isinstance(v, dict):
            raise self._bad(name, "an object", v)
        return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(value: Any) -> str:
    text = repr(value) if not _is_int(value) or abs(value) < 10**50 else f"an integer of {len(str(abs(value)))} digits"
    return text if len(text) <= 60 else text[:57] + "..."


def _logit_bias(f: Fields) -> dict[int, float] | None:
    raw = f.object("logit_bias")
    if raw is None:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise BadRequest(f"'logit_bias' keys must be token ids, got {_show(key)}.", param="logit_bias") from None
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
            raise BadRequest(f"'logit_bias' values must be numbers, got {_show(value)}.", param="logit_bias")
        bias[token_id] = float(value)
    return bias


def _sampling_kwargs(f: Fields) -> dict[str, Any]:
    """The fields both endpoints share, as :class:`SamplingParams` keyword arguments."""
    return {
        "n": f.int("n", 1),
        "temperature": f.float("temperature", 1.0),
        "top_p": f.float("top_p", 1.0),
        "top_k": f.int("top_k", 0),
        "min_p": f.float("min_p", 0.0),
        "seed": f.int("seed"),
        "presence_penalty": f.float("presence_penalty", 0.0),
        "frequency_penalty": f.float("frequency_penalty", 0.0),
        "repetition_penalty": f.float("repetition_penalty", 1.0),
        "stop": f.str_list("stop"),
        "stop_token_ids": f.int_list("stop_token_ids"),
        "ignore_eos": f.bool("ignore_eos"),
        "min_tokens": f.int("min_tokens", 0),
        "logit_bias": _logit_bias(f),
        "include_stop_str_in_output": f.bool("include_stop_str_in_output"),
        "skip_special_tokens": f.bool("skip_special_tokens", True),
        "spaces_between_special_tokens": f.bool("spaces_between_special_tokens", True),
        "bad_words": f.str_list("bad_words"),
        "allowed_token_ids": f.int_list("allowed_token_ids") or None,
        "truncate_prompt_tokens": f.int("truncate_prompt_tokens"),
    }


@dataclass(slots=True)
class CommonFields:
    """What both endpoints read beyond the sampling parameters. Set by :func:`_common`."""

    constraint_param: str | None  # the field that set sampling["structured_outputs"], if any
    prompt_logprobs: int | None
    return_tokens_as_token_ids: bool
    cache_salt: str | None
    add_special_tokens: bool | None
    request_id: str | None


def _common(f: Fields, sampling: dict[str, Any]) -> CommonFields:
    request_fields.check_refused(f.body)
    sampling["structured_outputs"], param = request_fields.structured_outputs(f.body)
    if f.body.get("detokenize") is False:
        raise BadRequest("'detokenize' false is not supported by the HTTP API.", param="detokenize")
    prompt_logprobs = f.int("prompt_logprobs")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= 20:
        raise BadRequest(f"'prompt_logprobs' must be in [0, 20], got {prompt_logprobs}.", param="prompt_logprobs")
    cache_salt = f.str("cache_salt")
    if cache_salt is not None and not cache_salt:
        raise BadRequest("'cache_salt' must not be empty.", param="cache_salt")
    add_special = f.body.get("add_special_tokens")
    return CommonFields(param, prompt_logprobs, f.bool("return_tokens_as_token_ids"), cache_salt,
                        f.bool("add_special_tokens") if add_special is not None else None, f.str("request_id"))


def _stream_flags(f: Fields) -> tuple[bool, bool]:
    stream = f.bool("stream")
    options = f.object("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    return stream, bool(Fields(options, "stream_options.").bool("include_usage"))


def _check_sampling(kwargs: dict[str, Any], max_tokens: int | None) -> None:
    """Run SamplingParams' own validation now, before any tokenization."""
    try:
        SamplingParams(**kwargs, max_tokens=max_tokens)
    except ValueError as e:
        raise from_value_error(e) from None


# --- requests --------------------------------------------------------------------------------

Prompt = str | list[int]


@dataclass(slots=True)
class CompletionRequest:
    """``POST /v1/completions``. Set by :func:`parse_completion_request`."""

    model: str | None
    prompts: list[Prompt]  # each a text or token ids
    sampling: dict[str, Any]  # SamplingParams kwargs except max_tokens / logprobs
    max_tokens: int | None  # None: what fits in the context
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None
    user: str | None
    priority: int = 0  # lower is served first, with the priority scheduler
    common: CommonFields | None = None


@dataclass(slots=True)
class ChatRequest:
    """``POST /v1/chat/completions``. Set by :func:`parse_chat_request`."""

    model: str | None
    messages: list[dict[str, str]]  # role + content (text parts joined)
    sampling: dict[str, Any]
    max_tokens: int | None
    stream: bool
    include_usage: bool
    logprobs: int | None  # top_logprobs when logprobs is true, else None
    add_generation_prompt: bool
    user: str | None
    priority: int = 0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    common: CommonFields | None = None
    tools: ToolRequest = field(default_factory=ToolRequest)
    echo: bool = False
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None


def _prompts(value: Any) -> list[Prompt]:
    """A string, a list of strings, token ids, or a list of token-id lists."""
    if value is None:
        raise BadRequest("'prompt' is required.", param="prompt")
    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        prompts = [value]
    elif isinstance(value, list) and all(isinstance(p, str) or (isinstance(p, list) and all(_is_int(t) for t in p))
                                         for p in value):
        prompts = value
    else:
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                         f"token-id lists, got {_show(value)}.", param="prompt")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise BadRequest("'prompt' must not be empty.", param="prompt")
    return prompts


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    f = Fields(body)
    stream, include_usage = _stream_flags(f)
    if f.str("suffix") is not None:
        raise BadRequest("'suffix' is not supported.", param="suffix")
    sampling = _sampling_kwargs(f)
    best_of = f.int("best_of")
    if best_of is not None and best_of != sampling["n"]:
        raise BadRequest("'best_of' is not supported (other than equal to 'n').", param="best_of")
    max_tokens = f.int("max_tokens")
    logprobs = f.int("logprobs")
    echo = f.bool("echo")
    common = _common(f, sampling)
    # max_tokens 0 with echo scores the prompt only (OpenAI's legacy API and vLLM accept it).
    _check_sampling({**sampling, "logprobs": logprobs}, 1 if echo and max_tokens == 0 else max_tokens)
    return CompletionRequest(model=f.str("model"), prompts=_prompts(body.get("prompt")), sampling=sampling,
                             max_tokens=max_tokens, stream=stream, include_usage=include_usage, echo=echo,
                             logprobs=logprobs, user=f.str("user"), priority=f.int("priority", 0), common=common)


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"'{where}' must be an object, got {_show(m)}.", param="messages")
    role = m.get("role")
    if role not in _ROLES:
        raise BadRequest(f"'{where}.role' must be one of {', '.join(_ROLES)}, got {_show(role)}.",
                         param="messages")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise BadRequest(f"'{where}.content' parts must be {{\"type\": \"text\", \"text\": ...}}; "
                                 f"got {_show(part)}.", param="messages")
            parts.append(part["text"])
        content = "\n".join(parts)
    if not isinstance(content, str):
        raise BadRequest(f"'{where}.content' must be a string or a list of text parts, got {_show(content)}.",
                         param="messages")
    message: dict[str, Any] = {"role": role, "content": content}
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise BadRequest(f"'{where}.tool_call_id' (a string) is required for a tool message.", param="messages")
        message["tool_call_id"] = m["tool_call_id"]
    if role == "assistant" and m.get("tool_calls"):
        message["tool_calls"] = [_tool_call(where, c) for c in m["tool_calls"]]
    if isinstance(m.get("name"), str):
        message["name"] = m["name"]
    return message


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    """An assistant message's tool call, its arguments parsed (chat templates expect an object)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), (str, dict))):
        raise BadRequest(f"'{where}.tool_calls' entries must be {{\"id\", \"type\": \"function\", \"function\": "
                         f"{{\"name\", \"arguments\"}}}}, got {_show(call)}.", param="messages")
    arguments = fn["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments) if arguments.strip() else {}
        except orjson.JSONDecodeError:
            raise BadRequest(f"'{where}.tool_calls' arguments are not valid JSON: {_show(arguments)}.",
                             param="messages") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


# Arguments of ``apply_chat_template`` itself: a client must not swap the server's template (it runs
# on the server) or pass what the request's own fields already say.
_RESERVED_TEMPLATE_KWARGS = ("chat_template", "tools", "documents", "messages", "add_generation_prompt",
                             "continue_final_message")


def _chat_template_kwargs(f: Fields) -> dict[str, Any]:
    kwargs = f.object("chat_template_kwargs") or {}
    reserved = sorted(k for k in kwargs if k in _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise BadRequest(f"'chat_template_kwargs' may not set {', '.join(reserved)}.", param="chat_template_kwargs")
    return kwargs


def parse_messages(value: Any, max_messages: int | None = None) -> list[dict[str, str]]:
    """``messages``: a non-empty list of at most ``max_messages`` messages (counted before any is read)."""
    if not isinstance(value, list) or not value:
        raise BadRequest("'messages' must be a non-empty list of messages.", param="messages")
    if max_messages is not None and len(value) > max_messages:
        raise BadRequest(f"'messages' may hold at most {max_messages} messages on this server, got {len(value)}.",
                         param="messages")
    return [_message(i, m) for i, m in enumerate(value)]


def parse_chat_request(body: dict[str, Any], max_messages: int | None = None) -> ChatRequest:
    f = Fields(body)
    stream, include_usage = _stream_flags(f)
    messages = parse_messages(body.get("messages"), max_messages)
    sampling = _sampling_kwargs(f)
    max_tokens = f.int("max_completion_tokens")
    if max_tokens is None:
        max_tokens = f.int("max_tokens")
    want_logprobs = f.bool("logprobs")
    top_logprobs = f.int("top_logprobs")
    if top_logprobs is not None and not want_logprobs:
        raise BadRequest("'top_logprobs' needs 'logprobs' to be true.", param="top_logprobs")
    if top_logprobs is not None and not 0 <= top_logprobs <= 20:
        raise BadRequest(f"'top_logprobs' must be in [0, 20], got {top_logprobs}.", param="top_logprobs")
    logprobs = (top_logprobs or 0) if want_logprobs else None
    common = _common(f, sampling)
    tools = request_fields.parse_tools(body)
    _check_sampling({**sampling, "logprobs": logprobs}, max_tokens)
    continue_final = f.bool("continue_final_message")
    add_generation_prompt = f.bool("add_generation_prompt", not continue_final)
    if continue_final and add_generation_prompt:
        raise BadRequest("'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                         param="continue_final_message")
    documents = body.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
        raise BadRequest("'documents' must be a list of objects.", param="documents")
    return ChatRequest(model=f.str("model"), messages=messages,
                       sampling=sampling, max_tokens=max_tokens, stream=stream, include_usage=include_usage,
                       logprobs=logprobs, add_generation_prompt=add_generation_prompt,
                       user=f.str("user"), priority=f.int("priority", 0),
                       chat_template_kwargs=_chat_template_kwargs(f), common=common, tools=tools,
                       echo=f.bool("echo"), continue_final_message=continue_final, documents=documents)

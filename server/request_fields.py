"""Every field of the completion and chat requests that OpenAI or vLLM define, and what becomes of
it: each takes effect or is refused with a 400 naming it (none is silently ignored). Also the
fields that need more than a type check: the output constraint (``response_format``,
``structured_outputs``, vLLM's older ``guided_*``) and tools.

Fields outside both APIs are still ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from specloop.sampling.structured_outputs import StructuredOutputsParams

from .errors import BadRequest

# Fields both endpoints honour (parsed in protocol.py or below).
SHARED = {
    "model", "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "logprobs",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "stream",
    "stream_options", "max_tokens", "priority", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern", "bad_words",
    "allowed_token_ids", "truncate_prompt_tokens", "prompt_logprobs", "echo", "return_tokens_as_token_ids",
    "cache_salt", "add_special_tokens", "request_id", "user", "guided_decoding_backend",
    "disable_any_whitespace",
}
# OpenAI: for abuse monitoring and the platform's own bookkeeping; nothing to generate differently.
ACCEPTED_WITHOUT_EFFECT = {"user", "metadata", "store", "service_tier"}
COMPLETION_FIELDS = SHARED | {"prompt", "best_of", "suffix"}
CHAT_FIELDS = SHARED | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "functions", "function_call", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
    "documents", "metadata", "store", "service_tier",
}
# Defined by OpenAI or vLLM, refused here: field -> why. A value equal to the field's neutral
# one ("text" modalities, no beam search) is accepted.
REFUSED: dict[str, tuple[Any, str]] = {
    "audio": (None, "audio output is not supported"),
    "modalities": (["text"], "only the text modality is supported"),
    "prediction": (None, "predicted outputs are not supported"),
    "web_search_options": (None, "web search is not supported"),
    "reasoning_effort": (None, "this server runs no reasoning model"),
    "verbosity": (None, "verbosity is not supported"),
    "use_beam_search": (False, "beam search is not supported"),
    "length_penalty": (1.0, "length_penalty applies to beam search, which is not supported"),
    "chat_template": (None, "a client-supplied chat template is not accepted; the server's is used"),
    "mm_processor_kwargs": (None, "multimodal inputs are not supported"),
    "logits_processors": (None, "custom logits processors are not supported"),
    "prompt_embeds": (None, "prompt embeddings are not supported"),
    "kv_transfer_params": (None, "KV transfer is not supported"),
    "vllm_xargs": (None, "vllm_xargs is not supported"),
    "return_token_ids": (None, "return_token_ids is not supported"),
}


def check_refused(body: dict[str, Any]) -> None:
    for name, (neutral, why) in REFUSED.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise BadRequest(f"'{name}' is not supported: {why}.", param=name)


# --- the output constraint --------------------------------------------------------------------

def structured_outputs(body: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field that set it; at most one field may."""
    found: list[tuple[str, StructuredOutputsParams | None]] = []
    compact = bool(body.get("disable_any_whitespace"))
    rf = body.get("response_format")
    if rf is not None:
        found.append(("response_format", _response_format(rf, compact)))
    if body.get("structured_outputs") is not None:
        so = body["structured_outputs"]
        try:
            found.append(("structured_outputs", StructuredOutputsParams.from_any(so)))
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e), param="structured_outputs") from None
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if body.get(name) is not None:
            value = body[name]
            if kind == "json" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise BadRequest(f"'{name}' is not valid JSON: {e}", param=name) from None
            try:
                found.append((name, StructuredOutputsParams(**{kind: value}, disable_any_whitespace=compact)))
            except ValueError as e:
                raise BadRequest(str(e).replace("structured_outputs", name), param=name) from None
    if body.get("guided_whitespace_pattern") is not None:
        raise BadRequest("'guided_whitespace_pattern' is not supported; use disable_any_whitespace.",
                         param="guided_whitespace_pattern")
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in ("auto", "llguidance", "guidance"):
        raise BadRequest(f"'guided_decoding_backend' {backend!r} is not available; this server uses llguidance.",
                         param="guided_decoding_backend")
    found = [(name, so) for name, so in found if so is not None]
    if len(found) > 1:
        raise BadRequest(f"Only one output constraint may be given, got {', '.join(n for n, _ in found)}.",
                         param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


def _response_format(rf: Any, compact: bool) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("'response_format.type' must be one of text, json_object, json_schema.",
                         param="response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=compact)
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise BadRequest("'response_format.json_schema' must be an object with a 'schema' object.",
                         param="response_format")
    # OpenAI allows json_schema without a schema: any JSON object then.
    return StructuredOutputsParams(json=spec.get("schema") or {"type": "object"}, disable_any_whitespace=compact)


# --- tools ------------------------------------------------------------------------------------

@dataclass(slots=True)
class ToolRequest:
    """The tools a chat request offers and what it asks of them. Set by :func:`parse_tools`."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: str = "none"  # none | auto | required | named
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def function_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def tool(self, name: str) -> dict[str, Any]:
        return next(t for t in self.tools if t["function"]["name"] == name)


def parse_tools(body: dict[str, Any]) -> ToolRequest:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if body.get("functions") is not None:  # the deprecated spelling of tools
        if tools is not None:
            raise BadRequest("Give 'tools' or the deprecated 'functions', not both.", param="functions")
        functions = body["functions"]
        if not isinstance(functions, list):
            raise BadRequest("'functions' must be a list.", param="functions")
        tools = [{"type": "function", "function": f} for f in functions]
        fc = body.get("function_call")
        choice = {"type": "function", "function": fc} if isinstance(fc, dict) else fc
    if tools is None:
        if choice not in (None, "none"):
            raise BadRequest("'tool_choice' needs 'tools'.", param="tool_choice")
        return ToolRequest()
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list.", param="tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise BadRequest(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}.",
                             param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"'tools[{i}].function.parameters' must be a JSON schema object.", param="tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be a boolean.", param="parallel_tool_calls")
    req = ToolRequest(tools=tools, choice="auto" if tools else "none", parallel=parallel)
    if choice is None:
        return req
    if choice in ("none", "auto", "required"):
        req.choice = choice
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in req.function_names:
            raise BadRequest(f"'tool_choice' names function {name!r}, which is not among the tools "
                             f"({', '.join(req.function_names)}).", param="tool_choice")
        req.choice, req.named = "named", name
    else:
        raise BadRequest("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}.", param="tool_choice")
    if req.choice in ("required", "named") and not tools:
        raise BadRequest(f"tool_choice {req.choice!r} needs at least one tool.", param="tool_choice")
    return req

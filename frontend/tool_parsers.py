"""Tool calls: the parsers that find them in a model's text (``tool_choice: "auto"``) and the
grammars that force them (``"required"`` and a named function).

A parser is selected by name (``specloop serve --tool-call-parser``) from the
``specloop_register_tool_parsers`` registry; the built-in ``hermes`` parser reads
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the format of Hermes, Qwen 2.5/3
and the default model's chat template.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser(Protocol):
    """Finds tool calls in a completion's text."""

    start_token: str  # text that begins a tool call: streamed content stops at it

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the content outside tool calls or None, the calls). Text that does not parse as a
        call stays content."""


class HermesToolParser:
    start_token = "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start_token not in text:
            return text, []
        calls = []
        for body in self._CALL.findall(text):
            try:
                call = json.loads(body.strip())
            except json.JSONDecodeError:
                return text, []
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return text, []
            arguments = call.get("arguments", call.get("parameters", {}))
            calls.append(ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
        content = text[:text.index(self.start_token)].strip()
        return content or None, calls


# --- forced calls ---------------------------------------------------------------------------

def required_calls_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """What ``tool_choice: "required"`` constrains the output to: a JSON array of calls, each
    ``{"name": one of the tools, "parameters": that tool's parameters}`` (vLLM's form)."""
    options = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 "parameters": t["function"].get("parameters") or {"type": "object"}},
                "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": options[0] if len(options) == 1 else {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required_calls(text: str) -> list[ToolCall]:
    calls = json.loads(text)
    return [ToolCall(c["name"], json.dumps(c.get("parameters", {}))) for c in calls]

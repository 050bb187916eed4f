"""Chat requests beyond plain messages: rendering with tools and documents, the grammar that
``tool_choice`` ``"required"`` or a named function imposes, and turning a choice's text back into
``tool_calls`` (whole, or as OpenAI's stream deltas)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specloop.frontend.tool_parsers import ToolCall, ToolParser, parse_required_calls, required_calls_schema
from specloop.sampling.structured_outputs import StructuredOutputsParams

from .errors import BadRequest
from .protocol import ChatRequest
from .state import ServerState


def render(state: ServerState, req: ChatRequest) -> tuple[list[int], str]:
    """The prompt's token ids and text; tools reach the template unless ``tool_choice`` is none."""
    tokenizer = state.require_tokenizer("A chat request")
    tools = req.tools.tools if req.tools.choice != "none" and req.tools.tools else None
    try:
        text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message, tools=tools,
                                             documents=req.documents, **req.chat_template_kwargs)
    except (ValueError, TypeError) as e:
        raise BadRequest(f"The messages could not be rendered with the chat template: {e}", param="messages") from None
    # The template already spells the special tokens (BOS, role markers) unless the client says otherwise.
    add_special = bool(req.common.add_special_tokens) if req.common is not None else False
    ids = tokenizer.encode(text, add_special_tokens=add_special)
    if not ids:
        raise BadRequest("The rendered conversation is empty.", param="messages")
    return ids, text


def constrain_tool_calls(req: ChatRequest) -> None:
    """``"required"``: the output is a JSON array of calls to the tools; a named function: the
    output is that function's arguments. Both by a JSON-schema grammar."""
    t = req.tools
    if t.choice not in ("required", "named"):
        return
    if req.sampling.get("structured_outputs") is not None:
        raise BadRequest(f"tool_choice {t.choice if t.choice == 'required' else 'naming a function'} cannot be "
                         f"combined with '{req.common.constraint_param if req.common else 'response_format'}'.",
                         param="tool_choice")
    schema = (required_calls_schema(t.tools, t.parallel) if t.choice == "required"
              else t.tool(t.named or "")["function"].get("parameters") or {"type": "object"})
    req.sampling["structured_outputs"] = StructuredOutputsParams(json=schema)
    if req.common is not None:
        req.common.constraint_param = "tools"


@dataclass(slots=True)
class ToolOutput:
    """How a choice's text becomes ``content`` and ``tool_calls``. Set by the chat route."""

    choice: str  # none | auto | required | named
    named: str | None = None
    parser: ToolParser | None = None

    def split(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished choice. A named function's call is its text even when its
        length limit cut the arguments short (``finish_reason`` "length"), as its stream sent them;
        "required" calls cut short stay content (not a list of calls yet)."""
        if self.choice == "named":
            return None, [ToolCall(self.named or "", text)]
        if self.choice == "required" and finish_reason != "length":
            try:
                return None, parse_required_calls(text)
            except (ValueError, KeyError, TypeError):
                return text, []
        if self.choice == "auto" and self.parser is not None:
            return self.parser.parse(text)
        return text, []

    @staticmethod
    def finish_reason(calls: list[ToolCall], finish_reason: str | None) -> str | None:
        return "tool_calls" if calls and finish_reason == "stop" else finish_reason

    @property
    def streams_content(self) -> bool:
        return self.choice in ("none", "auto")


@dataclass(slots=True)
class ToolStream:
    """One choice's stream: content deltas as they come (held back from where a tool call may
    start), then the calls as OpenAI's ``tool_calls`` deltas when the choice finishes; a named
    function's arguments stream as they come."""

    output: ToolOutput
    text: str = ""
    sent: int = 0  # characters of text sent as content
    held: bool = False  # a tool call has started: nothing more is content until the end
    call_id: str | None = None  # the named function's call, once announced

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """Content to send now for ``delta``, and tool-call deltas."""
        self.text += delta
        if self.output.choice == "named":
            deltas = []
            if self.call_id is None:
                self.call_id = ToolCall(self.output.named or "", "").id
                deltas.append({"index": 0, "id": self.call_id, "type": "function",
                               "function": {"name": self.output.named, "arguments": ""}})
            if delta:
                deltas.append({"index": 0, "function": {"arguments": delta}})
            return "", deltas
        if not self.output.streams_content or self.held:
            return "", []
        start = self.output.parser.start_token if (self.output.choice == "auto" and self.output.parser) else None
        end = len(self.text)
        if start:
            at = self.text.find(start, self.sent)
            if at >= 0:
                self.held, end = True, at
            else:  # keep back a tail that may be the start of the start token
                for k in range(min(len(start) - 1, len(self.text) - self.sent), 0, -1):
                    if start.startswith(self.text[-k:]):
                        end = len(self.text) - k
                        break
        out, self.sent = self.text[self.sent:end], end
        return out, []

    def finish(self, finish_reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """(content still to send, tool-call deltas, the finish reason to report)."""
        if self.output.choice == "named":  # its arguments went out as they came
            return "", [], "tool_calls" if finish_reason == "stop" else finish_reason
        content, calls = self.output.split(self.text, finish_reason)
        if not calls:
            rest = self.text[self.sent:]
            self.sent = len(self.text)
            return rest, [], finish_reason
        deltas = []
        for i, call in enumerate(calls):
            deltas.append({"index": i, "id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": i, "function": {"arguments": call.arguments}})
        return "", deltas, ToolOutput.finish_reason(calls, finish_reason)


@dataclass(slots=True)
class ChatExtras:
    """What a chat response adds to plain text. Set by the route."""

    tools: ToolOutput = field(default_factory=lambda: ToolOutput("none"))
    echo_prefix: str = ""  # echo: the final assistant message being continued
    prompt_logprobs: bool = False


def echo_prefix(req: ChatRequest) -> str:
    """With ``echo``, a reply continues the last message when it is the assistant's (vLLM's rule)."""
    last = req.messages[-1]
    return last["content"] if req.echo and last["role"] == "assistant" and isinstance(last["content"], str) else ""


def message(text: str, finish_reason: str | None, extras: ChatExtras) -> tuple[dict[str, Any], str | None]:
    content, calls = extras.tools.split(text, finish_reason)
    msg: dict[str, Any] = {"role": "assistant", "content": (extras.echo_prefix + content) if content is not None
                           else (extras.echo_prefix or None)}
    if calls:
        msg["tool_calls"] = [c.to_dict() for c in calls]
    return msg, ToolOutput.finish_reason(calls, finish_reason)

"""Tool calls in text (the Hermes parser), their stream deltas, and the model's sampling defaults."""

from __future__ import annotations

import json

from specloop.frontend.tokenizer import read_generation_defaults
from specloop.frontend.tool_parsers import HermesToolParser, parse_required_calls, required_calls_schema
from specloop.server.chat import ToolOutput, ToolStream

TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_hermes_parser_finds_calls_and_keeps_the_content():
    content, calls = HermesToolParser().parse(TEXT)
    assert content == "Let me look." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"} and calls[0].id != calls[1].id
    assert HermesToolParser().parse("no calls here") == ("no calls here", [])
    # A call that is not JSON stays text.
    assert HermesToolParser().parse("<tool_call>{oops</tool_call>")[1] == []


def test_stream_holds_content_back_from_a_tool_call_and_sends_calls_at_the_end():
    stream = ToolStream(ToolOutput("auto", parser=HermesToolParser()))
    sent = "".join(stream.feed(TEXT[i:i + 3])[0] for i in range(0, len(TEXT), 3))
    assert sent == "Let me look.\n"
    rest, deltas, finish = stream.finish("stop")
    assert rest == "" and finish == "tool_calls"
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"]
    assert json.loads(deltas[1]["function"]["arguments"]) == {"city": "Oslo"}
    plain = ToolStream(ToolOutput("auto", parser=HermesToolParser()))
    assert plain.feed("a <tool") == ("a ", []) and plain.finish("stop") == ("<tool", [], "stop")


def test_a_named_function_streams_its_arguments():
    stream = ToolStream(ToolOutput("named", named="f"))
    first, second = stream.feed('{"a"'), stream.feed(": 1}")
    assert first[0] == "" and first[1][0]["function"] == {"name": "f", "arguments": ""}
    assert [d["function"]["arguments"] for d in first[1][1:] + second[1]] == ['{"a"', ": 1}"]
    assert stream.finish("stop") == ("", [], "tool_calls")


def test_required_calls_round_trip_through_their_schema():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    schema = required_calls_schema(tools, parallel=False)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"const": "f"}
    (call,) = parse_required_calls('[{"name": "f", "parameters": {"a": 1}}]')
    assert call.name == "f" and json.loads(call.arguments) == {"a": 1}


def test_generation_config_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64, "eos_token_id": 2, "do_sample": True}))
    assert read_generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                       "max_tokens": 64}

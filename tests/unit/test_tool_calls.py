"""Tool-call parsers and streaming: each format's text -> content and tool calls; the
streamed deltas (fed a few characters at a time) reassemble into exactly the
non-streamed message; tools / tool_choice checks and the grammar of required/named."""

from __future__ import annotations

import json

import jsonschema
import pytest

from treadle.server.tool_calls import (ToolCallStreamer, ToolRequestError, parse_choice,
                                       required_schema, setup_tools)
from treadle.server.tool_parsers import PARSERS
from treadle.server.tool_parsers.constrained import NamedToolParser, RequiredToolParser

WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string"}, "days": {"type": "integer"},
               "metric": {"type": "boolean"}}, "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]

CASES = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time",'
               ' "arguments": {"zone": "CET"}}\n</tool_call>',
               "Let me check.",
               [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                    '{"name": "get_time", "parameters": {"zone": "UTC"}}', None,
                    [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", '
                '"metric": true}}, {"name": "get_time", "arguments": {"zone": "CET"}}]', None,
                [("get_weather", {"city": "Rome", "metric": True}),
                 ("get_time", {"zone": "CET"})]),
    "qwen": ('I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n'
             '</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>',
             "I will look.", [("get_weather", {"city": "New York", "days": 2})]),
}


def stream(parser, text: str, step: int, parallel: bool = True):
    """Feed growing prefixes; reassemble content and calls as a client would."""
    streamer = ToolCallStreamer(parser, parallel)
    content, calls = "", {}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for cut in cuts:
        new_content, entries = streamer.feed(text[:cut], final=cut == len(text))
        content += new_content
        for entry in entries:
            if "id" in entry:
                assert entry["index"] not in calls and entry["type"] == "function"
                assert entry["function"]["arguments"] == ""
                calls[entry["index"]] = {"id": entry["id"], "name": entry["function"]["name"],
                                         "arguments": ""}
            else:
                assert "name" not in entry["function"]
                calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_parser_reads_calls_and_content(name):
    text, content, expected = CASES[name]
    got_content, calls, finish = parse_choice(PARSERS[name]([WEATHER, TIME]), text, True,
                                              "stop")
    assert got_content == content
    assert finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == expected
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_deltas_reassemble_into_the_whole_message(name, step):
    text = CASES[name][0]
    whole_content, whole_calls, _ = parse_choice(PARSERS[name]([WEATHER, TIME]), text, True,
                                                 "stop")
    content, calls = stream(PARSERS[name]([WEATHER, TIME]), text, step)
    assert (content or None) == whole_content
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_text_is_content(name):
    text = "Just an answer, no tools < here [ok]."
    content, calls, finish = parse_choice(PARSERS[name]([WEATHER]), text, True, "stop")
    assert content == text and calls == [] and finish == "stop"
    streamed, streamed_calls = stream(PARSERS[name]([WEATHER]), text, 2)
    assert streamed == text and streamed_calls == []


def test_partial_marker_is_held_back_until_resolved():
    parser = PARSERS["hermes"]([WEATHER])
    streamer = ToolCallStreamer(parser, True)
    assert streamer.feed("Sure <tool_", final=False) == ("Sure", [])
    content, entries = streamer.feed('Sure <tool_call>{"name": "get_weather", "argu',
                                     final=False)
    assert content == "" and entries[0]["function"]["name"] == "get_weather"


def test_parallel_false_keeps_the_first_call():
    text = CASES["hermes"][0]
    _, calls, _ = parse_choice(PARSERS["hermes"]([WEATHER, TIME]), text, False, "stop")
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    _, streamed = stream(PARSERS["hermes"]([WEATHER, TIME]), text, 5, parallel=False)
    assert [c["name"] for c in streamed] == ["get_weather"]


def test_length_cut_keeps_finish_reason_and_partial_arguments():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    content, calls, finish = parse_choice(PARSERS["hermes"]([WEATHER]), text, True, "length")
    assert finish == "length" and calls[0]["function"]["arguments"] == '{"city": "Par'


def test_constrained_forms():
    named = NamedToolParser("get_weather")
    _, calls, finish = parse_choice(named, ' {"city": "Lima"} ', True, "stop")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}
    assert finish == "tool_calls"
    content, streamed = stream(NamedToolParser("get_weather"), ' {"city": "Lima"} ', 2)
    assert streamed[0]["arguments"] == '{"city": "Lima"}' and content == ""
    required = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, ' \
               '{"name": "get_weather", "parameters": {"city": "Kyiv"}}]'
    jsonschema.validate(json.loads(required), required_schema([WEATHER, TIME], True))
    _, calls, _ = parse_choice(RequiredToolParser(), required, True, "stop")
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    _, streamed = stream(RequiredToolParser(), required, 4)
    assert [json.loads(c["arguments"]) for c in streamed] == [{"zone": "UTC"}, {"city": "Kyiv"}]


def test_required_schema_refuses_unknown_tools_and_one_call_without_parallel():
    schema = required_schema([WEATHER, TIME], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "other", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)


def test_setup_tools_choices():
    auto = setup_tools(TOOLS, None, None, "hermes", True)
    assert auto.choice == "auto" and auto.spec is None and len(auto.template_tools) == 2
    none = setup_tools(TOOLS, "none", None, None, False)
    assert none.choice == "none" and none.template_tools is None and none.parser() is None
    named = setup_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None,
                        None, False)
    assert named.choice == "named" and json.loads(named.spec.value) == TIME["parameters"]
    required = setup_tools(TOOLS, "required", False, None, False)
    assert json.loads(required.spec.value)["maxItems"] == 1
    assert setup_tools(None, None, None, None, False).choice == "none"


@pytest.mark.parametrize("tools, choice, field", [
    (TOOLS, "auto", "tool_choice"),  # auto without --enable-auto-tool-choice
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    (TOOLS, "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "code_interpreter"}], "required", "tools[0].type"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "required",
     "tools[0].function.name"),
    ([{"type": "function", "function": WEATHER}] * 2, "required", "tools[1].function.name"),
])
def test_setup_tools_errors_name_the_field(tools, choice, field):
    with pytest.raises(ToolRequestError) as info:
        setup_tools(tools, choice, None, None, False)
    assert info.value.field == field

"""The Messages API without a server: Anthropic requests as chat (server/anthropic/
convert.py), and answers as Anthropic's body and events (server/anthropic/reply.py) from
engine outputs made here, including the error event and the mixes of text and tool
calls a stream can hold."""

from __future__ import annotations

import asyncio
import json

import pytest

from treadle.engine.output_processor import CompletionOutput, RequestOutput
from treadle.server.anthropic import convert
from treadle.server.anthropic.protocol import MessagesRequest, check_fields
from treadle.server.anthropic.reply import (anthropic_sse, message_body, message_events,
                                            stop_of)
from treadle.server.errors import APIError
from treadle.server.responses import Formatting
from treadle.server.tool_calls import setup_tools

TOOL = {"name": "lookup", "input_schema": {"type": "object", "properties": {
    "q": {"type": "string"}}}}


def body(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 4, **kw})


def test_blocks_become_chat_messages_with_tool_results_first():
    b = body(system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "kind."}],
             messages=[
                 {"role": "user", "content": "q?"},
                 {"role": "assistant", "content": [
                     {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "x"}},
                     {"type": "tool_use", "id": "t2", "name": "lookup", "input": {}}]},
                 {"role": "user", "content": [
                     {"type": "text", "text": "and?"},
                     {"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                     {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                      "content": [{"type": "text", "text": "timeout"}]}]}])
    messages = convert.chat_messages(b)
    assert [(m.role, m.text()) for m in messages] == [
        ("system", "Be kind."), ("user", "q?"), ("assistant", ""), ("tool", "42"),
        ("tool", "Error: timeout"), ("user", "and?")]
    calls = messages[2].tool_calls
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("t1", "lookup", {"q": "x"}), ("t2", "lookup", {})]
    assert [m.tool_call_id for m in messages[3:5]] == ["t1", "t2"]
    assert not convert.continues_assistant(b)


@pytest.mark.parametrize("content, field", [
    ([{"type": "image", "source": {}}], "messages.0.content.0.type"),
    ([{"type": "document", "source": {}}], "messages.0.content.0.type"),
    ([{"type": "thinking", "thinking": "hm"}], "messages.0.content.0.type"),
    ([{"type": "tool_use", "id": "a", "name": "lookup", "input": {}}],
     "messages.0.content.0.type"),  # a user message may not call tools
    ([{"type": "text", "text": "x", "citations": [{"type": "char_location"}]}],
     "messages.0.content.0.citations"),
    ([{"type": "text", "text": "x", "colour": "red"}], "messages.0.content.0.colour"),
    ([{"type": "tool_result", "content": "x"}], "messages.0.content.0.tool_use_id"),
    ([{"text": "x"}], "messages.0.content.0.type"),
])
def test_blocks_that_cannot_be_served_are_refused_by_name(content, field):
    with pytest.raises(APIError) as info:
        convert.chat_messages(body(messages=[{"role": "user", "content": content}]))
    assert info.value.status == 400 and info.value.param == field
    assert info.value.message.startswith(field + ": ")


def test_tools_and_tool_choice_map_onto_chat():
    b = body(messages=[{"role": "user", "content": "x"}], tools=[TOOL],
             tool_choice={"type": "tool", "name": "lookup", "disable_parallel_tool_use": True})
    assert convert.chat_tools(b) == [{"type": "function", "function": {
        "name": "lookup", "parameters": TOOL["input_schema"]}}]
    assert convert.chat_tool_choice(b) == (
        {"type": "function", "function": {"name": "lookup"}}, False)
    for kind, chat in (("auto", "auto"), ("any", "required"), ("none", "none")):
        assert convert.chat_tool_choice(body(
            messages=[{"role": "user", "content": "x"}], tools=[TOOL],
            tool_choice={"type": kind}))[0] == chat
    with pytest.raises(APIError, match="^tools.0.type: 'web_search_20250305'"):
        convert.chat_tools(body(messages=[{"role": "user", "content": "x"}],
                                tools=[{"type": "web_search_20250305", "name": "s"}]))
    chat = convert.to_chat(body(messages=[{"role": "assistant", "content": "The"}],
                                temperature=0.5, top_k=7, stop_sequences=["##"]),
                           [])
    assert (chat.temperature, chat.top_k, chat.top_p, chat.stop) == (0.5, 7, 1.0, ["##"])


def test_fields_refused_or_ignored():
    ok = body(messages=[{"role": "user", "content": "x"}], speed="fast",
              cache_control={"type": "ephemeral"}, thinking={"type": "disabled"})
    assert check_fields(ok) is None
    assert check_fields(body(messages=[{"role": "user", "content": "x"}],
                             mcp_servers=[{}]))[0] == "mcp_servers"
    assert check_fields(body(messages=[{"role": "user", "content": "x"}], foo=1))[0] == "foo"


def _output(text, finish=None, stop=None, tokens=3, cached=0, error=None):
    return RequestOutput("msg-abc", None, [1, 2, 3, 4],
                         [CompletionOutput(0, text, list(range(tokens)), finish, stop)],
                         finished=finish is not None, error=error, num_cached_tokens=cached)


def _tools(choice):
    return setup_tools([{"type": "function", "function": {
        "name": "lookup", "parameters": TOOL["input_schema"]}}], choice, None, "hermes", True)


def test_whole_body_and_stop_reasons():
    plain = Formatting(None)
    out = message_body("msg-abc", "m", [_output("hi", "stop", "##", cached=1)], plain)
    assert out["id"] == "msg_abc" and out["content"] == [{"type": "text", "text": "hi"}]
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "##")
    assert out["usage"] == {"input_tokens": 3, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 1, "output_tokens": 3}
    c = _output("", "length").outputs[0]
    assert stop_of(c, True) == ("max_tokens", None)
    assert stop_of(_output("", "stop").outputs[0], False) == ("end_turn", None)
    named = Formatting(None, tools=_tools({"type": "function", "function": {"name": "lookup"}}))
    call = message_body("msg-abc", "m", [_output('{"q": "x"}', "stop")], named)
    assert call["stop_reason"] == "tool_use"
    assert [(b["type"], b["name"], b["input"]) for b in call["content"]] == [
        ("tool_use", "lookup", {"q": "x"})]
    broken = message_body("msg-abc", "m", [_output('{"q": ', "length")], named)
    assert broken["content"] == [{"type": "text", "text": '{"q": '}]
    assert broken["stop_reason"] == "max_tokens"


async def _collect(outputs, fmt):
    async def gen():
        for o in outputs:
            yield 0, o
    return [e async for e in message_events("msg-abc", "m", gen(), False, fmt)]


def test_stream_of_text_then_a_tool_call_then_text():
    fmt = Formatting(None, tools=_tools("auto"))
    texts = ["Let me", "Let me look.<tool_call>", '<tool_call>{"name": "lookup", "arguments":'
             ' {"q"', '<tool_call>{"name": "lookup", "arguments": {"q": "x"}}</tool_call>',
             '<tool_call>{"name": "lookup", "arguments": {"q": "x"}}</tool_call> Done']
    texts = [t if i < 2 else "Let me look." + t for i, t in enumerate(texts)]
    outputs = [_output(t, "stop" if i == len(texts) - 1 else None, tokens=i + 1)
               for i, t in enumerate(texts)]
    events = asyncio.run(_collect(outputs, fmt))
    names = [e["type"] for e in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use", "text"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    text0 = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                    and e["index"] == 0)
    args = "".join(e["delta"]["partial_json"] for e in events
                   if e["type"] == "content_block_delta" and e["index"] == 1)
    assert text0 == "Let me look." and json.loads(args) == {"q": "x"}
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_empty_answer_still_has_a_text_block_and_errors_end_the_stream():
    events = asyncio.run(_collect([_output("", "stop", tokens=1)], Formatting(None)))
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "ping", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    events = asyncio.run(_collect([_output("a"), _output("a", "error", error="boom")],
                                  Formatting(None)))
    assert events[-1] == {"error": {"message": "boom"}}

    class Serving:
        @staticmethod
        def ended_by_engine(message):
            return APIError(400, message)

    async def gen():
        yield {"type": "ping"}
        yield {"error": {"message": "prompt: bad"}}

    async def frames():
        response = anthropic_sse(Serving(), gen())
        return [chunk async for chunk in response.body_iterator]
    out = asyncio.run(frames())
    assert out[0] == 'event: ping\ndata: {"type": "ping"}\n\n'
    assert out[1].startswith("event: error\ndata: ")
    assert json.loads(out[1].split("data: ", 1)[1]) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "prompt: bad"}}

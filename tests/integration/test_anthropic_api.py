"""Anthropic's Messages API through the official `anthropic` client on a tiny demo model:
answers equal the chat endpoint's for the same conversation, streaming (the client's
own accumulator and the raw event order), stop sequences, tools (any / tool / none, a
tool_use and tool_result round trip), prefill, count_tokens, keys in x-api-key and
Bearer, and errors in Anthropic's shape with its status codes. (The client no longer
lists temperature among its arguments: it goes in extra_body, as a raw body has it.)"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from server_fixtures import running_server, TINY_DEMO
from treadle.models.demo import write_demo_model

GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Current weather",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12},
               "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": WEATHER["input_schema"]}}


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    return str(write_demo_model(tmp_path_factory.mktemp("demo") / "m", seed=11,
                                config_overrides=TINY_DEMO))


@pytest.fixture(scope="module")
def server(tiny_demo, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text("- {key: alpha-key, tenant: alpha}\n")
    with running_server(tiny_demo, "--num-kv-blocks", "512", "--api-keys-file", str(keys)) \
            as (base, _):
        yield base


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="alpha-key", max_retries=0)


def chat(server, body: dict) -> dict:
    r = httpx.post(server + "/v1/chat/completions", json={"model": "tiny", **body},
                   headers={"Authorization": "Bearer alpha-key"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


CONVERSATION = [{"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hi. "},
                                                  {"type": "text", "text": "How can I help?"}]},
                {"role": "user", "content": [{"type": "text", "text": "Tell me a story"}]}]
AS_CHAT = [{"role": "system", "content": "You are brief."},
           {"role": "user", "content": "Hello there"},
           {"role": "assistant", "content": "Hi. How can I help?"},
           {"role": "user", "content": "Tell me a story"}]


def test_message_equals_the_chat_answer_whole_and_streamed(client, server):
    message = client.messages.create(
        model="tiny", max_tokens=12, messages=CONVERSATION, extra_body=GREEDY,
        system=[{"type": "text", "text": "You are "}, {"type": "text", "text": "brief."}],
        metadata={"user_id": "u1"})
    reference = chat(server, {"messages": AS_CHAT, "max_tokens": 12, "temperature": 0})
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == "tiny"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == reference["choices"][0]["message"]["content"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        reference["choices"][0]["finish_reason"]]
    usage = reference["usage"]
    assert message.usage.output_tokens == usage["completion_tokens"]
    assert (message.usage.input_tokens + message.usage.cache_read_input_tokens
            == usage["prompt_tokens"])
    with client.messages.stream(model="tiny", max_tokens=12, messages=CONVERSATION,
                                system="You are brief.", extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text == final.content[0].text
    assert final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens


def _events(server, body: dict) -> list[tuple[str, dict]]:
    r = httpx.post(server + "/v1/messages", headers={"x-api-key": "alpha-key"},
                   json={"model": "tiny", "stream": True, **body}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = []
    for frame in r.text.strip().split("\n\n"):
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        events.append((payload["type"], payload))
    return events


def test_stream_follows_anthropics_event_order(server):
    events = _events(server, {"max_tokens": 6, "temperature": 0,
                              "messages": [{"role": "user", "content": "Once upon"}]})
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("max_tokens", "end_turn")
    assert delta["usage"]["output_tokens"] <= 6


def test_stop_sequences(client):
    messages = [{"role": "user", "content": "Once upon"}]
    base = client.messages.create(model="tiny", max_tokens=10, extra_body=GREEDY,
                                  messages=messages)
    text = base.content[0].text
    assert base.stop_reason == "max_tokens" and len(text) >= 3
    stop = text[1:3]
    stopped = client.messages.create(model="tiny", max_tokens=10, extra_body=GREEDY,
                                     stop_sequences=["never said", stop], messages=messages)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[:text.index(stop)]


def test_tool_choice_any_and_tool_give_tool_use_blocks(client, server):
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        message = client.messages.create(
            model="tiny", max_tokens=60, tools=[WEATHER], tool_choice=choice,
            messages=[{"role": "user", "content": "Weather in Paris?"}])
        assert message.stop_reason == "tool_use"
        calls = [b for b in message.content if b.type == "tool_use"]
        assert len(calls) >= 1 and calls[0].name == "get_weather"
        assert calls[0].id.startswith("toolu_")
        assert set(calls[0].input) == {"city", "unit"}
        assert calls[0].input["unit"] in ("celsius", "fahrenheit")
    with client.messages.stream(model="tiny", max_tokens=60, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather",
                                             "disable_parallel_tool_use": True},
                                messages=[{"role": "user", "content": "Weather?"}]) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert set(kinds) == {"input_json_delta"}
    assert [b.type for b in final.content] == ["tool_use"] and final.stop_reason == "tool_use"
    assert set(final.content[0].input) == {"city", "unit"}
    none = client.messages.create(model="tiny", max_tokens=5, tools=[WEATHER],
                                  tool_choice={"type": "none"},
                                  messages=[{"role": "user", "content": "Weather?"}])
    assert [b.type for b in none.content] == ["text"]


def test_tool_use_and_tool_result_render_as_chat_tool_messages(client, server):
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris", "unit": "celsius"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "18 degrees"}]},
            {"type": "text", "text": "Thanks!"}]}]
    as_chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 degrees"},
        {"role": "user", "content": "Thanks!"}]
    counted = client.messages.count_tokens(model="tiny", messages=conversation,
                                           tools=[WEATHER], tool_choice={"type": "any"})
    reference = chat(server, {"messages": as_chat, "max_tokens": 1, "tools": [CHAT_WEATHER],
                              "tool_choice": "required"})
    assert counted.input_tokens == reference["usage"]["prompt_tokens"]
    answer = client.messages.create(model="tiny", max_tokens=4, messages=conversation,
                                    tools=[WEATHER], tool_choice={"type": "none"},
                                    extra_body=GREEDY)
    assert answer.content[0].type == "text"


def test_prefill_continues_the_assistant_message(client, tiny_demo):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_demo)
    conversation = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": "The capital is"}]
    expected = tok.apply_chat_template(conversation, tokenize=False,
                                       continue_final_message=True)
    counted = client.messages.count_tokens(model="tiny", messages=conversation)
    assert counted.input_tokens == len(tok.encode(expected, add_special_tokens=False))
    message = client.messages.create(model="tiny", max_tokens=3, messages=conversation,
                                     extra_body=GREEDY)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
        counted.input_tokens


def test_keys_in_x_api_key_or_bearer(server):
    bearer = anthropic.Anthropic(base_url=server, auth_token="alpha-key", api_key=None,
                                 max_retries=0)
    assert bearer.messages.count_tokens(
        model="tiny", messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=server, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="tiny", max_tokens=2,
                              messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server + "/v1/completions", headers={"x-api-key": "alpha-key"},
                   json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200  # one keyring for both APIs
    r = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("body, status, kind, field", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error",
     "max_tokens"),
    ({"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]},
     400, "invalid_request_error", "messages.0.content.0.type"),
    ({"max_tokens": 2, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]},
     400, "invalid_request_error", "temperature"),
    ({"max_tokens": 2, "thinking": {"type": "enabled", "budget_tokens": 1024},
      "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error",
     "thinking"),
    ({"max_tokens": 2, "top_logprobs": 3, "messages": [{"role": "user", "content": "hi"}]},
     400, "invalid_request_error", "top_logprobs"),
    ({"max_tokens": 2, "tools": [WEATHER], "messages": [{"role": "user", "content": "hi"}]},
     400, "invalid_request_error", "tool_choice"),
    ({"max_tokens": 2, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"},
      "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error",
     "tool_choice.name"),
    ({"max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}]}, 400,
     "invalid_request_error", "max_tokens"),
    ({"model": "claude-sonnet", "max_tokens": 2, "messages": [{"role": "user",
                                                               "content": "hi"}]},
     404, "not_found_error", "model"),
])
def test_errors_in_anthropics_shape(server, body, status, kind, field):
    r = httpx.post(server + "/v1/messages", headers={"x-api-key": "alpha-key"},
                   json={"model": "tiny", **body})
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert error["error"]["message"].startswith(field), error


def test_unknown_tool_choice_auto_needs_the_parser_but_accepted_ignored_fields_pass(client):
    message = client.messages.create(model="tiny", max_tokens=2, service_tier="auto",
                                     messages=[{"role": "user", "content": "hi"}],
                                     extra_body={"cache_control": {"type": "ephemeral"}})
    assert message.content[0].type == "text"
    with pytest.raises(anthropic.BadRequestError, match="container"):
        client.messages.create(model="tiny", max_tokens=2, container="c1",
                               messages=[{"role": "user", "content": "hi"}])

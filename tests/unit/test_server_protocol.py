"""The wire format without a server: bounds in the types, strictness, lone surrogates,
error locations that name fields, the OpenAPI bounds from the engine's limits."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from treadle.engine.limits import EngineLimits
from treadle.server import protocol
from treadle.server.errors import field_of
from treadle.server.openapi import _set_limits, token_id_pattern


def errors_of(model, body):
    with pytest.raises(ValidationError) as exc:
        model.model_validate(body)
    return exc.value.errors()


@pytest.mark.parametrize("body, field", [
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": "ok", "stop": ["fine", "x\udfff"]}, "stop.1"),
    ({"prompt": "ok", "user": "\udc00"}, "user"),
    ({"prompt": "ok", "unknown_extra": {"k": "\ud800"}}, "unknown_extra.k"),
])
def test_lone_surrogates_are_refused_where_they_are(body, field):
    (error,) = errors_of(protocol.CompletionRequest, body)
    assert error["type"] == "lone_surrogate" and error["ctx"]["field"] == field


def test_lone_surrogate_in_chat_and_tokenize():
    (error,) = errors_of(protocol.ChatCompletionRequest,
                         {"messages": [{"role": "user", "content": "hi \ud83d"}]})
    assert error["ctx"]["field"] == "messages.0.content"
    (error,) = errors_of(protocol.TokenizeRequest, {"prompt": "\ud800"})
    assert error["ctx"]["field"] == "prompt"
    assert protocol.surrogate_path({"a": ["x", "😀", 5]}) is None  # a real pair is fine


def test_types_are_strict_as_the_schema_says():
    for body in ({"prompt": "x", "max_tokens": "3"}, {"prompt": "x", "stream": "true"},
                 {"prompt": "x", "temperature": "0.5"}, {"prompt": [1, "2"]}):
        assert errors_of(protocol.CompletionRequest, body)
    ok = protocol.CompletionRequest.model_validate({"prompt": [5.0], "temperature": 1, "n": 2.0})
    assert ok.temperature == 1.0  # an integer is a JSON number
    assert ok.n == 2 and ok.prompt == [5]  # and 2.0 is an integer (JSON Schema)
    assert errors_of(protocol.CompletionRequest, {"prompt": "x", "n": 2.5})
    assert errors_of(protocol.CompletionRequest, {"prompt": "x", "n": True})


def test_bounds_live_in_the_types():
    long_stop = "s" * (protocol.MAX_STOP_STRING_CHARS + 1)
    for body in ({"prompt": ""}, {"prompt": []}, {"prompt": ["a", ""]},
                 {"prompt": ["a"] * (protocol.MAX_PROMPTS + 1)},
                 {"prompt": "x", "stop": ""}, {"prompt": "x", "stop": [long_stop]},
                 {"prompt": "x", "stop": ["a"] * (protocol.MAX_STOP_STRINGS + 1)},
                 {"prompt": "x", "logit_bias": {"07": 1}}, {"prompt": "x", "logit_bias": {"a": 1}},
                 {"prompt": "x", "logit_bias": {"5": 101}}, {"prompt": [-1]}):
        assert errors_of(protocol.CompletionRequest, body), body
    # Batched prompts (issue 21): a list of texts or of token-id lists, one choice each.
    assert protocol.CompletionRequest.model_validate({"prompt": [[4, 5]]}).prompts() == [[4, 5]]
    assert protocol.CompletionRequest.model_validate({"prompt": ["hi", "yo"]}).prompts() == [
        "hi", "yo"]


def test_content_parts_and_tokenize_needs_one_input():
    chat = protocol.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                   {"type": "text", "text": "b"}]}]})
    assert chat.messages[0].text() == "ab"
    errors = errors_of(protocol.ChatCompletionRequest, {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert any(e["loc"][-1] == "type" for e in errors)
    (error,) = errors_of(protocol.TokenizeRequest, {})
    assert error["ctx"]["field"] == "prompt"
    schema = protocol.TokenizeRequest.model_json_schema()
    assert [branch["required"] for branch in schema["anyOf"]] == [["prompt"], ["messages"]]


@pytest.mark.parametrize("loc, field", [
    (("body", "temperature"), "temperature"),
    (("body", "prompt", "list[constrained-int]", 3), "prompt.3"),
    (("body", "messages", 0, "content", "str"), "messages.0.content"),
    (("body", "logit_bias", "07", "[key]"), "logit_bias"),
    (("body", 14), "14"),  # only json_invalid errors carry an offset, handled apart
    (("body",), None),
])
def test_field_of_names_fields_not_type_tags(loc, field):
    assert field_of(loc) == field


@pytest.mark.parametrize("vocab", [1, 2, 9, 10, 11, 100, 101, 1024, 32000, 49152, 151936])
def test_token_id_pattern_matches_exactly_the_vocabulary(vocab):
    pattern = re.compile(token_id_pattern(vocab))
    for n in list(range(0, min(vocab + 50, 3000))) + [vocab - 1, vocab, vocab + 1, 10 * vocab]:
        assert bool(pattern.match(str(n))) == (0 <= n < vocab), n
    assert not pattern.match("007") and not pattern.match("") and not pattern.match("-1")


@settings(max_examples=200, deadline=None)
@given(vocab=st.integers(1, 10**6), n=st.integers(0, 2 * 10**6))
def test_token_id_pattern_property(vocab, n):
    assert bool(re.match(token_id_pattern(vocab), str(n))) == (n < vocab)


def test_openapi_bounds_come_from_the_engine_limits():
    from fastapi.openapi.utils import get_openapi  # noqa: F401  (FastAPI installed)

    limits = EngineLimits(vocab_size=1000, max_model_len=512, num_kv_tokens=256,
                          block_size=16)
    schemas = {name: getattr(protocol, name).model_json_schema(ref_template="{model}")
               for name in ("CompletionRequest", "ChatCompletionRequest",
                            "DetokenizeRequest")}
    _set_limits(schemas, limits)
    props = schemas["CompletionRequest"]["properties"]
    assert props["max_tokens"]["anyOf"][0]["maximum"] == 255  # the KV cache is smaller
    assert props["min_tokens"]["maximum"] == 255
    token_list = next(b for b in props["prompt"]["anyOf"] if b.get("items", {}).get("type")
                      == "integer")
    assert token_list["items"]["maximum"] == 999 and token_list["maxItems"] == 255
    bias = next(b for b in props["logit_bias"]["anyOf"] if b.get("type") == "object")
    assert bias["propertyNames"]["pattern"] == token_id_pattern(1000)
    assert bias["additionalProperties"]["maximum"] == 100
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["max_completion_tokens"]["anyOf"][0]["maximum"] == 255
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 999
    assert limits.max_request_tokens == 256

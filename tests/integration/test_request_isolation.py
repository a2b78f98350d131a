"""No request can kill the engine: the hostile grammars of the trust report, sent through
chat, completions and the Responses API while another stream runs. Each is refused with a
400 naming the field and the limit, or ends alone with an error once it runs; the other
stream gets every token, and the server keeps serving.

Before the fix, the first of these made the grammar matcher fail mid-step ("Current row
has 2003 items; max is 2000"), the engine loop died, and every request with it."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from server_fixtures import running_server
from treadle.models.demo import write_demo_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2)

WIDE = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2001)}}
OPTIONAL_499 = {"type": "object",
                "properties": {f"p{i}": {"type": "integer"} for i in range(499)}}
RECURSIVE = {"type": "object", "properties": {"child": {"$ref": "#"}, "v": {"type": "integer"}}}
ALTERNATIVES = "start: " + " | ".join(f'"a{i}"' for i in range(2001))
ENUM_50K = {"type": "object", "properties": {"x": {"enum": [f"v{i}" for i in range(50000)]}},
            "required": ["x"]}
AMBIGUOUS = 'start: x\nx: x x | "a"'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_demo_model(tmp_path_factory.mktemp("iso") / "m", seed=11,
                             config_overrides=TINY)
    # a budget small enough that the ambiguous grammar passes it within ~200 tokens here
    with running_server(str(model), "--num-kv-blocks", "1024", "--max-model-len", "2048",
                        "--grammar-mask-budget-ms", "5") as (base, _):
        yield base


def chat(**extra):
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 24, **extra}


def tool(parameters):
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def responses_tool(parameters):
    return [{"type": "function", "name": "f", "parameters": parameters}]


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


REFUSED = [  # (route, body, the field the 400 names, words of its message)
    ("/v1/chat/completions", chat(response_format=schema_format(WIDE)),
     "response_format.json_schema.schema", "max is 2000"),
    ("/v1/chat/completions", chat(response_format=schema_format(OPTIONAL_499)),
     "response_format.json_schema.schema", "499 properties"),
    ("/v1/chat/completions", chat(structured_outputs={"grammar": ALTERNATIVES}),
     "structured_outputs.grammar", "max is 2000"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4,
                         "structured_outputs": {"grammar": ALTERNATIVES}},
     "structured_outputs.grammar", "max is 2000"),
    ("/v1/chat/completions", chat(tools=tool(ENUM_50K), tool_choice="required"),
     "tool_choice", "at most 262144 characters"),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 8,
                       "text": {"format": {"type": "json_schema", "name": "x",
                                           "schema": WIDE}}},
     "response_format.json_schema.schema", "max is 2000"),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 8,
                       "tools": responses_tool(ENUM_50K), "tool_choice": "required"},
     "tool_choice", "at most 262144 characters"),
]


@pytest.fixture
def background_stream(server):
    """A plain stream of 300 tokens running beside the test; yields a function that
    returns the tokens it received once it ended."""
    received, errors = [], []

    def run():
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 300, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", server + "/v1/completions", json=body,
                              timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            errors.append(event)
                        else:
                            received.extend(c["text"] for c in event["choices"])
        except httpx.HTTPError as exc:
            errors.append(repr(exc))

    thread = threading.Thread(target=run)
    thread.start()

    def finish():
        thread.join(timeout=300)
        assert not errors, errors
        return received
    yield finish
    thread.join(timeout=300)


def test_hostile_grammars_are_refused_or_end_alone_while_another_stream_runs(
        server, background_stream):
    for route, body, field, words in REFUSED:
        r = httpx.post(server + route, json=body, timeout=120)
        assert r.status_code == 400, (route, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == field and words in error["message"], error
    # A recursive schema is served; whatever it does while running ends it alone.
    r = httpx.post(server + "/v1/chat/completions",
                   json=chat(tools=tool(RECURSIVE), tool_choice="required"), timeout=120)
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "tool_choice"
    # The ambiguous grammar's masks grow with its output: over the budget it ends with an
    # error naming it, instead of slowing every other stream.
    r = httpx.post(server + "/v1/completions", json={
        "model": "tiny", "prompt": "x", "max_tokens": 1500, "min_tokens": 1490,
        "structured_outputs": {"grammar": AMBIGUOUS}}, timeout=300)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "structured_outputs.grammar"
    assert "over the budget of 5 ms a step" in error["message"]
    with httpx.stream("POST", server + "/v1/chat/completions", json=chat(
            max_tokens=1500, min_tokens=1490, stream=True,
            structured_outputs={"grammar": AMBIGUOUS}), timeout=300) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert "over the budget" in events[-1]["error"]["message"]
    assert any(e.get("choices") for e in events[:-1])  # it streamed tokens first
    assert len(background_stream()) == 300  # every token of the other stream arrived
    r = httpx.post(server + "/v1/chat/completions", json=chat(max_tokens=4), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(server + "/health", timeout=10).status_code == 200

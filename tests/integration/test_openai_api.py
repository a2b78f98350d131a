"""The OpenAI API as clients use it, through the official `openai` client on a tiny demo
model: echo and prompt logprobs (against transformers), max_tokens 0, batched prompts,
cached-token usage, structured outputs and tool calls, fields refused or ignored."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from server_fixtures import running_server, TINY_DEMO
from treadle.models.demo import write_demo_model


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    return str(write_demo_model(tmp_path_factory.mktemp("demo") / "m", seed=11,
                                config_overrides=TINY_DEMO))


KEY = {"Authorization": "Bearer alpha-key"}  # tenant alpha; beta-key is tenant beta


@pytest.fixture(scope="module")
def server(tiny_demo, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text("- {key: alpha-key, tenant: alpha}\n- {key: beta-key, tenant: beta}\n")
    with running_server(tiny_demo, "--num-kv-blocks", "512", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--api-keys-file", str(keys)) \
            as (base, _):
        yield base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="alpha-key", max_retries=0)


# ----- echo and prompt logprobs -----------------------------------------------------------

def reference_prompt_logprobs(model_dir: str, ids: list[int]) -> list[float]:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[k - 1, ids[k]]) for k in range(1, len(ids))]


def test_echo_logprobs_max_tokens_zero_equal_transformers(client, server, tiny_demo):
    prompt = "The capital of France is Paris, and the capital of Spain is"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                    logprobs=3, temperature=0)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0
    ids = httpx.post(server + "/tokenize", headers=KEY, json={"prompt": prompt}).json()["tokens"]
    assert out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    assert all(len(top) == 3 for top in lp.top_logprobs[1:])
    expected = reference_prompt_logprobs(tiny_demo, ids)
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert "".join(lp.tokens) == prompt
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(ids))]


def test_echo_with_generation_streamed_and_not(client):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=6, echo=True,
                  logprobs=1, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.text.startswith("Once upon a time")
    assert len(whole.logprobs.tokens) == whole.logprobs.text_offset.__len__()
    chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert chunks[0].choices[0].text.startswith("Once upon a time")
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert offsets == whole.logprobs.text_offset  # running across chunks
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]


def test_vllm_prompt_logprobs_field(server):
    r = httpx.post(server + "/v1/completions", headers=KEY, json={
        "model": "tiny", "prompt": "Hello there friend", "max_tokens": 2,
        "prompt_logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and all(2 <= len(e) <= 3 for e in plp[1:])


def test_max_tokens_zero_without_echo_is_refused(server):
    r = httpx.post(server + "/v1/completions", headers=KEY,
                   json={"model": "tiny", "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# ----- batched prompts --------------------------------------------------------------------

def test_batched_prompts_equal_one_by_one(client):
    prompts = ["Roses are red", "The sky above the port", "In a hole in the ground"]
    kwargs = dict(model="tiny", max_tokens=5, temperature=0, n=2,
                  extra_body={"ignore_eos": True})
    batch = client.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(prompt=prompt, **kwargs)
        for c in alone.choices:
            assert batch.choices[i * 2 + c.index].text == c.text
    assert batch.usage.completion_tokens == 30
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    by_ids = client.completions.create(prompt=ids, model="tiny", max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    for i, p in enumerate(ids):
        alone = client.completions.create(prompt=p, model="tiny", max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert by_ids.choices[i].text == alone.choices[0].text
    texts: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, stream=True,
                                           stream_options={"include_usage": True}, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 30
    assert [texts[i] for i in range(6)] == [c.text for c in batch.choices]


# ----- usage and models ------------------------------------------------------------------

def test_usage_reports_cached_tokens(client):
    out = client.completions.create(model="tiny", prompt="a prompt never sent before " * 5,
                                    max_tokens=1)
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # nothing cached yet


def test_second_identical_prompt_reports_prefix_cache_hits(client):
    prompt = "a shared prefix that fills a few blocks " * 6
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_models_created_is_stable(client):
    import time
    first = client.models.list().data[0].created
    time.sleep(1.1)
    assert client.models.list().data[0].created == first


# ----- fields ------------------------------------------------------------------------------

@pytest.mark.parametrize("path, extra, field", [
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"temprature": 0.5}, "temprature"),
    ("/v1/completions", {"suffix": "the end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {"stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
])
def test_unsupported_fields_are_400_naming_them(server, path, extra, field):
    body = ({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
            else {"prompt": "hi"})
    r = httpx.post(server + path, headers=KEY,
                   json={"model": "tiny", "max_tokens": 2, **body, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_accepted_ignored_fields(server):
    r = httpx.post(server + "/v1/chat/completions", headers=KEY, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "user": "u1", "metadata": {"k": "v"}, "service_tier": "auto", "store": False,
        "modalities": ["text"]})
    assert r.status_code == 200, r.text
    r = httpx.post(server + "/v1/completions", headers=KEY, json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2, "best_of": 1, "suffix": ""})
    assert r.status_code == 200, r.text


# ----- structured outputs ------------------------------------------------------------------

def test_schema_that_does_not_compile_is_400_naming_the_construct(server):
    r = httpx.post(server + "/v1/chat/completions", headers=KEY, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "look-around" in error["message"]
    r = httpx.post(server + "/v1/completions", headers=KEY, json={
        "model": "tiny", "prompt": "x", "max_tokens": 4,
        "structured_outputs": {"regex": "a(b"}})
    assert r.status_code == 400 and "unclosed group" in r.json()["error"]["message"]


def test_parse_with_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):  # bounded: a random tiny model would otherwise ramble on
        name: str = Field(max_length=12)
        population: int = Field(ge=0, le=99999999)

    for _ in range(5):
        out = client.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "A city?"}],
            response_format=City, max_tokens=200, temperature=1.0)
        assert isinstance(out.choices[0].message.parsed, City)


def test_regex_and_choice_always_match(client):
    import re
    for _ in range(5):
        out = client.completions.create(model="tiny", prompt="Date:", max_tokens=20,
                                        temperature=1.0,
                                        extra_body={"structured_outputs": {
                                            "regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
        assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", out.choices[0].text)
        out = client.completions.create(model="tiny", prompt="Answer:", max_tokens=5,
                                        temperature=1.0, extra_body={
                                            "structured_outputs": {"choice": ["yes", "no"]}})
        assert out.choices[0].text in ("yes", "no")


# ----- tool calls ---------------------------------------------------------------------------

def valid_weather_arguments(arguments: str) -> None:
    import jsonschema
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_named_tool_choice_returns_valid_arguments(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER], max_tokens=60, temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    valid_weather_arguments(call.function.arguments)


def test_named_tool_choice_streamed(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER], max_tokens=60, temperature=1.0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    first, arguments, finish = None, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        for call in chunk.choices[0].delta.tool_calls or []:
            if first is None:
                first = call
                assert call.id and call.type == "function"
                assert call.function.name == "get_weather"
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    valid_weather_arguments(arguments)


def test_required_tool_choice(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=1.0)
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    valid_weather_arguments(calls[0].function.arguments)


def test_auto_tool_choice_runs_the_parser_and_history_with_tools_renders(client):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                         max_tokens=8, temperature=0)
    choice = out.choices[0]  # a random model writes text, which the parser leaves alone
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], max_tokens=8, temperature=0,
        stream=True) if c.choices)
    assert streamed == choice.message.content


def test_tool_choice_errors(server):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(server + "/v1/chat/completions", headers=KEY, json={
        **base, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                    "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.function.name"
    r = httpx.post(server + "/v1/chat/completions", headers=KEY,
                   json={**base, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


# ----- the Responses API -------------------------------------------------------------------

def test_responses_text_and_usage(client):
    out = client.responses.create(model="tiny", input="Tell me about the sea.",
                                  instructions="Be brief.", max_output_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 8 and out.usage.input_tokens > 0
    assert out.usage.total_tokens == out.usage.input_tokens + 8
    assert out.output[0].type == "message" and out.output_text == \
        out.output[0].content[0].text


def test_responses_stream_reassembles_into_the_whole_response(client):
    kwargs = dict(model="tiny", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Say something."}]}], max_output_tokens=10,
        temperature=0, extra_body={"ignore_eos": True})
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.done", "response.content_part.done",
                 "response.output_item.done"):
        assert kind in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    usage, expected = final.usage.model_dump(), whole.usage.model_dump()
    # The second request finds the first one's prompt in the prefix cache.
    assert usage.pop("input_tokens_details")["cached_tokens"] >= 0
    expected.pop("input_tokens_details")
    assert usage == expected
    assert final.status == whole.status
    item_id = next(e.item_id for e in events if e.type == "response.output_text.delta")
    assert final.output[0].id == item_id


def test_responses_store_previous_response_and_tenants(client, server):
    first = client.responses.create(model="tiny", input="My name is Ann.",
                                    max_output_tokens=4, temperature=0)
    second = client.responses.create(model="tiny", input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=4,
                                     temperature=0)
    alone = client.responses.create(model="tiny", input="What is my name?",
                                    max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens > alone.usage.input_tokens  # the history was included
    assert client.responses.retrieve(first.id).output_text == first.output_text
    other = openai.OpenAI(base_url=server + "/v1", api_key="beta-key", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="tiny", input="hi", previous_response_id=first.id,
                               max_output_tokens=2)
    unstored = client.responses.create(model="tiny", input="x", store=False,
                                       max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_responses_function_items_and_tools(client):
    tool = {"type": "function", "name": "get_weather",
            "parameters": WEATHER["function"]["parameters"]}
    out = client.responses.create(model="tiny", tools=[tool], max_output_tokens=6,
                                  temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris", "unit": "celsius"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'}])
    assert out.status in ("completed", "incomplete")  # a random model answers in text
    assert all(item.type == "message" for item in out.output)


def test_responses_named_function_call(client):
    tool = {"type": "function", "name": "get_weather",
            "parameters": WEATHER["function"]["parameters"]}
    out = client.responses.create(model="tiny", input="Weather?", tools=[tool],
                                  tool_choice={"type": "function", "name": "get_weather"},
                                  max_output_tokens=60, temperature=1.0)
    call = next(item for item in out.output if item.type == "function_call")
    valid_weather_arguments(call.arguments)


@pytest.mark.parametrize("body, field", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "hi", "text": {"format": "json"}}, "text.format"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
])
def test_responses_errors_name_the_field(server, body, field):
    r = httpx.post(server + "/v1/responses", headers=KEY,
                   json={"model": "tiny", "max_output_tokens": 2, **body})
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == field


# ----- the README's own examples ------------------------------------------------------------

def _readme_blocks(language: str) -> list[str]:
    import pathlib
    import re
    text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def _as_served(code: str, server: str) -> str:
    return (code.replace("http://127.0.0.1:8000", server)
            .replace('"SmolLM2-135M-Instruct"', '"tiny"')
            .replace('api_key="unused"', 'api_key="alpha-key"'))


def test_readme_python_client_example_runs(server, capsys):
    block = next(b for b in _readme_blocks("python") if "from openai import OpenAI" in b)
    exec(compile(_as_served(block, server), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.rstrip().endswith("tokens]")


def test_readme_curl_examples_are_valid_requests(server):
    import shlex
    block = next(b for b in _readme_blocks("bash")
                 if "/v1/completions" in b and "/v1/chat" in b)
    commands = ["curl" + c for c in block.replace("\\\n", " ").split("curl")[1:]]
    assert len(commands) == 2
    for command in commands:
        args = shlex.split(_as_served(command, server))
        url, body = args[args.index("curl") + 1 + ("-N" in args)], json.loads(
            args[args.index("-d") + 1])
        assert "max_tokens" in body
        r = httpx.post(url, headers=KEY, json=body, timeout=60)
        assert r.status_code == 200, r.text

"""The /openapi.json the server publishes: what each route accepts and can answer.

Owns the schema's truth: every route lists the statuses it can return (400, 401, 403,
404, 409, 413, 429, 500, 503, each with the OpenAI error body, Anthropic's under
/v1/messages, a generating route's 429 and 503 with their Retry-After header)
and its content types (JSON, or server-sent events when streaming; Prometheus text for
/metrics; HTML and an endless event stream for the dashboard); the bounds that depend on
the loaded model (token ids below the vocabulary, max_tokens and prompt lengths within
the context and the KV cache) are written into the request schemas from the same
EngineLimits the validators use; with API keys configured every route but /health and
/metrics declares Bearer or x-api-key auth (the dashboard's Basic too). The one rule JSON Schema
cannot state, prompt tokens + max_tokens <= the request limit, is in the description of
max_tokens. It validates nothing itself (protocol.py and validation.py do).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from treadle.engine.limits import EngineLimits
from treadle.server.anthropic import protocol as anthropic_protocol
from treadle.server.errors import is_anthropic_path
from treadle.server.fields import ACCEPTED_IGNORED, NEUTRAL_VALUES, UNSUPPORTED
from treadle.server.batch_routes import OTHER_CONTENT as _BATCH_CONTENT
from treadle.server.batch_routes import ROUTE_ERRORS as _BATCH_ROUTE_ERRORS
from treadle.server.lora_routes import ROUTE_ERRORS as _LORA_ROUTE_ERRORS
from treadle.server.middleware import DASHBOARD_PREFIX, OPEN_PATHS

_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                       "code": {"type": "integer"}}}},
}
_ANTHROPIC_ERROR_SCHEMA = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
_ANTHROPIC_SSE_EVENT = {
    "type": "object", "required": ["event", "data"],
    "properties": {"event": {"type": "string", "description": "message_start, "
                             "content_block_start, ping, content_block_delta, "
                             "content_block_stop, message_delta, message_stop, or error"},
                   "data": {"type": "string", "description": "the event as JSON"}},
}
_SSE_EVENT = {  # OpenAPI 3.1: the schema of one event of the stream
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk (a completion "
                            "delta, the usage, or an error body), then [DONE]"}},
}
_DESCRIPTIONS = {
    400: "Invalid request: the message names the field and the limit",
    401: "Missing or invalid API key",
    403: "This API key is limited to some models and may not load or unload adapters",
    404: "Unknown model, no stored response of that id, no such LoRA adapter, no "
         "timeline of that request id, or no file or batch of that id for this tenant",
    409: "A LoRA adapter of that name is already loaded (or it is the base model's), or "
         "the batch has already ended",
    413: "Body larger than max_request_body_bytes (an upload: batch_max_file_bytes)",
    429: "Over the tenant's own limits (requests in flight, tokens a minute; retry after "
         "Retry-After seconds), or too many unfinished batches",
    500: "The engine failed while serving the request",
    503: "The server is saturated (retry after Retry-After seconds), shutting down, or its "
         "engine is stalled or not running",
}
_GENERATION = (400, 404, 413, 429, 500, 503)
_ROUTE_ERRORS = {
    ("/v1/completions", "post"): _GENERATION,
    ("/v1/chat/completions", "post"): _GENERATION,
    ("/tokenize", "post"): (400, 404, 413),
    ("/detokenize", "post"): (400, 404, 413),
    ("/v1/responses", "post"): _GENERATION,
    ("/v1/responses/{response_id}", "get"): (404,),
    ("/v1/responses/{response_id}", "delete"): (404,),
    ("/v1/models", "get"): (503,),
    ("/v1/requests/{request_id}", "get"): (404, 503),
    ("/dashboard/requests/{request_id}", "get"): (404, 503),
    ("/health", "get"): (503,),
    ("/v1/messages", "post"): _GENERATION,
    ("/v1/messages/count_tokens", "post"): (400, 404, 413, 503),
    ("/ready", "get"): (503,),
    **_LORA_ROUTE_ERRORS,
    **_BATCH_ROUTE_ERRORS,
}
_STREAMING = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
_DASHBOARD_EVENT = {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "one JSON object: gauges, "
                            "totals, latency percentiles, tenant shares, the steps since "
                            "the last event (docs/dashboard.md)"}},
}
_OTHER_CONTENT = {
    "/dashboard": {"text/html": {"schema": {"type": "string"}}},
    "/dashboard/events": {"text/event-stream": {
        "schema": _DASHBOARD_EVENT, "description": "endless: an event every "
        "dashboard_interval seconds until the client leaves or the server shuts down"}},
    "/metrics": {"text/plain": {"schema": {"type": "string"}}},
    **_BATCH_CONTENT,
}
"""Routes whose answer is not JSON."""


def token_id_pattern(vocab_size: int) -> str:
    """A regex matching exactly the decimal numbers 0 .. vocab_size - 1, without leading
    zeros (the keys logit_bias accepts)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    top = str(vocab_size - 1)
    alternatives = ["0"] if top != "0" else []
    if len(top) >= 2:  # every number with fewer digits than the largest
        alternatives.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")
    for i, digit in enumerate(top):  # same length, first smaller digit at position i
        low, high = (1 if i == 0 else 0), int(digit) - 1
        if high >= low:
            rest = len(top) - i - 1
            alternatives.append(top[:i] + f"[{low}-{high}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(top)
    return "^(?:" + "|".join(dict.fromkeys(alternatives)) + ")$"


def _set_limits(schemas: dict, limits: EngineLimits) -> None:
    """Write the model's bounds into the request schemas (server/validation.py applies the
    same EngineLimits)."""
    longest = limits.max_request_tokens - 1  # at least one prompt token
    top_id = limits.vocab_size - 1
    joint = (f"prompt tokens + max_tokens must not exceed {limits.max_request_tokens} "
             f"(the context of {limits.max_model_len} tokens, or the whole KV cache of "
             f"{limits.num_kv_tokens} tokens if smaller); min_tokens <= max_tokens; "
             "0 only with echo or prompt_logprobs (scoring a prompt)")

    def bound_ints(schema: dict, maximum: int) -> None:
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") == "integer":
                branch["maximum"] = min(branch.get("maximum", maximum), maximum)

    def bound_token_lists(schema: dict) -> None:
        for branch in schema.get("anyOf", [schema]):
            if branch.get("type") != "array":
                continue
            items = branch.get("items", {})
            if items.get("type") == "integer":
                items["maximum"] = top_id
                branch["maxItems"] = min(branch.get("maxItems", longest), longest)
            elif items.get("type") == "array":
                bound_token_lists(items)

    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        props = schemas.get(name, {}).get("properties", {})
        for branch in props.get("allowed_token_ids", {}).get("anyOf", []):
            if branch.get("type") == "array":
                branch.setdefault("items", {})["maximum"] = top_id
        if "truncate_prompt_tokens" in props:
            bound_ints(props["truncate_prompt_tokens"], limits.max_model_len)
    responses_n = schemas.get("ResponsesRequest", {}).get("properties", {}).get("n")
    if responses_n is not None:  # the Responses API returns one output
        bound_ints(responses_n, 1)
    messages = schemas.get("MessagesRequest", {}).get("properties", {})
    if "max_tokens" in messages:
        bound_ints(messages["max_tokens"], longest)
        messages["max_tokens"]["description"] = joint.split(";")[0]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas.get(name, {}).get("properties", {})
        for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
            if field in props:
                bound_ints(props[field], longest)
        if "max_tokens" in props:
            props["max_tokens"]["description"] = joint
        if "prompt" in props:
            bound_token_lists(props["prompt"])
        bias = props.get("logit_bias")
        for branch in (bias or {}).get("anyOf", []):
            if branch.get("type") == "object":
                value = next(iter(branch.pop("patternProperties", {}).values()),
                             {"type": "number"})
                branch["propertyNames"] = {"pattern": token_id_pattern(limits.vocab_size)}
                branch["additionalProperties"] = value
    tokens = schemas.get("DetokenizeRequest", {}).get("properties", {}).get("tokens")
    if tokens is not None:
        tokens.setdefault("items", {})["maximum"] = top_id


_REQUEST_SCHEMAS = {"CompletionRequest": "completions", "ChatCompletionRequest": "chat",
                    "ResponsesRequest": "responses"}
_CLOSED_SCHEMAS = ("LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest", "TokenizeRequest",
                   "DetokenizeRequest")
"""Bodies refused on an unknown key (pydantic extra="forbid", or server/fields.py's check
for an endpoint that ignores nothing)."""


def _close_request_schemas(schemas: dict) -> None:
    """The bodies keep unknown keys only so that server/fields.py can refuse them: the
    schema lists the accepted-and-ignored fields and the refused ones (with the values
    that ask for nothing) and closes every other key; a chat message's unknown keys pass
    only as null."""
    for name, endpoint in _REQUEST_SCHEMAS.items():
        schema = schemas.get(name)
        if schema is None:
            continue
        props = schema.setdefault("properties", {})
        for field, why in ACCEPTED_IGNORED[endpoint].items():
            props.setdefault(field, {"description": f"accepted and ignored: {why}"})
        for field, why in UNSUPPORTED.items():
            neutral = [{"const": value} for value in NEUTRAL_VALUES.get(field, ())]
            props.setdefault(field, {"anyOf": [{"type": "null"}, *neutral],
                                     "description": f"refused unless neutral: {why}"})
        schema["additionalProperties"] = False
    message = schemas.get("ChatMessage")
    if message is not None:
        message.setdefault("properties", {}).setdefault(
            "refusal", {"anyOf": [{"type": "string"}, {"type": "null"}]})
        message["additionalProperties"] = {"type": "null"}
    for name in _CLOSED_SCHEMAS:
        if name in schemas:
            schemas[name]["additionalProperties"] = False
    if "StreamOptions" in schemas:
        schemas["StreamOptions"]["additionalProperties"] = False
    for name in ("MessagesRequest", "CountTokensRequest"):
        schema = schemas.get(name)
        if schema is None:
            continue
        props = schema.setdefault("properties", {})
        for field, why in anthropic_protocol.ACCEPTED_IGNORED.items():
            props.setdefault(field, {"description": f"accepted and ignored: {why}"})
        for field, why in anthropic_protocol.REFUSED.items():
            props.setdefault(field, {"type": "null", "description": f"refused: {why}"})
        schema["additionalProperties"] = False


def _document_responses(paths: dict, auth: bool) -> None:
    for path, methods in paths.items():
        for method, operation in methods.items():
            body = operation.get("requestBody", {}).get("content", {})
            if "multipart/form-data" in body:  # a form with a file (FastAPI says urlencoded too)
                body.pop("application/x-www-form-urlencoded", None)
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)  # validation errors are 400s here
            codes = list(_ROUTE_ERRORS.get((path, method), ()))
            anthropic = is_anthropic_path(path)
            if auth and path not in OPEN_PATHS:
                codes.append(401)
                operation["security"] = [{"bearer": []}, {"apiKey": []}]
                if path == DASHBOARD_PREFIX or path.startswith(DASHBOARD_PREFIX + "/"):
                    operation["security"].append({"basic": []})  # the key as the password
            for code in sorted(codes):
                error = "AnthropicError" if anthropic else "Error"
                entry = {"description": _DESCRIPTIONS[code],
                         "content": {"application/json": {
                             "schema": {"$ref": f"#/components/schemas/{error}"}}}}
                if code == 429 or (code == 503 and path in _STREAMING):
                    entry["headers"] = {"Retry-After": {
                        "description": "Seconds after which a retry may pass",
                        "schema": {"type": "integer", "minimum": 1}}}
                responses[str(code)] = entry
            ok = responses.setdefault("200", {"description": "OK"})
            if path in _STREAMING:
                ok["content"] = {
                    "application/json": {"schema": {"type": "object"}},
                    "text/event-stream": {"schema": _ANTHROPIC_SSE_EVENT if anthropic
                                          else _SSE_EVENT,
                                          "description": "with stream: true"}}
            elif path in _OTHER_CONTENT:
                ok["content"] = _OTHER_CONTENT[path]


def install_openapi(app: FastAPI, limits: EngineLimits, auth: bool) -> None:
    """Replace the app's schema generator with the truthful one (built once, cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version,
                             description=app.description, routes=app.routes)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        schemas["Error"] = _ERROR_SCHEMA
        schemas["AnthropicError"] = _ANTHROPIC_ERROR_SCHEMA
        _set_limits(schemas, limits)
        _close_request_schemas(schemas)
        if auth:
            components["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
                "basic": {"type": "http", "scheme": "basic"}}
        _document_responses(schema.get("paths", {}), auth)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi

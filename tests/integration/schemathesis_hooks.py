"""Schemathesis hooks for treadle's API: the one rule its JSON Schema cannot state.

Every bound of a single field is in /openapi.json (server/openapi.py), so a schema-valid
request is accepted. Some rules join fields, and JSON Schema has no arithmetic: prompt
tokens + max_tokens <= the request limit (the context, or the KV cache if smaller; the
schema's description of max_tokens says so), min_tokens <= max_tokens, max_tokens 0
only with echo or prompt_logprobs (scoring a prompt), and XTC only with temperature > 0.
This hook drops generated cases that break them, counting a text prompt's tokens with
the server's own /tokenize (a Messages body's with /v1/messages/count_tokens), so that
`positive_data_acceptance` tests everything else.

    SCHEMATHESIS_HOOKS=schemathesis_hooks PYTHONPATH=tests/integration \\
        schemathesis run http://127.0.0.1:8000/openapi.json --checks all

With API keys configured, set TREADLE_API_KEY for the hook's own /tokenize calls.
"""

from __future__ import annotations

import os

import httpx
import schemathesis

_GENERATION = {"/v1/completions": False, "/v1/chat/completions": True, "/v1/responses": None}
_COMPILED = ("structured_outputs", "response_format", "tools", "tool_choice", "text")
"""Fields whose contents a compiler judges (a JSON schema, a grammar, a regex, tool
definitions), not the OpenAPI schema: random values of them are left to the tests that
send real ones (test_openai_api.py, test_structured_*.py)."""
_limits: dict[str, int] = {}


def _headers() -> dict:
    key = os.environ.get("TREADLE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _request_limit(base: str) -> int:
    """prompt + max_tokens the server allows: its schema's max_tokens maximum + 1."""
    if base not in _limits:
        schema = httpx.get(base + "/openapi.json", headers=_headers(), timeout=30).json()
        field = schema["components"]["schemas"]["CompletionRequest"]["properties"]["max_tokens"]
        _limits[base] = next(b["maximum"] for b in field["anyOf"] if "maximum" in b) + 1
    return _limits[base]


def _tokenize(base: str, query: dict) -> int | None:
    try:
        response = httpx.post(base + "/tokenize", json=query, headers=_headers(), timeout=30)
    except (httpx.HTTPError, TypeError, ValueError):
        return None
    return response.json()["count"] if response.status_code == 200 else None


def _text_bytes(value) -> int | None:
    """UTF-8 bytes of a text or of a message's content (text parts); None if not text."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        texts = [p.get("text") for p in value]
        if all(isinstance(t, str) for t in texts):
            return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return None


def _prompt_bound(base: str, body: dict, chat: bool) -> int | None:
    """An upper bound of the prompt's tokens without tokenizing it: a byte-level BPE token
    holds at least one byte, merges never add tokens, and the chat template's own tokens
    are measured once per sequence of roles (with empty contents)."""
    if not chat:
        size = _text_bytes(body.get("prompt"))  # the prompt text, unwrapped by the caller
        return None if size is None else size + 2  # + bos / eos
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None
    sizes = [_text_bytes(m.get("content")) for m in messages]
    roles = tuple(m.get("role") for m in messages)
    if None in sizes or not all(isinstance(r, str) for r in roles):
        return None
    if roles not in _overheads:
        _overheads[roles] = _tokenize(base, {"messages": [
            {"role": r, "content": ""} for r in roles]})
    overhead = _overheads[roles]
    return None if overhead is None else overhead + sum(sizes)


_overheads: dict[tuple, int | None] = {}


def _prompt_tokens(base: str, body: dict, chat: bool, limit: int, max_tokens: int) -> int | None:
    """The prompt's token count as the server counts it (or a bound that already fits);
    None if it cannot tell (the body is invalid anyway, and the server's answer to it is
    what is being tested)."""
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, (list, str))
                                                       for p in prompt):
            counts = [_prompt_tokens(base, {"prompt": p}, False, limit, max_tokens)
                      for p in prompt]  # a batch: its longest prompt decides
            return None if None in counts else max(counts)
        if isinstance(prompt, list):
            return len(prompt)
        if prompt == "":
            return 0
        body = {"prompt": prompt}
    bound = _prompt_bound(base, body, chat)
    if bound is not None and bound + max_tokens <= limit:
        return bound
    query = {"messages": body.get("messages")} if chat else {"prompt": prompt}
    return _tokenize(base, query)


def _integer(value) -> int | None:
    """A JSON Schema integer (2.0 is one) as an int; None for anything else."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_MESSAGES = ("/v1/messages", "/v1/messages/count_tokens")


@schemathesis.hook
def filter_case(context, case) -> bool:
    """Every phase's cases pass here (filter_body would see only the fuzzing phase's)."""
    operation, body = case.operation, case.body
    if operation is not None and operation.path in _MESSAGES and isinstance(body, dict):
        return _messages_fit(operation, body)
    if (operation is None or operation.method.lower() != "post"
            or operation.path not in _GENERATION or not isinstance(body, dict)):
        return True
    if any(body.get(name) is not None for name in _COMPILED):
        return False
    if _xtc_with_greedy(body):
        return False
    chat = _GENERATION[operation.path]
    if chat is None:
        body = _responses_as_chat(body)
        if body is None:
            return False
        chat = True
    return _decide(operation, body, chat)


def _served_model(base: str) -> str:
    if base not in _models:
        models = httpx.get(base + "/v1/models", headers=_headers(), timeout=30).json()
        _models[base] = models["data"][0]["id"]
    return _models[base]


_models: dict[str, str] = {}


def _xtc_with_greedy(body: dict) -> bool:
    """XTC asked of a greedy request (a 400: XTC would remove the one token greedy takes)."""
    xtc, temperature = body.get("xtc_probability"), body.get("temperature", 1.0)
    return (isinstance(xtc, (int, float)) and not isinstance(xtc, bool) and xtc > 0
            and isinstance(temperature, (int, float)) and temperature < 1e-5)


def _messages_fit(operation, body: dict) -> bool:
    """Anthropic's Messages bodies: tools and tool_choice are judged together (a tool
    choice names one of the tools; 'auto' needs the server's tool parser), as chat's are
    left to the tests that send real ones (test_anthropic_api.py); prompt tokens +
    max_tokens within the limit, counted by the server's own count_tokens. Their
    `model` is required: a generated name becomes the served model's, or every case would
    end at the 404 of an unknown model."""
    if body.get("tools") is not None or body.get("tool_choice") is not None:
        return False
    base = operation.schema.get_base_url().rstrip("/")
    model = body.get("model")
    if isinstance(model, str) and 1 <= len(model) <= 512:  # a name, as the schema wants:
        body["model"] = _served_model(base)  # the served one, so that cases get past 404
    if operation.path.endswith("count_tokens"):
        return True
    max_tokens = _integer(body.get("max_tokens"))
    if max_tokens is None:
        return True
    query = {k: body[k] for k in ("model", "messages", "system") if k in body}
    try:
        response = httpx.post(base + "/v1/messages/count_tokens", json=query,
                              headers=_headers(), timeout=30)
    except (httpx.HTTPError, TypeError, ValueError):
        return True
    if response.status_code != 200:  # too long to count (more bytes than the context
        # could hold as tokens) breaks the joint rule; otherwise the body is invalid anyway
        # and the server's answer to it is tested
        return "context length" not in response.text
    return response.json()["input_tokens"] + max_tokens <= _request_limit(base)


def _responses_as_chat(body: dict) -> dict | None:
    """A Responses body with a text input as the chat body the server makes of it (so
    that its tokens are counted the same way); None for item lists, whose contents the
    server judges item by item (test_openai_api.py sends real ones)."""
    text = body.get("input")
    if not isinstance(text, str) or body.get("previous_response_id") is not None:
        return None
    instructions = body.get("instructions")
    messages = ([{"role": "system", "content": instructions}]
                if isinstance(instructions, str) and instructions else [])
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions",
                                                        "max_output_tokens")}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return {**chat, "messages": messages + [{"role": "user", "content": text}]}


def _decide(operation, body, chat):
    base = operation.schema.get_base_url().rstrip("/")
    limit = _request_limit(base)
    requested = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        requested = body["max_completion_tokens"]
    scoring = body.get("prompt_logprobs") is not None or (not chat and body.get("echo") is True)
    if _integer(requested) == 0 and not scoring:  # max_tokens 0 only scores a prompt
        return False
    if requested is None:  # the server's default fits the prompt; only min_tokens may not
        num_prompt = _prompt_tokens(base, body, chat, limit, 1)
        if num_prompt is None:
            return True
        fits = max(1, limit - num_prompt)
        max_tokens = fits if chat else min(16, fits)
    else:
        max_tokens = _integer(requested)
        if max_tokens is None:
            return True
        num_prompt = _prompt_tokens(base, body, chat, limit, max_tokens)
        if num_prompt is None:
            return True
    min_tokens = _integer(body.get("min_tokens", 0))
    if min_tokens is not None and min_tokens > max_tokens:
        return False
    return num_prompt >= 1 and num_prompt + max_tokens <= limit

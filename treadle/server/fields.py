"""Request fields that are accepted and ignored, or refused, and the check of both.

The rule: nothing is silently ignored. A field that cannot change what the server
returns (a client tag, a billing tier, a storage hint for another service) is accepted
and ignored, and listed here and in the README. A field that would change the output
and is not supported is a 400 naming it (and saying what to use instead, where there is
something). Any other field the endpoint does not know is a 400 too: a typo or a newer
API feature must not pass for a served request. Request bodies keep unknown keys
(pydantic extra="allow") so that this check sees them; it runs in each route.
"""

from __future__ import annotations

from typing import Any

ACCEPTED_IGNORED: dict[str, dict[str, str]] = {
    "completions": {
        "user": "an end-user tag for abuse monitoring",
        "metadata": "tags for the caller's own bookkeeping",
        "service_tier": "a billing tier; there is one tier",
        "safety_identifier": "an end-user tag for abuse monitoring",
        "prompt_cache_key": "a routing hint; the prefix cache needs none",
    },
    "chat": {
        "user": "an end-user tag for abuse monitoring",
        "metadata": "tags for the caller's own bookkeeping",
        "service_tier": "a billing tier; there is one tier",
        "store": "keeps a copy for OpenAI's distillation tools; nothing is stored",
        "safety_identifier": "an end-user tag for abuse monitoring",
        "prompt_cache_key": "a routing hint; the prefix cache needs none",
        "prompt_cache_retention": "a cache lifetime hint; the prefix cache evicts by LRU",
        "prediction": "predicted output, a latency optimization; the output is the same",
    },
    "tokenize": {},
    "detokenize": {},
    "responses": {
        "user": "an end-user tag for abuse monitoring",
        "metadata": "tags kept with the stored response",
        "service_tier": "a billing tier; there is one tier",
        "safety_identifier": "an end-user tag for abuse monitoring",
        "prompt_cache_key": "a routing hint; the prefix cache needs none",
        "truncation": "only 'disabled' (the default): a too-long input is a 400",
    },
}
"""Per endpoint: accepted-but-ignored field -> why ignoring it changes nothing."""

UNSUPPORTED: dict[str, str] = {
    "audio": "audio output is not supported",
    "modalities": "only ['text'] is supported",
    "web_search_options": "web search is not supported",
    "functions": "deprecated; use tools",
    "function_call": "deprecated; use tool_choice",
    "reasoning_effort": "this server runs no reasoning models",
    "reasoning": "this server runs no reasoning models",
    "verbosity": "not supported",
    "best_of": "only best_of equal to n (or 1) is supported",
    "suffix": "insertion (suffix) is not supported",
    "guided_json": "use structured_outputs.json or response_format",
    "guided_regex": "use structured_outputs.regex",
    "guided_choice": "use structured_outputs.choice",
    "guided_grammar": "use structured_outputs.grammar",
    "background": "background responses are not supported",
    "include": "extra output items are not supported",
    "conversation": "conversations are not supported; use previous_response_id",
    "prompt": "prompt templates are not supported",
}
"""Field -> why it is refused (a 400), when it is given a value that matters."""


NEUTRAL_VALUES: dict[str, list[Any]] = {
    "modalities": [["text"]], "best_of": [1], "suffix": [""], "include": [[]]}
"""Refused field -> the values besides null that ask for nothing (what clients send by
default); best_of equal to the request's n is neutral too."""


def _harmless(name: str, value: Any, body: Any) -> bool:
    """A refused field given its neutral value (what a client sends by default)."""
    if value is None or value in NEUTRAL_VALUES.get(name, ()):
        return True
    return name == "best_of" and value == getattr(body, "n", 1)


def check_fields(body: Any, endpoint: str) -> tuple[str, str] | None:
    """(field, message) for the first field of `body` (a pydantic request model with
    extra="allow") that must be refused, or None."""
    extras = dict(getattr(body, "model_extra", None) or {})
    ignored = ACCEPTED_IGNORED[endpoint]
    for name, value in extras.items():
        if name in ignored:
            continue
        if name in UNSUPPORTED:
            if _harmless(name, value, body):
                continue
            return name, f"{name}: {UNSUPPORTED[name]}"
        if not ignored:
            return name, f"{name}: unknown field for this endpoint"
        return name, (f"{name}: unknown field for this endpoint (fields that are accepted "
                      f"and ignored: {', '.join(sorted(ignored))})")
    options = getattr(body, "stream_options", None)
    for name in (getattr(options, "model_extra", None) or {}):
        return f"stream_options.{name}", f"stream_options.{name}: not supported"
    return None


def check_message_fields(messages: list, allowed: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """The same for each chat message: unknown keys are refused."""
    for i, message in enumerate(messages):
        for name, value in (getattr(message, "model_extra", None) or {}).items():
            if name in allowed or value is None:
                continue
            if name == "refusal" and isinstance(value, str):
                continue  # an assistant's refusal text, echoed back by clients
            return (f"messages[{i}].{name}",
                    f"messages[{i}].{name}: not supported in a chat message")
    return None

"""Request bodies of Anthropic's Messages API (pydantic), with Anthropic's bounds.

Owns the wire format of `POST /v1/messages` and `POST /v1/messages/count_tokens`: the
top-level fields as Anthropic defines them (`max_tokens` required, `temperature` in
[0, 1], `stop_sequences`, `system` as text or text blocks, `tools`, `tool_choice`,
`metadata`, `thinking`, `service_tier`), each bounded like the OpenAI bodies
(server/protocol.py: strict types, no lone surrogates). Content blocks stay plain JSON
objects here: server/anthropic/convert.py reads each by its `type`, so that a block
treadle cannot serve (an image, a document, a server tool's result) is refused by name.
Which fields are accepted and ignored, and which are refused: `check_fields`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, WithJsonSchema

from treadle.server.protocol import (MAX_MESSAGES, MAX_STOP_STRINGS, MAX_TOOLS, OpenAIModel,
                                     StopString)

MAX_BLOCKS = 1024
"""Most content blocks in one message (or in `system`)."""

# What convert.py accepts, as JSON Schema: the blocks are read there (to refuse the ones
# treadle cannot serve by name), so their schema is stated here by hand. Unknown keys
# pass only as null, as convert.py lets them.
_NULL_EXTRA = {"type": "null"}
_ID = {"type": "string", "minLength": 1, "maxLength": 256}
_NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
              "additionalProperties": _NULL_EXTRA,
              "properties": {"type": {"const": "text"}, "text": {"type": "string"},
                             "cache_control": {},
                             "citations": {"anyOf": [{"type": "null"},
                                                     {"type": "array", "maxItems": 0}]}}}
TOOL_USE_BLOCK = {"type": "object", "required": ["type", "id", "name", "input"],
                  "additionalProperties": _NULL_EXTRA,
                  "properties": {"type": {"const": "tool_use"}, "id": _ID, "name": _NAME,
                                 "input": {"type": "object"}, "cache_control": {}}}
TOOL_RESULT_BLOCK = {
    "type": "object", "required": ["type", "tool_use_id"], "additionalProperties": _NULL_EXTRA,
    "properties": {"type": {"const": "tool_result"}, "tool_use_id": _ID,
                   "content": {"anyOf": [{"type": "string"}, {
                       "type": "array", "maxItems": MAX_BLOCKS, "items": TEXT_BLOCK}]},
                   "is_error": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
                   "cache_control": {}}}


def _blocks_of(*blocks: dict) -> dict:
    return {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": MAX_BLOCKS,
                                           "items": {"anyOf": list(blocks)}}]}


MESSAGE = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "additionalProperties": _NULL_EXTRA,
     "properties": {"role": {"const": role}, "content": _blocks_of(TEXT_BLOCK, block)}}
    for role, block in (("user", TOOL_RESULT_BLOCK), ("assistant", TOOL_USE_BLOCK))]}
TOOL = {"type": "object", "required": ["name", "input_schema"],
        "additionalProperties": _NULL_EXTRA,
        "properties": {"type": {"anyOf": [{"const": "custom"}, {"type": "null"}]},
                       "name": _NAME, "description": {"type": ["string", "null"]},
                       "input_schema": {"type": "object"}, "cache_control": {}}}
TOOL_CHOICE = {"type": "object", "required": ["type"], "additionalProperties": _NULL_EXTRA,
               "properties": {"type": {"enum": ["auto", "any", "tool", "none"]},
                              "name": {"type": ["string", "null"]},
                              "disable_parallel_tool_use": {"type": ["boolean", "null"]}}}
THINKING = {"type": "object", "required": ["type"],
            "properties": {"type": {"const": "disabled"}}}

Blocks = Annotated[list[dict[str, Any]], Field(max_length=MAX_BLOCKS)]


class MessageParam(OpenAIModel):
    role: Literal["user", "assistant"]
    content: Union[str, Blocks]


class CountTokensRequest(OpenAIModel):
    """`POST /v1/messages/count_tokens`: what a Messages request would put in the prompt."""

    model: str = Field(min_length=1, max_length=512)
    messages: list[Annotated[MessageParam, WithJsonSchema(MESSAGE)]] = Field(
        min_length=1, max_length=MAX_MESSAGES)
    system: Annotated[Optional[Union[str, Blocks]], WithJsonSchema(
        {"anyOf": [{"type": "null"}, *_blocks_of(TEXT_BLOCK)["anyOf"]]})] = None
    tools: Annotated[Optional[list[dict[str, Any]]], WithJsonSchema(
        {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": MAX_TOOLS,
                                      "items": TOOL}]})] = Field(default=None,
                                                                max_length=MAX_TOOLS)
    tool_choice: Annotated[Optional[dict[str, Any]], WithJsonSchema(
        {"anyOf": [{"type": "null"}, TOOL_CHOICE]})] = None
    thinking: Annotated[Optional[dict[str, Any]], WithJsonSchema(
        {"anyOf": [{"type": "null"}, THINKING]})] = None


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1, le=1_000_000)
    stop_sequences: Optional[list[StopString]] = Field(default=None,
                                                       max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0, le=1_000_000)
    metadata: Optional[dict[str, Any]] = Field(
        default=None, description="{'user_id': ...}: accepted and ignored")
    service_tier: Optional[str] = Field(
        default=None, max_length=64, description="accepted and ignored: there is one tier")


ACCEPTED_IGNORED: dict[str, str] = {
    "cache_control": "a prompt-caching hint; the prefix cache needs none",
    "inference_geo": "where to run; this server runs where it is",
    "speed": "an inference speed mode; the output is the same",
    "user_profile_id": "whom a request is made for: bookkeeping",
    "workspace_id": "an Anthropic workspace: bookkeeping",
}
"""Anthropic fields that cannot change the answer: accepted and ignored (besides
`metadata` and `service_tier`, declared above)."""

REFUSED: dict[str, str] = {
    "container": "code execution containers are not supported",
    "mcp_servers": "MCP servers are not supported",
    "context_management": "context management is not supported",
    "output_format": "structured outputs are not supported on this endpoint; use "
                     "/v1/chat/completions with response_format",
    "output_config": "output configuration is not supported",
    "diagnostics": "prompt-cache diagnostics are not supported",
}
"""Anthropic fields treadle refuses when given a value."""


def check_fields(body: OpenAIModel) -> tuple[str, str] | None:
    """(field, message) for the first field of the body that must be refused: an unknown
    field, one of REFUSED, or extended thinking (this server runs no reasoning models);
    ACCEPTED_IGNORED pass."""
    for name, value in (body.model_extra or {}).items():
        if name in ACCEPTED_IGNORED:
            continue
        if name in REFUSED:
            if value is None:
                continue
            return name, f"{name}: {REFUSED[name]}"
        return name, f"{name}: not a Messages API field this server supports"
    thinking = getattr(body, "thinking", None)
    if thinking is not None and thinking.get("type") != "disabled":
        return "thinking", ("thinking: extended thinking is not supported (this server runs "
                            "no reasoning models); send {'type': 'disabled'} or leave it out")
    return None

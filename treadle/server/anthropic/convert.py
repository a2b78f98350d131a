"""An Anthropic Messages request as the chat request treadle serves.

Owns the translation, with a 400 naming the Anthropic field for whatever cannot be
served: `system` (text or text blocks) -> a system message; each message's content
blocks -> chat messages (text blocks joined; an assistant's `tool_use` blocks -> its
tool calls, with their ids; a user's `tool_result` blocks -> `tool` messages answering
those ids, before the user's text; an `is_error` result's text starts with "Error: ");
a last message from the assistant is a prefill the model continues; `tools` (name,
description, input_schema) -> function tools; `tool_choice` auto / any / tool / none
-> 'auto' / 'required' / a named function / 'none' (server/tool_calls.py: the same
grammars and parsers as chat); `disable_parallel_tool_use` -> parallel_tool_calls
false; `stop_sequences`, `temperature`, `top_p`, `top_k`, `max_tokens` -> the chat
body's sampling fields. Blocks treadle cannot serve (images, documents, thinking, server
tools' blocks) are refused by their type. No I/O, no engine.
"""

from __future__ import annotations

import re
from typing import Any

from treadle.server import protocol
from treadle.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from treadle.server.errors import APIError

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_TEXT_KEYS = {"type", "text", "cache_control", "citations"}
_TOOL_USE_KEYS = {"type", "id", "name", "input", "cache_control"}
_TOOL_RESULT_KEYS = {"type", "tool_use_id", "content", "is_error", "cache_control"}
_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control"}
_MEDIA = {"image", "document", "search_result", "container_upload"}


def _refuse(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", field)


def _unknown_keys(block: dict, allowed: set[str], where: str) -> None:
    extra = next((k for k in block if k not in allowed and block[k] is not None), None)
    if extra is not None:
        raise _refuse(f"{where}.{extra}", "not supported here")


def _text(block: dict, where: str) -> str:
    _unknown_keys(block, _TEXT_KEYS, where)
    if block.get("citations") not in (None, []):
        raise _refuse(f"{where}.citations", "citations are not supported")
    text = block.get("text")
    if not isinstance(text, str):
        raise _refuse(f"{where}.text", "a text block needs its text (a string)")
    return text


def _block_type(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _refuse(f"{where}.type", "each content block is an object with a type")
    kind = block["type"]
    if kind in allowed:
        return kind
    if kind in _MEDIA:
        raise _refuse(f"{where}.type", f"'{kind}' blocks are not supported: the served model "
                      "reads text only")
    if kind in ("tool_use", "tool_result"):
        raise _refuse(f"{where}.type", f"'{kind}' blocks belong in "
                      f"{'assistant' if kind == 'tool_use' else 'user'} messages")
    raise _refuse(f"{where}.type", f"'{kind}' blocks are not supported (text, tool_use and "
                  "tool_result are)")


def system_text(system: str | list | None) -> str | None:
    """`system` as one text (text blocks joined)."""
    if system is None or isinstance(system, str):
        return system
    return "".join(_text(b, f"system.{i}") for i, b in enumerate(system)
                   if _block_type(b, f"system.{i}", ("text",)))


def _tool_result_text(block: dict, where: str) -> str:
    _unknown_keys(block, _TOOL_RESULT_KEYS, where)
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text(b, f"{where}.content.{k}") for k, b in enumerate(content)
                          if _block_type(b, f"{where}.content.{k}", ("text",)))
    elif not isinstance(content, str):
        raise _refuse(f"{where}.content", "a string or a list of text blocks")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise _refuse(f"{where}.is_error", "must be a boolean")
    return f"Error: {content}" if is_error else content


def _tool_use(block: dict, where: str) -> dict:
    _unknown_keys(block, _TOOL_USE_KEYS, where)
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not 1 <= len(call_id) <= 256:
        raise _refuse(f"{where}.id", "a tool_use block needs an id of 1 to 256 characters")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _refuse(f"{where}.name", "must be 1 to 64 letters, digits, '_' or '-'")
    if not isinstance(args, dict):
        raise _refuse(f"{where}.input", "must be an object")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _message(message, i: int) -> list[dict]:
    """One Anthropic message as chat messages (a user's tool results first)."""
    extra = next((k for k, v in (message.model_extra or {}).items() if v is not None), None)
    if extra is not None:
        raise _refuse(f"messages.{i}.{extra}", "not supported in a message")
    where = f"messages.{i}.content"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, calls, results = [], [], []
    allowed = ("text", "tool_use") if message.role == "assistant" else ("text", "tool_result")
    for k, block in enumerate(message.content):
        kind = _block_type(block, f"{where}.{k}", allowed)
        if kind == "text":
            texts.append(_text(block, f"{where}.{k}"))
        elif kind == "tool_use":
            calls.append(_tool_use(block, f"{where}.{k}"))
        else:
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not 1 <= len(call_id) <= 256:
                raise _refuse(f"{where}.{k}.tool_use_id", "a tool_result block needs the id "
                              "of the tool_use it answers")
            results.append({"role": "tool", "tool_call_id": call_id,
                            "content": _tool_result_text(block, f"{where}.{k}")})
    out = results
    if texts or calls or not results:
        chat: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
        if calls:
            chat["tool_calls"] = calls
        out = out + [chat]
    return out


def chat_messages(body: CountTokensRequest) -> list[protocol.ChatMessage]:
    """The conversation as chat messages (server/protocol.py ChatMessage)."""
    messages = []
    system = system_text(body.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        messages += _message(message, i)
    return [protocol.ChatMessage.model_validate(m) for m in messages]


def continues_assistant(body: CountTokensRequest) -> bool:
    """Whether the last message is the assistant's: a prefill the model continues."""
    return body.messages[-1].role == "assistant"


def chat_tools(body: CountTokensRequest) -> list[dict] | None:
    """`tools` as chat's function tools."""
    if not body.tools:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise _refuse(where, "each tool is an object")
        if tool.get("type") not in (None, "custom"):
            raise _refuse(f"{where}.type", f"{tool.get('type')!r}: only custom (client) "
                          "tools are supported, not Anthropic's server tools")
        _unknown_keys(tool, _TOOL_KEYS, where)
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _refuse(f"{where}.name", "must be 1 to 64 letters, digits, '_' or '-'")
        if not isinstance(schema, dict):
            raise _refuse(f"{where}.input_schema", "a JSON schema (an object) is required")
        function = {"name": name, "parameters": schema}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise _refuse(f"{where}.description", "must be a string")
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def chat_tool_choice(body: CountTokensRequest) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    choice = body.tool_choice
    if choice is None:
        return None, None
    kind = choice.get("type")
    _unknown_keys(choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise _refuse("tool_choice.disable_parallel_tool_use", "must be a boolean")
    parallel = None if disable is None else not disable
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel
    if kind == "tool":
        names = [t.get("name") for t in body.tools or [] if isinstance(t, dict)]
        if choice.get("name") not in names:
            raise _refuse("tool_choice.name", f"{choice.get('name')!r} is not one of the tools")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _refuse("tool_choice.type", "must be 'auto', 'any', 'tool' or 'none'")


def to_chat(body: MessagesRequest, messages: list[protocol.ChatMessage]
            ) -> protocol.ChatCompletionRequest:
    """The chat body the serving object runs, with the `messages` of chat_messages
    (within Anthropic's bounds already, so it is constructed without a second
    validation)."""
    choice, parallel = chat_tool_choice(body)
    return protocol.ChatCompletionRequest.model_construct(
        model=body.model, messages=messages, max_tokens=body.max_tokens,
        temperature=body.temperature, top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0, stop=list(body.stop_sequences or []) or None,
        stream=body.stream, tools=chat_tools(body), tool_choice=choice,
        parallel_tool_calls=parallel)

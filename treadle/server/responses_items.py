"""The Responses API's items, translated to and from the chat path.

Owns the conversions: `input` (text, or message / function_call / function_call_output
items) to chat messages, the flat Responses function tools and tool_choice to the chat
forms, a finished generation to output items (a message and/or function calls, parsed
by server/tool_calls.py), output items back to one assistant message (the stored turn a
`previous_response_id` continues), and usage in the Responses shape. Pure data: no HTTP,
no engine.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Union

from treadle.server.tool_calls import ToolRequestError, parse_choice

MAX_INPUT_ITEMS = 1024


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content, field: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{field}: must be text or a list of parts")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str):
            raise ValueError(f"{field}[{k}]: only input_text and output_text parts are "
                             f"supported, got {kind!r}")
        parts.append(part["text"])
    return "".join(parts)


def _function_call(item: dict) -> dict:
    return {"id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}


def input_messages(items: Union[str, list[dict]]) -> list[dict]:
    """Responses input -> chat messages (dicts of protocol.ChatMessage fields)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if len(items) > MAX_INPUT_ITEMS:
        raise ValueError(f"input: at most {MAX_INPUT_ITEMS} items")
    messages: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"input[{i}]: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ValueError(f"input[{i}].role: must be user, system, developer or "
                                 f"assistant, got {role!r}")
            messages.append({"role": role,
                             "content": _text_of(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = _function_call(item)
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get(
                    "tool_calls") is not None and not messages[-1]["content"]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise ValueError(f"input[{i}].type: {kind!r} items are not supported (message, "
                             "function_call, function_call_output)")
    return messages


def chat_tools(tools: list[dict] | None, tool_choice) -> tuple[list[dict] | None, Any]:
    """Responses' flat function tools and tool_choice -> the chat forms."""
    if tools is None:
        return None, tool_choice
    converted = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolRequestError(f"tools[{i}].type", "only 'function' tools are supported")
        converted.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
    return converted, tool_choice


def output_items(text: str, finish_reason: str | None, tools) -> list[dict]:
    """The output items of a finished generation: a message and/or function calls."""
    items: list[dict] = []
    content, calls = text, []
    if tools is not None and tools.choice != "none":
        content, calls, _ = parse_choice(tools.parser(), text, tools.parallel, finish_reason)
    if content:
        items.append(message_item(new_id("msg"), content, "completed"))
    for call in calls:
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
                      "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def usage(output) -> dict:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in output.outputs)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": getattr(output, "num_cached_tokens", 0)},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def as_message(items: list[dict]) -> dict:
    """A response's output items as one assistant chat message (for the next turn)."""
    text = "".join(part["text"] for item in items if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message

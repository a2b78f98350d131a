"""The Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}).

Owns the Responses wire format on top of the chat path: `input` as text or a list of
items (messages with input_text parts, function_call and function_call_output items),
`instructions`, function tools (the flat Responses form, translated for
server/tool_calls.py), `text.format` (json_schema / json_object, as a structured
output), `max_output_tokens`, usage in the Responses shape, the streamed events
(response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta, ... response.completed) and
the store behind `store` and `previous_response_id`: bounded, in memory, one LRU per
tenant, so a tenant can never read another's responses. Generation, auth, admission and
tokenization are api.py's (handed in as `ctx`).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, AsyncIterator, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from treadle.server import protocol
from treadle.server.errors import error_field
from treadle.server.fields import check_fields
from treadle.server.tool_calls import ToolCallStreamer, ToolRequestError, parse_choice, setup_tools

MAX_INPUT_ITEMS = 1024


class ResponsesRequest(protocol.SamplingFields):
    input: Union[str, Annotated[list[dict[str, Any]], Field(
        min_length=1, max_length=MAX_INPUT_ITEMS)]] = Field(description="text, or a list of items")
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1, le=1_000_000)
    tools: Optional[list[dict[str, Any]]] = Field(default=None, max_length=protocol.MAX_TOOLS)
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    store: bool = True
    previous_response_id: Optional[str] = Field(default=None, max_length=128)
    text: Optional[dict[str, Any]] = None


class ResponseStore:
    """Stored responses: per tenant, the most recent `capacity` (least recently used
    evicted first). Thread-safe; nothing leaves the process."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._tenants: dict[str, OrderedDict[str, dict]] = {}
        self._lock = threading.Lock()

    def put(self, tenant: str, response_id: str, record: dict) -> None:
        with self._lock:
            entries = self._tenants.setdefault(tenant, OrderedDict())
            entries[response_id] = record
            entries.move_to_end(response_id)
            while len(entries) > self.capacity:
                entries.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> dict | None:
        with self._lock:
            entries = self._tenants.get(tenant)
            if entries is None or response_id not in entries:
                return None
            entries.move_to_end(response_id)
            return entries[response_id]

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            entries = self._tenants.get(tenant)
            return entries is not None and entries.pop(response_id, None) is not None


def _ids(prefix: str) -> str:
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
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments", "{}")}}
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
        items.append(_message_item(_ids("msg"), content, "completed"))
    for call in calls:
        items.append({"type": "function_call", "id": _ids("fc"), "call_id": call["id"],
                      "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _usage(output) -> dict:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in output.outputs)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": getattr(output, "num_cached_tokens", 0)},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def responses_router(ctx) -> APIRouter:
    """The routes; `ctx` carries api.py's helpers (see build_app)."""
    router = APIRouter()
    store = ResponseStore(ctx.server_config.responses_store_size)
    APIError = ctx.APIError

    def response_body(response_id: str, body: ResponsesRequest, created: int, status: str,
                      output: list, usage: dict | None, incomplete: str | None) -> dict:
        return {"id": response_id, "object": "response", "created_at": created,
                "status": status, "model": body.model or ctx.engine.model_name, "output": output,
                "usage": usage, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "previous_response_id": body.previous_response_id,
                "temperature": body.temperature, "top_p": body.top_p,
                "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "store": body.store, "text": body.text or {"format": {"type": "text"}},
                "metadata": (body.model_extra or {}).get("metadata") or {}}

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        tenant = ctx.authenticate(request)
        lora = ctx.check_model(body, request)
        refused = check_fields(body, "responses")
        if refused is not None:
            raise APIError(400, refused[1], refused[0])
        if body.n != 1:
            raise APIError(400, "n: the Responses API returns one output", "n")
        history: list[dict] = []
        if body.previous_response_id is not None:
            previous = store.get(tenant, body.previous_response_id)
            if previous is None:
                raise APIError(404, f"previous_response_id: no stored response "
                               f"{body.previous_response_id!r}", "previous_response_id")
            history = previous["messages"]
        try:
            new_messages = input_messages(body.input)
            tools_chat, choice = chat_tools(body.tools, body.tool_choice)
            tools = setup_tools(tools_chat, choice, body.parallel_tool_calls,
                                ctx.server_config.tool_call_parser,
                                ctx.server_config.enable_auto_tool_choice)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), exc.field) from None
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            raise APIError(400, str(exc), field) from None
        conversation = history + new_messages
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        try:
            messages = [protocol.ChatMessage(**m) for m in system + conversation]
        except ValueError as exc:
            raise APIError(400, f"input: {exc}", "input") from None
        for key in (body.text or {}):
            if key != "format":
                raise APIError(400, f"text.{key}: not supported (only text.format)",
                               f"text.{key}")
        text_format = (body.text or {}).get("format")
        if text_format is not None and not isinstance(text_format, dict):
            raise APIError(400, "text.format: must be an object with a 'type'", "text.format")
        if text_format is not None and text_format.get("type") == "json_schema":
            body.response_format = {"type": "json_schema", "json_schema": text_format}
        elif text_format is not None:
            body.response_format = text_format
        prompt_ids = await ctx.run_in_threadpool(ctx.chat_token_ids, messages, True,
                                                 tools.template_tools)
        max_tokens = ctx.check_lengths(prompt_ids, body.max_output_tokens or body.max_tokens,
                                       None)
        spec = await ctx.structured_spec(body, tools.spec)
        params = ctx.sampling_params(body, max_tokens, None, None, spec,
                                     skip_special_tokens=False if tools.needs_special_tokens
                                     else None)
        ticket = ctx.admit(tenant, prompt_ids, params)
        response_id, created = _ids("resp"), int(time.time())
        outputs = ctx.run(request, response_id, None, prompt_ids, params, body.priority,
                          tenant, ticket, lora, ctx.scheduling_of(body, request))

        def finish(final, items: list | None = None) -> dict:
            """The final body (stored when asked); `items`: the streamed ones."""
            c = final.outputs[0]
            if items is None:
                items = output_items(c.text, c.finish_reason, tools)
            incomplete = "max_output_tokens" if c.finish_reason == "length" else None
            status = "incomplete" if incomplete else (
                "failed" if c.finish_reason in ("error", "abort") else "completed")
            result = response_body(response_id, body, created, status, items,
                                   _usage(final), incomplete)
            if final.error is not None:  # a failed response says why (e.g. slo_reject)
                result["error"] = {"code": error_field(final.error, "server_error"),
                                   "message": final.error}
            if body.store:
                store.put(tenant, response_id, {"body": result, "messages": conversation + [
                    _as_message(items)]})
            return result

        if body.stream:
            return _sse(_events(response_body(response_id, body, created, "in_progress", [],
                                              None, None), outputs, tools, finish))
        final = await ctx.final_output(request, outputs)
        if final is None:
            return ctx.Response(status_code=499)
        return finish(final)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        tenant = ctx.authenticate(request)
        record = store.get(tenant, response_id)
        if record is None:
            raise APIError(404, f"no stored response {response_id!r}", "response_id")
        return record["body"]

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        tenant = ctx.authenticate(request)
        if not store.delete(tenant, response_id):
            raise APIError(404, f"no stored response {response_id!r}", "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    return router


def _as_message(items: list[dict]) -> dict:
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


async def _events(initial: dict, outputs: AsyncIterator, tools, finish) -> AsyncIterator[dict]:
    """The Responses stream: created, in_progress, items and their deltas, completed."""
    yield {"type": "response.created", "response": initial}
    yield {"type": "response.in_progress", "response": initial}
    parse = tools is not None and tools.choice != "none"
    streamer = ToolCallStreamer(tools.parser(), tools.parallel) if parse else None
    message_id, message_index, text = None, None, ""
    calls: dict[int, dict] = {}  # tool-call index -> its item
    next_index = 0
    final = None
    async for output in outputs:
        final = output
        c = output.outputs[0]
        done = c.finish_reason is not None
        if streamer is None:
            delta, entries = c.text[len(text):], []
        else:
            delta, entries = streamer.feed(c.text, final=done)
        if delta:
            if message_id is None:
                message_id, message_index = _ids("msg"), next_index
                next_index += 1
                yield {"type": "response.output_item.added", "output_index": message_index,
                       "item": {**_message_item(message_id, "", "in_progress"), "content": []}}
                yield {"type": "response.content_part.added", "item_id": message_id,
                       "output_index": message_index, "content_index": 0,
                       "part": {"type": "output_text", "text": "", "annotations": []}}
            text += delta
            yield {"type": "response.output_text.delta", "item_id": message_id,
                   "output_index": message_index, "content_index": 0, "delta": delta}
        for entry in entries:
            if "id" in entry:
                item = {"type": "function_call", "id": _ids("fc"), "call_id": entry["id"],
                        "name": entry["function"]["name"], "arguments": "",
                        "status": "in_progress", "output_index": next_index}
                calls[entry["index"]] = item
                next_index += 1
                yield {"type": "response.output_item.added", "output_index": item["output_index"],
                       "item": {k: v for k, v in item.items() if k != "output_index"}}
            else:
                item = calls[entry["index"]]
                item["arguments"] += entry["function"]["arguments"]
                yield {"type": "response.function_call_arguments.delta", "item_id": item["id"],
                       "output_index": item["output_index"],
                       "delta": entry["function"]["arguments"]}
        if output.error is not None:
            yield {"type": "error", "message": output.error, "code": "server_error"}
    if final is None:
        return
    streamed = []  # the final items, with the ids the stream announced
    if message_id is not None:
        streamed.append((message_index, _message_item(message_id, text, "completed")))
    for item in calls.values():
        streamed.append((item["output_index"], {
            "type": "function_call", "id": item["id"], "call_id": item["call_id"],
            "name": item["name"], "arguments": item["arguments"], "status": "completed"}))
    streamed.sort(key=lambda x: x[0])
    for index, item in streamed:
        if item["type"] == "message":
            part = item["content"][0]
            yield {"type": "response.output_text.done", "item_id": item["id"],
                   "output_index": index, "content_index": 0, "text": part["text"]}
            yield {"type": "response.content_part.done", "item_id": item["id"],
                   "output_index": index, "content_index": 0, "part": part}
        else:
            yield {"type": "response.function_call_arguments.done", "item_id": item["id"],
                   "output_index": index, "arguments": item["arguments"]}
        yield {"type": "response.output_item.done", "output_index": index, "item": item}
    result = finish(final, [item for _, item in streamed])
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
        result["status"], "response.failed")
    yield {"type": kind, "response": result}


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        sequence = 0
        try:
            async for event in events:
                event["sequence_number"] = sequence
                sequence += 1
                yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
        except Exception as exc:  # an engine failure mid-stream: say so, then end
            message = getattr(exc, "message", str(exc))
            event = {"type": "error", "message": message, "code": "server_error",
                     "sequence_number": sequence}
            yield f"event: error\ndata: {json.dumps(event)}\n\n"
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

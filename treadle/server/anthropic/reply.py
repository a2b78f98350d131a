"""Anthropic's answers to a Messages request, whole or streamed, from the engine's outputs.

Owns the message body (`id` msg_..., `type` message, `role`, `model`, `content` blocks:
the text, then one `tool_use` block per tool call with its parsed `input`;
`stop_reason` end_turn / max_tokens / stop_sequence / tool_use and the matched
`stop_sequence`; `usage`), and the streamed events in Anthropic's order: message_start,
then per content block content_block_start, content_block_delta (text_delta, or
input_json_delta with a tool call's argument fragments) and content_block_stop, a ping
after the first block starts, message_delta (stop_reason, stop_sequence, usage) and
message_stop; a failure is an `event: error` with Anthropic's error body. Usage follows
Anthropic's accounting: `input_tokens` are the prompt tokens not read from the prefix
cache, `cache_read_input_tokens` those that were (no tokens are ever billed as cache
writes). Tool calls are parsed as chat parses them (server/tool_calls.py); a call
whose arguments are not a JSON object leaves the whole text as a text block. Pure
formatting, except `anthropic_sse`, which frames the events for the wire.
"""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from treadle.server.errors import APIError, anthropic_error_body
from treadle.server.responses import Formatting
from treadle.server.tool_calls import ToolCallStreamer, parse_choice


def message_id(request_id: str) -> str:
    """msg_<hex> from the engine request id (msg-<hex>)."""
    return "msg_" + request_id.partition("-")[2]


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def usage(output) -> dict:
    """Anthropic's usage of one RequestOutput (see the module docstring)."""
    cached = getattr(output, "num_cached_tokens", 0) or 0
    return {"input_tokens": len(output.prompt_token_ids) - cached,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": sum(len(c.token_ids) for c in output.outputs)}


def stop_of(c, has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _tools_on(fmt: Formatting) -> bool:
    return fmt.tools is not None and fmt.tools.choice != "none"


def _arguments(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def content_blocks(c, fmt: Formatting) -> tuple[list[dict], bool]:
    """(content blocks, whether they hold tool calls) of a finished choice."""
    if _tools_on(fmt):
        content, calls, _ = parse_choice(fmt.tools.parser(), c.text, fmt.tools.parallel,
                                         c.finish_reason)
        inputs = [_arguments(call["function"]["arguments"]) for call in calls]
        if calls and all(i is not None for i in inputs):
            blocks = [{"type": "text", "text": content}] if content else []
            blocks += [{"type": "tool_use", "id": tool_use_id(),
                        "name": call["function"]["name"], "input": args}
                       for call, args in zip(calls, inputs)]
            return blocks, True
    return [{"type": "text", "text": c.text}], False


def message_body(request_id: str, model: str, finals: list, fmt: Formatting) -> dict:
    """The whole answer (server/serving.py respond's `whole`)."""
    output = finals[0]
    c = output.outputs[0]
    blocks, has_calls = content_blocks(c, fmt)
    reason, sequence = stop_of(c, has_calls)
    return {"id": message_id(request_id), "type": "message", "role": "assistant",
            "model": model, "content": blocks, "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(output)}


class _Blocks:
    """The content blocks of a streamed message: which is open, and their events."""

    def __init__(self) -> None:
        self.count = 0
        self.open: tuple[str, int] | None = None  # (kind, block index)
        self.calls: dict[int, int] = {}  # tool call index -> block index
        self.pinged = False

    def _start(self, block: dict) -> list[dict]:
        events = self.close()
        index, self.count = self.count, self.count + 1
        self.open = (block["type"], index)
        events.append({"type": "content_block_start", "index": index, "content_block": block})
        if not self.pinged:
            self.pinged = True
            events.append({"type": "ping"})
        return events

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        index, self.open = self.open[1], None
        return [{"type": "content_block_stop", "index": index}]

    def text(self, delta: str) -> list[dict]:
        events = [] if self.open and self.open[0] == "text" else self._start(
            {"type": "text", "text": ""})
        return events + [{"type": "content_block_delta", "index": self.open[1],
                          "delta": {"type": "text_delta", "text": delta}}]

    def tool(self, entry: dict) -> list[dict]:
        events = []
        if "id" in entry:
            events = self._start({"type": "tool_use", "id": tool_use_id(),
                                  "name": entry["function"]["name"], "input": {}})
            self.calls[entry["index"]] = self.open[1]
        fragment = entry["function"].get("arguments") or ""
        if fragment:
            events.append({"type": "content_block_delta", "index": self.calls[entry["index"]],
                           "delta": {"type": "input_json_delta", "partial_json": fragment}})
        return events

    def finish(self) -> list[dict]:
        events = self.text("") if self.count == 0 else []  # an empty answer: one text block
        events += self.close()
        if not self.pinged:
            events.append({"type": "ping"})
        return events


async def message_events(request_id: str, model: str, outputs: AsyncIterator,
                         include_usage: bool, fmt: Formatting) -> AsyncIterator[dict]:
    """The streamed answer (server/serving.py respond's `chunks`): event dicts, or
    {"error": {...}} when the engine ended the request with an error."""
    blocks, started, sent = _Blocks(), False, 0
    streamer = ToolCallStreamer(fmt.tools.parser(), fmt.tools.parallel) if _tools_on(fmt) \
        else None
    async for _, output in outputs:
        if output.error is not None:
            yield {"error": {"message": output.error}}
            return
        c = output.outputs[0]
        if not started:
            started = True
            yield {"type": "message_start", "message": {
                "id": message_id(request_id), "type": "message", "role": "assistant",
                "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": usage(output)}}
        final = c.finish_reason is not None
        if streamer is None:
            new, sent = c.text[sent:], len(c.text)
            events = blocks.text(new) if new else []
        else:
            content, entries = streamer.feed(c.text, final=final)
            events = blocks.text(content) if content else []
            for entry in entries:
                events += blocks.tool(entry)
        for event in events:
            yield event
        if final:
            for event in blocks.finish():
                yield event
            reason, sequence = stop_of(c, streamer is not None and streamer.has_calls)
            yield {"type": "message_delta",
                   "delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": usage(output)}
            yield {"type": "message_stop"}
            return


def _frame(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def anthropic_sse(serving, events: AsyncIterator[dict]) -> StreamingResponse:
    """Events framed as Anthropic's server-sent events (`event:` + `data:` lines, no
    [DONE]); an error ends the stream with an `error` event."""
    async def body():
        try:
            async for event in events:
                if "error" in event:
                    exc = serving.ended_by_engine(event["error"]["message"])
                    yield _frame(anthropic_error_body(exc.status, exc.message))
                    return
                yield _frame(event)
        except APIError as exc:
            yield _frame(anthropic_error_body(exc.status, exc.message))
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

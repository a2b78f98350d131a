"""The Responses API's streamed events, and their server-sent-event framing.

Owns the event sequence of one streamed response: response.created and
response.in_progress; for the message, response.output_item.added and
response.content_part.added before its first response.output_text.delta; for each
function call (parsed as the text grows, server/tool_calls.py), its
response.output_item.added and response.function_call_arguments.delta events; an
`error` event where the engine ended the request; then, in output order, each item's
done events (output_text.done and content_part.done, or function_call_arguments.done,
then output_item.done), and response.completed, response.incomplete or response.failed
with the final body. Every event is numbered (`sequence_number`) and framed with its
type as the SSE event name. No engine calls beyond reading the outputs it is handed.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from treadle.server.responses_items import message_item, new_id
from treadle.server.tool_calls import ToolCallStreamer


class _StreamedItems:
    """The output items a stream has announced so far, and the events that grow them."""

    def __init__(self) -> None:
        self.message_id: str | None = None
        self.message_index: int | None = None
        self.text = ""
        self.calls: dict[int, dict] = {}  # tool-call index -> its item
        self.next_index = 0

    def text_events(self, delta: str) -> list[dict]:
        events = []
        if self.message_id is None:
            self.message_id, self.message_index = new_id("msg"), self.next_index
            self.next_index += 1
            events.append({"type": "response.output_item.added",
                           "output_index": self.message_index,
                           "item": {**message_item(self.message_id, "", "in_progress"),
                                    "content": []}})
            events.append({"type": "response.content_part.added", "item_id": self.message_id,
                           "output_index": self.message_index, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}})
        self.text += delta
        events.append({"type": "response.output_text.delta", "item_id": self.message_id,
                       "output_index": self.message_index, "content_index": 0, "delta": delta})
        return events

    def call_event(self, entry: dict) -> dict:
        """A tool-call delta entry: a new call's item, or more of its arguments."""
        if "id" in entry:
            item = {"type": "function_call", "id": new_id("fc"), "call_id": entry["id"],
                    "name": entry["function"]["name"], "arguments": "",
                    "status": "in_progress", "output_index": self.next_index}
            self.calls[entry["index"]] = item
            self.next_index += 1
            return {"type": "response.output_item.added", "output_index": item["output_index"],
                    "item": {k: v for k, v in item.items() if k != "output_index"}}
        item = self.calls[entry["index"]]
        item["arguments"] += entry["function"]["arguments"]
        return {"type": "response.function_call_arguments.delta", "item_id": item["id"],
                "output_index": item["output_index"], "delta": entry["function"]["arguments"]}

    def final_items(self) -> list[tuple[int, dict]]:
        """(output index, completed item), in output order, with the announced ids."""
        streamed = []
        if self.message_id is not None:
            streamed.append((self.message_index,
                             message_item(self.message_id, self.text, "completed")))
        for item in self.calls.values():
            streamed.append((item["output_index"], {
                "type": "function_call", "id": item["id"], "call_id": item["call_id"],
                "name": item["name"], "arguments": item["arguments"], "status": "completed"}))
        streamed.sort(key=lambda x: x[0])
        return streamed


def _done_events(index: int, item: dict) -> list[dict]:
    if item["type"] == "message":
        part = item["content"][0]
        events = [{"type": "response.output_text.done", "item_id": item["id"],
                   "output_index": index, "content_index": 0, "text": part["text"]},
                  {"type": "response.content_part.done", "item_id": item["id"],
                   "output_index": index, "content_index": 0, "part": part}]
    else:
        events = [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                   "output_index": index, "arguments": item["arguments"]}]
    return events + [{"type": "response.output_item.done", "output_index": index, "item": item}]


async def response_events(initial: dict, outputs: AsyncIterator, tools,
                          finish: Callable) -> AsyncIterator[dict]:
    """The Responses stream: created, in_progress, items and their deltas, completed.
    `finish(final, items)` makes (and stores) the final body from the streamed items."""
    yield {"type": "response.created", "response": initial}
    yield {"type": "response.in_progress", "response": initial}
    parse = tools is not None and tools.choice != "none"
    streamer = ToolCallStreamer(tools.parser(), tools.parallel) if parse else None
    items = _StreamedItems()
    final = None
    async for output in outputs:
        final = output
        c = output.outputs[0]
        if streamer is None:
            delta, entries = c.text[len(items.text):], []
        else:
            delta, entries = streamer.feed(c.text, final=c.finish_reason is not None)
        if delta:
            for event in items.text_events(delta):
                yield event
        for entry in entries:
            yield items.call_event(entry)
        if output.error is not None:
            yield {"type": "error", "message": output.error, "code": "server_error"}
    if final is None:
        return
    streamed = items.final_items()
    for index, item in streamed:
        for event in _done_events(index, item):
            yield event
    result = finish(final, [item for _, item in streamed])
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
        result["status"], "response.failed")
    yield {"type": kind, "response": result}


def responses_sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """Numbered events framed as SSE with their type as the event name; an engine
    failure mid-stream ends it with an `error` event."""
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

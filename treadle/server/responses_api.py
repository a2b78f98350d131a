"""The Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}).

Owns the Responses endpoint on top of the chat path: the request body (`input` as text
or items, `instructions`, function tools in the flat Responses form, `text.format` as a
structured output, `max_output_tokens`), the final body and its status (completed,
incomplete at max_output_tokens, failed), and the store behind `store` and
`previous_response_id`: bounded, in memory, one LRU per tenant, so a tenant can never
read another's responses. The items' translation is server/responses_items.py, the
streamed events server/responses_stream.py; authentication, the model, field checks,
tokenization, limits, grammars, admission and running are the serving object's
(server/serving.py), shared with chat and completions; admission comes before the chat
template, on the conversation's estimated size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, Optional, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from treadle.server import protocol
from treadle.server.admission import conversation_tokens
from treadle.server.errors import APIError, error_field, quoted
from treadle.server.response_store import ResponseStore
from treadle.server.responses_items import (MAX_INPUT_ITEMS, as_message, chat_tools,
                                            input_messages, new_id, output_items, usage)
from treadle.server.responses_stream import response_events, responses_sse
from treadle.server.serving import OpenAIServing
from treadle.server.tool_calls import ToolRequestError, ToolSetup



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


@dataclass
class _Reply:
    """One response being made: its id, request and conversation, and where it is stored."""

    store: ResponseStore
    tenant: str
    response_id: str
    created: int
    body: ResponsesRequest
    model_name: str
    conversation: list[dict]
    tools: ToolSetup

    def as_body(self, status: str, output: list, usage_: dict | None,
                incomplete: str | None) -> dict:
        body = self.body
        return {"id": self.response_id, "object": "response", "created_at": self.created,
                "status": status, "model": body.model or self.model_name, "output": output,
                "usage": usage_, "error": None,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "previous_response_id": body.previous_response_id,
                "temperature": body.temperature, "top_p": body.top_p,
                "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "store": body.store, "text": body.text or {"format": {"type": "text"}},
                "metadata": (body.model_extra or {}).get("metadata") or {}}

    def finish(self, final, items: list | None = None) -> dict:
        """The final body (stored when asked); `items`: the streamed ones."""
        c = final.outputs[0]
        if items is None:
            items = output_items(c.text, c.finish_reason, self.tools)
        incomplete = "max_output_tokens" if c.finish_reason == "length" else None
        status = "incomplete" if incomplete else (
            "failed" if c.finish_reason in ("error", "abort") else "completed")
        result = self.as_body(status, items, usage(final), incomplete)
        if final.error is not None:  # a failed response says why (e.g. slo_reject)
            result["error"] = {"code": error_field(final.error, "server_error"),
                               "message": final.error}
        if self.body.store:
            self.store.put(self.tenant, self.response_id, {
                "body": result, "messages": self.conversation + [as_message(items)]})
        return result


def _conversation(serving: OpenAIServing, body: ResponsesRequest,
                  tenant: str) -> tuple[list[dict], ToolSetup]:
    """The stored turns `previous_response_id` continues plus this input (as chat message
    dicts), and the request's tools."""
    history: list[dict] = []
    if body.previous_response_id is not None:
        previous = serving.responses.get(tenant, body.previous_response_id)
        if previous is None:
            raise APIError(404, f"previous_response_id: no stored response "
                           f"{quoted(body.previous_response_id)}", "previous_response_id")
        history = previous["messages"]
    try:
        new_messages = input_messages(body.input)
        tools_chat, choice = chat_tools(body.tools, body.tool_choice)
        tools = serving.tools(tools_chat, choice, body.parallel_tool_calls)
    except ToolRequestError as exc:
        raise APIError(400, str(exc), exc.field) from None
    except ValueError as exc:
        field = str(exc).split(":", 1)[0]
        raise APIError(400, str(exc), field) from None
    return history + new_messages, tools


def _apply_text_format(body: ResponsesRequest) -> None:
    """`text.format` as the chat path's response_format (400 for anything else in text)."""
    for key in (body.text or {}):
        if key != "format":
            raise APIError(400, f"text.{key}: not supported (only text.format)", f"text.{key}")
    text_format = (body.text or {}).get("format")
    if text_format is not None and not isinstance(text_format, dict):
        raise APIError(400, "text.format: must be an object with a 'type'", "text.format")
    if text_format is not None and text_format.get("type") == "json_schema":
        body.response_format = {"type": "json_schema", "json_schema": text_format}
    elif text_format is not None:
        body.response_format = text_format


async def create_response(serving: OpenAIServing, body: ResponsesRequest, request: Request):
    tenant = serving.authenticate(request)
    lora = serving.check_model(body, request)
    serving.refuse_unsupported(body, "responses")
    if body.n != 1:
        raise APIError(400, "n: the Responses API returns one output", "n")
    conversation, tools = _conversation(serving, body, tenant)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    try:
        messages = [protocol.ChatMessage(**m) for m in system + conversation]
    except ValueError as exc:
        raise APIError(400, f"input: {exc}", "input") from None
    _apply_text_format(body)
    scheduling = serving.scheduling_of(body, request)
    # Admitted (or refused: 503 / 429) on the conversation's size, before templating it.
    size = conversation_tokens([m.text() for m in messages], body.tools)
    requested = body.max_output_tokens or body.max_tokens
    cost = requested if requested is not None else serving.limits.max_request_tokens
    with serving.reserve(tenant, body.priority or 0, [(size, cost)],
                         serving.band(request)) as reservation:
        prompt_ids = await run_in_threadpool(serving.chat_token_ids, messages, True,
                                             tools.template_tools)
        max_tokens = serving.check_lengths(prompt_ids, requested, None)
        spec = await serving.structured_spec(body, tools.spec)
        params = serving.sampling_params(body, max_tokens, None, None, spec,
                                         skip_special_tokens=False if tools.needs_special_tokens
                                         else None)
        [ticket] = serving.settle(reservation, [prompt_ids], [params])
    reply = _Reply(serving.responses, tenant, new_id("resp"), int(time.time()), body,
                   serving.engine.model_name, conversation, tools)
    outputs = serving.run(request, reply.response_id, None, prompt_ids, params, body.priority,
                          tenant, ticket, lora, scheduling)
    if body.stream:
        initial = reply.as_body("in_progress", [], None, None)
        return responses_sse(response_events(initial, outputs, tools, reply.finish))
    final = await serving.final_output(request, outputs)
    if final is None:
        return Response(status_code=499)
    return reply.finish(final)


def get_response(serving: OpenAIServing, response_id: str, request: Request) -> dict:
    tenant = serving.authenticate(request)
    record = serving.responses.get(tenant, response_id)
    if record is None:
        raise APIError(404, f"no stored response {quoted(response_id)}", "response_id")
    return record["body"]


def delete_response(serving: OpenAIServing, response_id: str, request: Request) -> dict:
    tenant = serving.authenticate(request)
    if not serving.responses.delete(tenant, response_id):
        raise APIError(404, f"no stored response {quoted(response_id)}", "response_id")
    return {"id": response_id, "object": "response", "deleted": True}

"""`POST /v1/messages` and `POST /v1/messages/count_tokens`.

Owns the two endpoints' steps on the serving object (server/serving.py), in the chat
endpoint's order: the tenant, the fields Anthropic's body may not carry
(protocol.check_fields), the request as chat (convert.py), the model or adapter, the
tools and tool_choice (their grammar), the chat template (continuing a final assistant
message), the limits, the grammar compiled, the sampling parameters, admission, and the
answer (reply.py): a message body or Anthropic's events. Nothing here talks to the engine
but through the serving object.
"""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from treadle.server.anthropic import convert
from treadle.server.anthropic.protocol import CountTokensRequest, MessagesRequest, check_fields
from treadle.server.anthropic.reply import anthropic_sse, message_body, message_events
from treadle.server.errors import APIError
from treadle.server.responses import Formatting
from treadle.server.serving import OpenAIServing


def _refuse_fields(body) -> None:
    refused = check_fields(body)
    if refused is not None:
        raise APIError(400, refused[1], refused[0])


def _tools(serving: OpenAIServing, body: CountTokensRequest, choice, parallel):
    """The request's ToolSetup; 'auto' (Anthropic's default with tools) needs the server's
    tool-call parser, as in chat."""
    tools = convert.chat_tools(body)
    if tools and choice in (None, "auto") and not (serving.config.enable_auto_tool_choice
                                                   and serving.config.tool_call_parser):
        raise APIError(400, "tool_choice: {'type': 'auto'} (the default with tools) needs the "
                       "server started with --enable-auto-tool-choice and --tool-call-parser; "
                       "use {'type': 'any'} or {'type': 'tool', 'name': ...}, which a grammar "
                       "enforces", "tool_choice")
    return serving.tools(tools, choice, parallel)


async def _prompt(serving: OpenAIServing, body: CountTokensRequest, request: Request):
    """(chat messages, adapter or None, tools, prompt ids) of a request."""
    _refuse_fields(body)
    choice, parallel = convert.chat_tool_choice(body)
    messages = convert.chat_messages(body)
    lora = serving.check_model(body, request)
    tools = _tools(serving, body, choice, parallel)
    prefill = convert.continues_assistant(body)
    ids = await run_in_threadpool(serving.chat_token_ids, messages, not prefill,
                                  tools.template_tools, prefill)
    return messages, lora, tools, ids


async def create_message(serving: OpenAIServing, body: MessagesRequest, request: Request):
    tenant = serving.authenticate(request)
    messages, lora, tools, prompt_ids = await _prompt(serving, body, request)
    chat = convert.to_chat(body, messages)
    max_tokens = serving.check_lengths(prompt_ids, body.max_tokens, None)
    spec = await serving.structured_spec(chat, tools.spec)
    params = serving.sampling_params(chat, max_tokens, None, None, spec,
                                     skip_special_tokens=False if tools.needs_special_tokens
                                     else None)
    fmt = Formatting(serving.tokenizer, tools=tools)
    return await serving.respond(request, chat, tenant, "msg", [None], [prompt_ids], [params],
                                 fmt, message_events, message_body, lora,
                                 sse=lambda events: anthropic_sse(serving, events))


async def count_tokens(serving: OpenAIServing, body: CountTokensRequest, request: Request):
    serving.authenticate(request)
    *_, prompt_ids = await _prompt(serving, body, request)
    return {"input_tokens": len(prompt_ids)}

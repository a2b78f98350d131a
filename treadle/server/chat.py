"""POST /v1/chat/completions: a conversation through the model's chat template.

Owns what only chat does: tools and tool_choice (server/tool_calls.py: their grammar,
the template's tool list, whether special tokens must stay in the text for the parser),
`max_completion_tokens`, `top_logprobs`, vLLM's `truncate_prompt_tokens` on the
templated prompt, and one choice list per request. Every shared step is the serving
object's (server/serving.py); admission comes before the chat template, on the
conversation's estimated size.
"""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from treadle.server import protocol
from treadle.server.admission import conversation_tokens
from treadle.server.errors import APIError
from treadle.server.responses import Formatting, chat_chunk, chat_response
from treadle.server.serving import OpenAIServing


def _whole(request_id: str, model: str, finals: list, fmt: Formatting) -> dict:
    return chat_response(request_id, model, finals[0], fmt)


async def create_chat_completion(serving: OpenAIServing, body: protocol.ChatCompletionRequest,
                                 request: Request):
    tenant = serving.authenticate(request)
    lora = serving.check_model(body, request)
    serving.refuse_unsupported(body, "chat")
    tools = serving.tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    requested = (body.max_completion_tokens if body.max_completion_tokens is not None
                 else body.max_tokens)
    if requested == 0 and body.prompt_logprobs is None:
        raise APIError(400, "max_tokens: 0 is allowed only with prompt_logprobs", "max_tokens")
    # Admitted (or refused: 503 / 429) on the conversation's size, before templating it.
    size = conversation_tokens([m.text() for m in body.messages], body.tools)
    cost = (requested if requested is not None else serving.limits.max_request_tokens) * body.n
    with serving.reserve(tenant, body.priority or 0, [(size, cost)],
                         serving.band(request)) as reservation:
        prompt_ids = await run_in_threadpool(serving.chat_token_ids, body.messages,
                                             body.add_generation_prompt, tools.template_tools)
        prompt_ids = serving.truncate_prompt(prompt_ids, body.truncate_prompt_tokens)
        max_tokens = serving.check_lengths(prompt_ids, requested, None)
        spec = await serving.structured_spec(body, tools.spec)
        top = body.top_logprobs if body.top_logprobs is not None else 0
        params = serving.sampling_params(body, max_tokens, top if body.logprobs else None,
                                         body.prompt_logprobs, spec,
                                         skip_special_tokens=False if tools.needs_special_tokens
                                         else None)
        fmt = Formatting(serving.tokenizer, top, body.n, prompt_logprobs=body.prompt_logprobs,
                         tools=tools, return_token_ids=body.return_token_ids)
        return await serving.respond(request, body, tenant, "chatcmpl", [None], [prompt_ids],
                                     [params], fmt, chat_chunk, _whole, lora,
                                     reservation=reservation)

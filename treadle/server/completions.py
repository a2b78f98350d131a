"""POST /v1/completions: one or several prompts (text or token ids), whole or streamed.

Owns what only completions do: `echo`, `max_tokens: 0` for scoring a prompt, the
prompt logprobs that echo with logprobs implies, vLLM's `truncate_prompt_tokens` on each
prompt's ids (a cut prompt's text is then decoded from them), and one engine request per prompt
(their chunks interleave; choice indices as OpenAI numbers them: server/responses.py).
Every shared step (authentication, model, fields, admission, tokenization, limits,
grammar, running, the answer) is the serving object's (server/serving.py); admission
comes before tokenization, on the prompts' estimated sizes.
"""

from __future__ import annotations

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from treadle.server import protocol
from treadle.server.admission import prompt_tokens
from treadle.server.errors import APIError
from treadle.server.responses import Formatting, completion_chunk, completion_response
from treadle.server.serving import OpenAIServing


async def create_completion(serving: OpenAIServing, body: protocol.CompletionRequest,
                            request: Request):
    tenant = serving.authenticate(request)
    lora = serving.check_model(body, request)
    serving.refuse_unsupported(body, "completions")
    if body.max_tokens == 0 and not body.echo and body.prompt_logprobs is None:
        raise APIError(400, "max_tokens: 0 is allowed only with echo or prompt_logprobs "
                       "(scoring a prompt)", "max_tokens")
    prompts = body.prompts()
    # Admitted (or refused: 503 / 429) on the prompts' sizes, before any work on them.
    cost = (16 if body.max_tokens is None else body.max_tokens) * body.n
    with serving.reserve(tenant, body.priority or 0, [(prompt_tokens(p), cost) for p in prompts],
                         serving.band(request)) as reservation:
        texts, id_lists = await _token_ids(serving, prompts, body.truncate_prompt_tokens)
        spec = await serving.structured_spec(body)
        # echo with logprobs shows the prompt's logprobs: the engine computes them.
        wanted = [v for v in (body.logprobs if body.echo else None, body.prompt_logprobs,
                              0 if body.max_tokens == 0 else None) if v is not None]
        prompt_logprobs = max(wanted) if wanted else None
        params_list = [serving.sampling_params(body,
                                               serving.check_lengths(ids, body.max_tokens, 16),
                                               body.logprobs, prompt_logprobs, spec)
                       for ids in id_lists]
        fmt = Formatting(serving.tokenizer, body.logprobs or 0, body.n, body.echo,
                         body.prompt_logprobs, return_token_ids=body.return_token_ids)
        return await serving.respond(request, body, tenant, "cmpl", texts, id_lists,
                                     params_list, fmt, completion_chunk, completion_response,
                                     lora, reservation=reservation)


async def _token_ids(serving: OpenAIServing, prompts: list, truncate: int | None
                     ) -> tuple[list[str | None], list[list[int]]]:
    """Each prompt's text (None for token ids, or a cut text) and token ids, cut to the
    last `truncate` tokens (vLLM's truncate_prompt_tokens) and checked against the
    vocabulary."""
    texts, id_lists = [], []
    for prompt in prompts:
        if isinstance(prompt, str):
            texts.append(prompt)
            id_lists.append(await run_in_threadpool(serving.encode, prompt))
        else:
            texts.append(None)
            id_lists.append(list(prompt))
    if truncate is not None:
        cut = [serving.truncate_prompt(ids, truncate) for ids in id_lists]
        # a cut prompt's text is no longer the prompt: echo decodes the ids kept
        texts = [text if len(kept) == len(ids) else None
                 for text, ids, kept in zip(texts, id_lists, cut)]
        id_lists = cut
    for ids in id_lists:
        serving.check_vocab(ids)
    return texts, id_lists

"""The OpenAI-compatible HTTP API (FastAPI): routes, errors, streaming, disconnects.

Owns the translation between HTTP and the AsyncEngine: authentication and body limits
first (server/middleware.py), the model a request names (the base or a LoRA adapter:
server/lora_routes.py, which also has the runtime adapter routes), validation
(server/protocol.py, then the engine's limits: vocabulary, context, KV cache),
tokenization and chat templating in worker threads, overload control
(server/admission.py), server-sent events, and aborting a request the moment its client
goes away. Error bodies: server/errors.py; the published schema: server/openapi.py; the
dashboard, request timelines and OTLP spans: server/dashboard.py. Scheduling and
generation stay in the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from treadle.config import ServerConfig
from treadle.core.policies.slo import SLO_REFUSAL
from treadle.engine.async_engine import AsyncEngine, EngineDeadError, EngineFailedError
from treadle.sampling_params import SamplingParams
from treadle.server import protocol
from treadle.server.admission import (AdmissionControl, AdmissionLimits, NeverAdmissible,
                                      Overloaded, request_max_tokens)
from treadle.server.auth import KeyRing, Tenant
from treadle.server.dashboard import install_observability
from treadle.server.errors import (APIError, error_body, error_field, error_response,
                                   install_error_handlers)
from treadle.server.fields import check_fields, check_message_fields
from treadle.server.lora_routes import UnknownModel, lora_router, model_cards, resolve_model
from treadle.server.middleware import AuthFirst, BodySizeLimit
from treadle.server.openapi import install_openapi
from treadle.server.responses_api import responses_router
from treadle.server.responses import (Formatting, chat_chunk, chat_response, completion_chunk,
                                      completion_response)
from treadle.server.streams import merge
from treadle.server.tool_calls import ToolRequestError, setup_tools, template_message
from treadle.structured import (StructuredOutputError, StructuredSpec, from_response_format,
                                from_structured_outputs)

__all__ = ["APIError", "build_app", "error_response"]


async def _latest_per_source(merged):
    """From (source index, output) pairs: the latest output of every source, in order."""
    latest: dict[int, object] = {}
    try:
        async for i, output in merged:
            latest[i] = output
            yield [latest[k] for k in sorted(latest)]
    finally:
        await merged.aclose()


class _LazyGrammarCompiler:
    """The grammar compiler for the served tokenizer, built on first use in a thread
    (converting a 49152-id tokenizer takes ~0.3 s); None without a tokenizer."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._compiler = None
        self._lock = asyncio.Lock()

    async def get(self):
        if self._compiler is None and self._engine.tokenizer is not None:
            async with self._lock:
                if self._compiler is None:
                    from treadle.structured.compiler import GrammarCompiler
                    self._compiler = await asyncio.to_thread(
                        GrammarCompiler.from_hf_tokenizer, self._engine.tokenizer,
                        self._engine.limits.vocab_size, self._engine.eos_token_id)
        return self._compiler


def build_app(engine: AsyncEngine, server_config: ServerConfig, keyring: KeyRing) -> FastAPI:
    app = FastAPI(title="treadle", version="0.1.0",
                  description="OpenAI-compatible LLM serving with continuous batching")
    admission = AdmissionControl(AdmissionLimits(
        server_config.max_waiting_requests, server_config.max_waiting_tokens,
        server_config.tenant_max_concurrent_requests, server_config.tenant_tokens_per_minute,
        server_config.max_queue_delay,
        engine.config.scheduler.scheduling_policy == "priority",
        engine.config.scheduler.priority_aging))
    app.state.engine, app.state.admission, app.state.shutting_down = engine, admission, False
    limits = engine.limits
    max_model_len = limits.max_model_len
    tokenizer = engine.tokenizer
    created = protocol.now()  # /v1/models: when this server started serving the model
    grammars = _LazyGrammarCompiler(engine)
    install_error_handlers(app)
    install_openapi(app, limits, auth=keyring.enabled)

    def authorize(request: Request) -> Tenant:
        """The caller's key (checked by AuthFirst): its tenant and the models it may use;
        503 while shutting down."""
        if app.state.shutting_down:
            raise APIError(503, "server is shutting down", kind="server_error")
        return request.state.key

    def authenticate(request: Request) -> str:
        """The caller's tenant name; 503 while shutting down."""
        return authorize(request).name

    @app.get("/health")
    async def health():
        if engine.is_alive and not app.state.shutting_down:
            return {"status": "ok"}
        return error_response(503, "engine is not running", kind="server_error")

    @app.get("/metrics")
    async def metrics():
        # In a thread: a replica set (treadle/distributed) asks every replica for its own.
        text = await run_in_threadpool(engine.metrics.exposition)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": model_cards(
            engine, authorize(request), created, max_model_len, limits.vocab_size)}

    @app.post("/tokenize")
    async def tokenize(body: protocol.TokenizeRequest):
        if body.messages is not None:
            refused = check_message_fields(body.messages)
            if refused is not None:
                raise APIError(400, refused[1], refused[0])
            ids = await run_in_threadpool(_chat_token_ids, body.messages, True)
        elif body.prompt is not None:
            ids = await run_in_threadpool(_encode, body.prompt, body.add_special_tokens)
        else:
            raise APIError(400, "one of prompt or messages is required", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: protocol.DetokenizeRequest):
        vocab = limits.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await run_in_threadpool(_require_tokenizer().decode, body.tokens)}

    def _require_tokenizer():
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompt token ids", "prompt")
        return tokenizer

    def _encode(text: str, add_special_tokens: bool = True) -> list[int]:
        return _require_tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def _chat_token_ids(messages: list[protocol.ChatMessage], add_generation_prompt: bool,
                        tools: list[dict] | None = None):
        tok = _require_tokenizer()
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template", "messages")
        try:
            conversation = [template_message(m) for m in messages]
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", "messages") from None
        try:
            text = tok.apply_chat_template(conversation, tokenize=False, tools=tools,
                                           add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # a template may reject any conversation it dislikes
            raise APIError(400, f"messages: the chat template failed: {exc}",
                           "messages") from None
        return tok.encode(text, add_special_tokens=False)

    def check_model(body: protocol.SamplingFields, request: Request):
        """The adapter the body's model names (None: the base model); 404 otherwise, also
        for a model the caller's key may not use."""
        try:
            return resolve_model(engine, authorize(request), body.model)
        except UnknownModel as exc:
            raise APIError(404, str(exc), "model", kind="model_not_found") from None

    def sampling_params(body: protocol.SamplingFields, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured: StructuredSpec | None = None,
                        skip_special_tokens: bool | None = None) -> SamplingParams:
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                top_k=body.top_k, min_p=body.min_p, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, seed=body.seed, n=body.n,
                stop=body.stop_list(), stop_token_ids=list(body.stop_token_ids or []),
                ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()} or None,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=(body.skip_special_tokens if skip_special_tokens is None
                                     else skip_special_tokens),
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                structured_outputs=structured, speculative=body.speculative)
        except ValueError as exc:
            message = str(exc)
            raise APIError(400, message, message.split(" ", 1)[0]) from None
        check_token_ids(params)
        return params

    def check_token_ids(params: SamplingParams) -> None:
        error = params.token_id_error(limits.vocab_size)
        if error is not None:
            raise APIError(400, error, error.split(" ", 1)[0])

    def check_lengths(prompt_ids: list[int], requested: int | None, default: int | None):
        """max_tokens for this prompt: the requested or default count, within the context
        and the whole KV cache (a 400 naming the field otherwise; the engine core's rule,
        server/admission.py request_max_tokens)."""
        try:
            return request_max_tokens(limits, len(prompt_ids), requested, default)
        except NeverAdmissible as exc:
            raise APIError(400, str(exc), exc.param) from None

    def admit(tenant: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0):
        try:
            return admission.admit(tenant, len(prompt_ids), params.max_tokens * params.n,
                                   time.monotonic(), priority)
        except NeverAdmissible as exc:
            raise APIError(400, str(exc), exc.param) from None
        except Overloaded as exc:
            raise APIError(429, str(exc), kind="rate_limit_error",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None

    def scheduling_of(body: protocol.SamplingFields, request: Request) -> dict:
        """The request's deadlines (body fields, else the x-slo-ttft-ms header); a 400
        naming a bad header."""
        try:
            return protocol.deadlines(body, request.headers)
        except ValueError as exc:
            raise APIError(400, str(exc), protocol.SLO_TTFT_HEADER) from None

    async def run(request: Request, request_id: str, prompt: str | None, prompt_ids: list[int],
                  params: SamplingParams, priority: int, tenant: str, ticket, lora=None,
                  scheduling: dict | None = None):
        """The request's outputs (with the LoRA adapter `lora`, None: the base model;
        `scheduling`: band and deadlines, AsyncEngine.generate's keywords); the ticket is
        released however it ends."""
        if app.state.request_spans is not None:  # its span joins the caller's trace
            app.state.request_spans.note_parent(request_id, request.headers)
        try:
            async for output in engine.generate(request_id, prompt, prompt_ids, params,
                                                priority, tenant, lora, **(scheduling or {})):
                admission.started(ticket, time.monotonic())
                yield output
        except EngineFailedError as exc:
            raise APIError(500, str(exc), kind="server_error") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), kind="server_error") from None
        finally:
            admission.release(ticket)

    async def until_disconnected(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def final_output(request: Request, outputs: AsyncIterator):
        """The last output, or None if the client went away first (request aborted)."""
        async def consume():
            last = None
            async for out in outputs:
                last = out
            return last

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(until_disconnected(request))
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer in done:
            watcher.cancel()
            return consumer.result()
        consumer.cancel()  # closes the generator: the engine aborts the request
        await asyncio.gather(consumer, return_exceptions=True)
        await outputs.aclose()
        return None

    def sse(events: AsyncIterator[dict]) -> StreamingResponse:
        async def body():
            try:
                async for event in events:
                    if "error" in event:  # the engine ended the request: same body as whole
                        exc = ended_by_engine(event["error"]["message"])
                        event = error_body(exc.status, exc.message, exc.param, exc.kind)
                    yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            except APIError as exc:
                event = error_body(exc.status, exc.message, exc.param, exc.kind)
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def refuse_unsupported(body, endpoint: str) -> None:
        refused = check_fields(body, endpoint)
        if refused is None and endpoint == "chat":
            refused = check_message_fields(body.messages)
        if refused is not None:
            raise APIError(400, refused[1], refused[0])

    async def structured_spec(body: protocol.SamplingFields,
                              tool_spec: StructuredSpec | None = None) -> StructuredSpec | None:
        """The request's grammar, compiled (cached) off the event loop; 400s name the
        field and the construct."""
        try:
            specs = [spec for spec in (from_response_format(body.response_format),
                                       from_structured_outputs(body.structured_outputs),
                                       tool_spec) if spec is not None]
        except StructuredOutputError as exc:
            raise APIError(400, str(exc), exc.field) from None
        if len(specs) > 1:
            raise APIError(400, f"{specs[1].field}: only one of response_format, "
                           "structured_outputs and a 'required' or named tool_choice may "
                           "constrain a request", specs[1].field)
        if not specs:
            return None
        spec = specs[0]
        compiler = await grammars.get()
        if compiler is None:
            raise APIError(400, f"{spec.field}: structured outputs need the model's tokenizer",
                           spec.field)
        try:
            await compiler.compile_async(spec)
        except StructuredOutputError as exc:
            raise APIError(400, str(exc), exc.field) from None
        if not engine.supports_structured_outputs:
            raise APIError(400, f"{spec.field}: this model has no tokenizer files, so no "
                           "grammar can be built for it", spec.field)
        return spec

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request):
        tenant = authenticate(request)
        lora = check_model(body, request)
        refuse_unsupported(body, "completions")
        if body.max_tokens == 0 and not body.echo and body.prompt_logprobs is None:
            raise APIError(400, "max_tokens: 0 is allowed only with echo or prompt_logprobs "
                           "(scoring a prompt)", "max_tokens")
        texts, id_lists = [], []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                texts.append(prompt)
                id_lists.append(await run_in_threadpool(_encode, prompt))
            else:
                texts.append(None)
                id_lists.append(list(prompt))
        for ids in id_lists:
            check_vocab(ids)
        spec = await structured_spec(body)
        # echo with logprobs shows the prompt's logprobs: the engine computes them.
        wanted = [v for v in (body.logprobs if body.echo else None, body.prompt_logprobs,
                              0 if body.max_tokens == 0 else None) if v is not None]
        prompt_logprobs = max(wanted) if wanted else None
        params_list = [sampling_params(body, check_lengths(ids, body.max_tokens, 16),
                                       body.logprobs, prompt_logprobs, spec)
                       for ids in id_lists]
        fmt = Formatting(tokenizer, body.logprobs or 0, body.n, body.echo, body.prompt_logprobs)
        return await respond(request, body, tenant, "cmpl", texts, id_lists, params_list, fmt,
                             completion_chunk, completion_response, lora)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: protocol.ChatCompletionRequest, request: Request):
        tenant = authenticate(request)
        lora = check_model(body, request)
        refuse_unsupported(body, "chat")
        try:
            tools = setup_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                                server_config.tool_call_parser,
                                server_config.enable_auto_tool_choice)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), exc.field) from None
        requested = (body.max_completion_tokens if body.max_completion_tokens is not None
                     else body.max_tokens)
        if requested == 0 and body.prompt_logprobs is None:
            raise APIError(400, "max_tokens: 0 is allowed only with prompt_logprobs",
                           "max_tokens")
        prompt_ids = await run_in_threadpool(_chat_token_ids, body.messages,
                                             body.add_generation_prompt, tools.template_tools)
        max_tokens = check_lengths(prompt_ids, requested, None)
        spec = await structured_spec(body, tools.spec)
        top = body.top_logprobs if body.top_logprobs is not None else 0
        params = sampling_params(body, max_tokens, top if body.logprobs else None,
                                 body.prompt_logprobs, spec,
                                 skip_special_tokens=False if tools.needs_special_tokens
                                 else None)
        fmt = Formatting(tokenizer, top, body.n, prompt_logprobs=body.prompt_logprobs,
                         tools=tools)
        return await respond(request, body, tenant, "chatcmpl", [None], [prompt_ids], [params],
                             fmt, chat_chunk,
                             lambda rid, model, finals, f: chat_response(rid, model, finals[0], f),
                             lora)

    async def respond(request: Request, body: protocol.SamplingFields, tenant: str,
                      id_prefix: str, texts: list[str | None], id_lists: list[list[int]],
                      params_list: list[SamplingParams], fmt: Formatting, chunks, whole,
                      lora=None):
        """Admit every prompt, run them, and answer: a stream of `chunks` events, or one
        `whole` body made from the final output of each prompt."""
        scheduling = scheduling_of(body, request)
        tickets = []
        try:
            for ids, params in zip(id_lists, params_list):
                tickets.append(admit(tenant, ids, params, body.priority or 0))
        except APIError:
            for ticket in tickets:
                admission.release(ticket)
            raise
        request_id = protocol.random_id(id_prefix)
        many = len(id_lists) > 1
        outputs = merge([run(request, f"{request_id}-{i}" if many else request_id, texts[i],
                             id_lists[i], params_list[i], body.priority, tenant, tickets[i],
                             lora, scheduling)
                         for i in range(len(id_lists))])
        model_name = engine.model_name if lora is None else lora.lora_name
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(chunks(request_id, model_name, outputs, include_usage, fmt))
        finals = await final_output(request, _latest_per_source(outputs))
        if finals is None:  # the client went away; the requests were aborted
            return Response(status_code=499)
        for final in finals:
            if final.error is not None:
                raise ended_by_engine(final.error)
        return whole(request_id, model_name, finals, fmt)

    def ended_by_engine(reason: str) -> APIError:
        """A request the engine ended with an error: the shutdown drain's abort (503), or
        the engine refusing it at admission or ending it while it ran (400 naming the
        field at fault, e.g. a grammar that failed while generating; the checks above
        make admission refusals rare)."""
        if app.state.shutting_down or not engine.is_alive:
            return APIError(503, reason, kind="server_error")
        if reason.startswith(SLO_REFUSAL):  # slo_reject: the load, not the request, is at fault
            return APIError(503, reason, "slo_ttft_ms", kind="server_error")
        return APIError(400, reason, error_field(reason))

    def check_vocab(prompt_ids: list[int]) -> None:
        vocab = limits.vocab_size
        bad = next((t for t in prompt_ids if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is outside the vocabulary [0, {vocab})",
                           "prompt")

    app.include_router(responses_router(SimpleNamespace(
        engine=engine, server_config=server_config, APIError=APIError, Response=Response,
        authenticate=authenticate, check_model=check_model, chat_token_ids=_chat_token_ids,
        run_in_threadpool=run_in_threadpool, check_lengths=check_lengths,
        scheduling_of=scheduling_of,
        structured_spec=structured_spec, sampling_params=sampling_params, admit=admit,
        run=run, final_output=final_output)))
    if server_config.enable_lora_runtime_updates:
        app.include_router(lora_router(engine, authorize))
    install_observability(app, engine, server_config, keyring, authenticate)
    app.add_middleware(BodySizeLimit, max_bytes=server_config.max_request_body_bytes)
    app.add_middleware(AuthFirst, keyring=keyring)  # added last: runs first
    return app


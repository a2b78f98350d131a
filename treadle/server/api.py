"""The OpenAI-compatible HTTP API (FastAPI): routes, errors, streaming, disconnects.

Owns the translation between HTTP and the AsyncEngine: authentication (server/auth.py),
validation (server/protocol.py), tokenization and chat templating in worker threads,
overload control (server/admission.py), server-sent events, and aborting a request the
moment its client goes away. Scheduling and generation stay in the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from treadle.config import ServerConfig
from treadle.engine.async_engine import AsyncEngine, EngineDeadError
from treadle.sampling_params import SamplingParams
from treadle.server import protocol
from treadle.server.admission import AdmissionControl, AdmissionLimits, Overloaded
from treadle.server.auth import AuthError, KeyRing
from treadle.server.responses import (chat_chunk, chat_response, completion_chunk,
                                      completion_response)


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}


def error_response(status: int, message: str, param: str | None = None,
                   kind: str = "invalid_request_error", headers: dict | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": status}}, status_code=status, headers=headers)


class BodySizeLimit:
    """ASGI middleware: refuse bodies over the limit with 413, before parsing them."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or {}).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, f"request body exceeds {self.max_bytes} bytes")
            return message

        try:
            await self.app(scope, limited_receive, send)
        except APIError:
            await self._refuse(send)

    async def _refuse(self, send):
        body = json.dumps({"error": {"message": f"request body exceeds {self.max_bytes} bytes",
                                     "type": "invalid_request_error", "param": None,
                                     "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})


def build_app(engine: AsyncEngine, server_config: ServerConfig, keyring: KeyRing) -> FastAPI:
    app = FastAPI(title="treadle", version="0.1.0",
                  description="OpenAI-compatible LLM serving with continuous batching")
    admission = AdmissionControl(AdmissionLimits(
        server_config.max_waiting_requests, server_config.max_waiting_tokens,
        server_config.tenant_max_concurrent_requests, server_config.tenant_tokens_per_minute))
    app.state.engine, app.state.admission, app.state.shutting_down = engine, admission, False
    max_model_len = engine.limits.max_model_len
    tokenizer = engine.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.kind, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
        field = ".".join(loc) or None
        return error_response(400, f"{field or 'body'}: {first.get('msg', 'invalid request')}",
                              field)

    def authenticate(request: Request) -> str:
        if app.state.shutting_down:
            raise APIError(503, "server is shutting down", kind="server_error")
        try:
            return keyring.authenticate(request.headers.get("authorization")).name
        except AuthError as exc:
            raise APIError(401, str(exc), kind="authentication_error") from None

    @app.get("/health")
    async def health():
        if engine.is_alive and not app.state.shutting_down:
            return {"status": "ok"}
        return error_response(503, "engine is not running", kind="server_error")

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authenticate(request)
        return {"object": "list", "data": [{
            "id": engine.model_name, "object": "model", "created": protocol.now(),
            "owned_by": "treadle", "max_model_len": max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: protocol.TokenizeRequest):
        if body.messages is not None:
            ids = await run_in_threadpool(_chat_token_ids, body.messages, True)
        elif body.prompt is not None:
            ids = await run_in_threadpool(_encode, body.prompt, body.add_special_tokens)
        else:
            raise APIError(400, "one of prompt or messages is required", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: protocol.DetokenizeRequest):
        vocab = engine.limits.vocab_size
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

    def _chat_token_ids(messages: list[protocol.ChatMessage], add_generation_prompt: bool):
        tok = _require_tokenizer()
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template", "messages")
        try:
            conversation = [{"role": m.role, "content": m.text()} for m in messages]
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", "messages") from None
        try:
            text = tok.apply_chat_template(conversation, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # a template may reject any conversation it dislikes
            raise APIError(400, f"messages: the chat template failed: {exc}",
                           "messages") from None
        return tok.encode(text, add_special_tokens=False)

    def check_model(body: protocol.SamplingFields) -> None:
        if body.model is not None and body.model != engine.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                           f"{engine.model_name!r}", "model", kind="model_not_found")

    def sampling_params(body: protocol.SamplingFields, max_tokens: int,
                        logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                top_k=body.top_k, min_p=body.min_p, presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, seed=body.seed, n=body.n,
                stop=body.stop_list(), stop_token_ids=list(body.stop_token_ids or []),
                ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()} or None,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens, logprobs=logprobs,
                speculative=body.speculative)
        except ValueError as exc:
            message = str(exc)
            raise APIError(400, message, message.split(" ", 1)[0]) from None

    def check_lengths(prompt_ids: list[int], requested: int | None, default: int | None):
        if not prompt_ids:
            raise APIError(400, "prompt is empty: at least one token is needed", "prompt")
        room = max_model_len - len(prompt_ids)
        if room < 1:
            raise APIError(400, f"prompt has {len(prompt_ids)} tokens, but the model's context "
                           f"length is {max_model_len} tokens", "prompt")
        max_tokens = requested if requested is not None else min(default or room, room)
        if len(prompt_ids) + max_tokens > max_model_len:
            raise APIError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) "
                           f"= {len(prompt_ids) + max_tokens} exceeds the model's context "
                           f"length of {max_model_len} tokens", "max_tokens")
        return max_tokens

    def admit(tenant: str, prompt_ids: list[int], params: SamplingParams):
        try:
            return admission.admit(tenant, len(prompt_ids), params.max_tokens * params.n,
                                   time.monotonic())
        except Overloaded as exc:
            raise APIError(429, str(exc), kind="rate_limit_error",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None

    async def run(request: Request, request_id: str, prompt: str | None, prompt_ids: list[int],
                  params: SamplingParams, priority: int, tenant: str, ticket):
        """The request's outputs; the ticket is released however it ends."""
        try:
            async for output in engine.generate(request_id, prompt, prompt_ids, params,
                                                priority, tenant):
                admission.started(ticket)
                yield output
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
                    yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            except APIError as exc:
                yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.kind}})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request):
        tenant = authenticate(request)
        check_model(body)
        if isinstance(body.prompt, str):
            prompt, prompt_ids = body.prompt, await run_in_threadpool(_encode, body.prompt)
        else:
            prompt, prompt_ids = None, list(body.prompt)
        check_vocab(prompt_ids)
        max_tokens = check_lengths(prompt_ids, body.max_tokens, 16)
        params = sampling_params(body, max_tokens, body.logprobs)
        return await respond(request, body, tenant, "cmpl", prompt, prompt_ids, params,
                             body.logprobs or 0, completion_chunk, completion_response)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: protocol.ChatCompletionRequest, request: Request):
        tenant = authenticate(request)
        check_model(body)
        prompt_ids = await run_in_threadpool(_chat_token_ids, body.messages,
                                             body.add_generation_prompt)
        max_tokens = check_lengths(prompt_ids, body.max_completion_tokens or body.max_tokens,
                                   None)
        top = body.top_logprobs if body.top_logprobs is not None else 0
        params = sampling_params(body, max_tokens, top if body.logprobs else None)
        return await respond(request, body, tenant, "chatcmpl", None, prompt_ids, params, top,
                             chat_chunk, chat_response)

    async def respond(request: Request, body: protocol.SamplingFields, tenant: str,
                      id_prefix: str, prompt: str | None, prompt_ids: list[int],
                      params: SamplingParams, top_n: int, chunks, whole):
        """Admit, run, and answer: a stream of `chunks` events, or one `whole` body."""
        ticket = admit(tenant, prompt_ids, params)
        request_id = protocol.random_id(id_prefix)
        outputs = run(request, request_id, prompt, prompt_ids, params, body.priority, tenant,
                      ticket)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse(chunks(request_id, engine.model_name, outputs, include_usage, tokenizer,
                              top_n))
        final = await final_output(request, outputs)
        if final is None:  # the client went away; the request was aborted
            return Response(status_code=499)
        return whole(request_id, engine.model_name, final, tokenizer, top_n)

    def check_vocab(prompt_ids: list[int]) -> None:
        vocab = engine.limits.vocab_size
        bad = next((t for t in prompt_ids if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt: token id {bad} is outside the vocabulary [0, {vocab})",
                           "prompt")

    app.add_middleware(BodySizeLimit, max_bytes=server_config.max_request_body_bytes)
    return app


"""`OpenAIServing`: the one object behind every route, and the steps the endpoints share.

Owns the server's state over one EngineClient (treadle/engine/client.py): the server
config, the tokenizer, the model's limits, the overload control (server/admission.py),
the lazily built grammar compiler, the Responses store, the shutting-down flag and the
request spans. Its methods are the steps every generating endpoint takes, in this order:
authentication (the key was checked by server/middleware.py; here the tenant, and 503
while shutting down), the model a request names (the base or a LoRA adapter:
server/lora_routes.py), field checks (server/fields.py), tokenization and chat
templating in worker threads, the limits a request must fit (server/validation.py),
sampling parameters (bad_words and DRY's breakers made token ids off the event loop:
engine/token_words.py), structured-output grammars compiled off the event loop,
admission, running the engine request (aborted the moment its client goes away), and
the answer: server-sent events or one final body. The endpoints themselves are one
module each (server/completions.py, server/chat.py, server/responses_api.py, the
Anthropic Messages API in server/anthropic/) plus the small ones
here (health, metrics, models, tokenize); the routes (server/routes.py) only parse and
call. Scheduling and generation stay in the engine; this module never touches FastAPI's
app or routing.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from treadle.core.policies.slo import SLO_REFUSAL
from treadle.engine.client import EngineClient, EngineDeadError, EngineFailedError
from treadle.engine.token_words import TokenWords
from treadle.metrics import ServerMetrics
from treadle.sampling_params import SamplingParams
from treadle.server import protocol, validation
from treadle.server.admission import (AdmissionControl, AdmissionLimits, NeverAdmissible,
                                      Overloaded, Reservation, Ticket)
from treadle.server.auth import KeyRing, Tenant
from treadle.server.config import ServerConfig
from treadle.server.errors import APIError, error_body, error_field, error_response, quoted
from treadle.server.fields import check_fields, check_message_fields
from treadle.server.grammars import LazyGrammarCompiler
from treadle.server.responses import Formatting
from treadle.server.response_store import ResponseStore
from treadle.server.streams import latest_per_source, merge
from treadle.server.tool_calls import ToolRequestError, ToolSetup, setup_tools, template_message
from treadle.structured import (StructuredOutputError, StructuredSpec, from_response_format,
                                from_structured_outputs)


logger = logging.getLogger(__name__)


def admission_limits(config: ServerConfig, engine: EngineClient) -> AdmissionLimits:
    """The overload bounds of the server's options, ordered as the engine's policy orders,
    with the engine's slots, step budget and KV cache the wait prediction reads."""
    scheduler = engine.config.scheduler
    return AdmissionLimits(
        config.max_waiting_requests, config.max_waiting_tokens,
        config.tenant_max_concurrent_requests, config.tenant_tokens_per_minute,
        config.max_queue_delay, scheduler.scheduling_policy == "priority",
        scheduler.priority_aging, scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
        engine.limits.num_kv_tokens)


def describe_admission(limits: AdmissionLimits) -> str:
    """The start-up line: what bounds the queue."""
    delay = (f"a predicted wait for the engine over {limits.max_queue_delay_s:g} s "
             "(max_queue_delay; from the admitted work, the engine's slots and its measured "
             "time per token)" if limits.max_queue_delay_s > 0 else "no wait bound "
             "(max_queue_delay 0)")
    return (f"admission: 503 with Retry-After on {delay}, over {limits.max_waiting_requests} "
            f"waiting requests or {limits.max_waiting_tokens} waiting prompt tokens; 429 "
            f"over a tenant's {limits.tenant_max_concurrent_requests} requests in flight"
            + (f" or {limits.tenant_tokens_per_minute} tokens a minute"
               if limits.tenant_tokens_per_minute else "")
            + f"; slots: up to {limits.max_num_seqs} requests at once (max_num_seqs) within "
              f"the KV cache's {limits.num_kv_tokens} tokens")


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _ran_to_its_end(output) -> tuple[bool, float | None]:
    """Whether a finished output ran to its end (no abort, no error), and the engine's
    seconds per token for it: first token to finish over the steps after the first."""
    if output.error is not None or any(c.finish_reason in (None, "abort", "error")
                                       for c in output.outputs):
        return False, None
    m, steps = output.metrics, max((len(c.token_ids) for c in output.outputs), default=0) - 1
    if m is None or m.first_token_time is None or m.finished_time is None or steps < 1:
        return True, None
    return True, (m.finished_time - m.first_token_time) / steps


def serving_of(request: Request) -> "OpenAIServing":
    """The app's serving object (build_app puts it in the app's state)."""
    return request.app.state.serving


class OpenAIServing:
    """The OpenAI server's state over one engine, and the steps its endpoints share."""

    def __init__(self, engine: EngineClient, config: ServerConfig, keyring: KeyRing) -> None:
        self.engine = engine
        self.config = config
        self.keyring = keyring
        self.limits = engine.limits
        self.tokenizer = engine.tokenizer
        self.admission = AdmissionControl(admission_limits(config, engine))
        logger.info(describe_admission(self.admission.limits))
        self.server_metrics = ServerMetrics(engine.model_name)
        """The server's own metrics (refusals by reason), served after the engine's."""
        self._bound_logged = False
        self.grammars = LazyGrammarCompiler(engine)
        self.words = TokenWords(engine.tokenizer)
        """bad_words and DRY's breakers -> token ids, before the engine sees a request."""
        self.responses = ResponseStore(config.responses_store_size)
        """Stored Responses-API responses (server/responses_api.py)."""
        self.created = protocol.now()
        """/v1/models: when this server started serving the model."""
        self.shutting_down = False
        """Set by the SIGTERM drain (server/serve.py): new requests get 503."""
        self.request_spans = None
        """The OTLP exporter (server/otel.py) when configured (server/dashboard.py)."""
        self.step_recorder = None
        """The engine's StepRecorder while the dashboard, timelines or spans are on."""
        parameters = inspect.signature(engine.generate).parameters.values()
        self._takes_band = any(p.name == "band" or p.kind is p.VAR_KEYWORD for p in parameters)
        """Whether the engine takes bands and deadlines (a batch line asks for the lowest
        band; replicas pass them on as keywords)."""

    # ----- the small endpoints ------------------------------------------------------------

    def health(self):
        """Liveness: 200 while the engine runs, whatever its queue (TGI #3241: a full
        queue that failed the liveness probe got a healthy server restarted)."""
        if self.engine.is_alive and not self.shutting_down:
            return {"status": "ok"}
        return error_response(503, "engine is not running", kind="server_error")

    def ready(self):
        """Readiness: 200 while a new request can be served; 503 with the reason while
        shutting down, with the engine dead, or while it is stalled (engine/watchdog.py).
        Not a load signal: a saturated server stays ready and answers each request it
        cannot take with 503 and Retry-After (an unready pod gets no traffic at all)."""
        if self.shutting_down:
            reason = "server is shutting down"
        elif not self.engine.is_alive:
            reason = "engine is not running"
        else:
            reason = self.engine.stalled
        if reason is None:
            return {"status": "ready"}
        return error_response(503, reason, kind="server_error")

    async def metrics(self) -> Response:
        # In a thread: a replica set (treadle/distributed) asks every replica for its own.
        text = await run_in_threadpool(self.engine.metrics.exposition)
        return Response(text + self.server_metrics.exposition(),
                        media_type=CONTENT_TYPE_LATEST)

    def models(self, request: Request) -> dict:
        """/v1/models: the entries this key may see, the base model, then each adapter
        with the base as its parent (vLLM's fields)."""
        tenant, engine = self.authorize(request), self.engine
        base = engine.model_name

        def card(name: str, parent: str | None) -> dict:
            # `root` is the served name, not the checkpoint's or adapter's path: a key
            # holder learns nothing of the server's file system
            return {"id": name, "object": "model", "created": self.created,
                    "owned_by": "treadle", "root": name, "parent": parent,
                    "max_model_len": self.limits.max_model_len,
                    "vocab_size": self.limits.vocab_size}

        cards = [card(base, None)] if tenant.may_use(base) else []
        if engine.lora_enabled:
            cards += [card(lora.lora_name, base) for lora in engine.list_loras()
                      if tenant.may_use(lora.lora_name)]
        return {"object": "list", "data": cards}

    async def tokenize(self, body: protocol.TokenizeRequest, request: Request) -> dict:
        """/tokenize, under the rules of every route: the 503 while shutting down, the
        key's models, unknown fields refused, the prompt's bytes bounded before any
        tokenizing."""
        self.check_model(body, request)
        self.refuse_unsupported(body, "tokenize")
        if body.messages is not None:
            refused = check_message_fields(body.messages)
            if refused is not None:
                raise APIError(400, refused[1], refused[0])
            ids = await run_in_threadpool(self.chat_token_ids, body.messages, True)
        elif body.prompt is not None:
            ids = await run_in_threadpool(self.encode, body.prompt, body.add_special_tokens)
        else:
            raise APIError(400, "one of prompt or messages is required", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.limits.max_model_len}

    async def detokenize(self, body: protocol.DetokenizeRequest, request: Request) -> dict:
        self.check_model(body, request)
        self.refuse_unsupported(body, "detokenize")
        vocab = self.limits.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await run_in_threadpool(self.require_tokenizer().decode, body.tokens)}

    # ----- who asks, for which model, with which fields -----------------------------------

    def authorize(self, request: Request) -> Tenant:
        """The caller's key (checked by AuthFirst): its tenant and the models it may use;
        503 while shutting down."""
        if self.shutting_down:
            raise APIError(503, "server is shutting down", kind="server_error")
        return request.state.key

    @staticmethod
    def scheduling_of(body, request: Request) -> dict:
        """The request's deadlines as the engine takes them (the body's slo_ttft_ms /
        slo_tpot_ms, else the gateway's x-slo-ttft-ms header); a 400 naming a bad header."""
        try:
            return protocol.deadlines(body, request.headers)
        except ValueError as exc:
            raise APIError(400, str(exc), protocol.SLO_TTFT_HEADER) from None

    @staticmethod
    def band(request: Request) -> str | None:
        """The band a request runs in: "batch" for a Batch API line (server/batch_lines.py
        marks its requests so), None for a live request."""
        return getattr(request.state, "band", None)

    def authenticate(self, request: Request) -> str:
        """The caller's tenant name; 503 while shutting down."""
        return self.authorize(request).name

    def check_model(self, body: protocol.SamplingFields, request: Request):
        """The adapter the body's model names (None: the base model, also when no model
        is given); 404 when the name is neither or not the caller key's: another
        tenant's adapter is the same 404 as a name that does not exist (no oracle)."""
        tenant, name = self.authorize(request), body.model
        base = self.engine.model_name
        if name is None or name == base:
            if tenant.may_use(base):
                return None
            name = base
        else:
            lora = self.engine.get_lora(name) if self.engine.lora_enabled else None
            if lora is not None and tenant.may_use(name):
                return lora
        raise APIError(404, f"model {quoted(name)} does not exist; GET /v1/models lists the "
                       "models this key may use", "model", kind="model_not_found")

    def refuse_unsupported(self, body, endpoint: str) -> None:
        """400 naming a field the endpoint refuses (server/fields.py)."""
        refused = check_fields(body, endpoint)
        if refused is None and endpoint == "chat":
            refused = check_message_fields(body.messages)
        if refused is not None:
            raise APIError(400, refused[1], refused[0])

    def tools(self, tools: list[dict] | None, tool_choice, parallel_tool_calls) -> ToolSetup:
        """The request's tools under the server's parser options (400 naming the field)."""
        try:
            return setup_tools(tools, tool_choice, parallel_tool_calls,
                               self.config.tool_call_parser, self.config.enable_auto_tool_choice)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), exc.field) from None

    # ----- tokenization (in worker threads) -------------------------------------------------

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send prompt token ids", "prompt")
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True,
               field: str = "prompt") -> list[int]:
        tok = self.require_tokenizer()
        self.check_text_size(text, field)
        return tok.encode(text, add_special_tokens=add_special_tokens)

    def check_text_size(self, text: str, field: str) -> None:
        """400 before tokenizing a text that must have more tokens than the context holds:
        no token of the vocabulary is longer than `max_token_bytes`, so N bytes are at
        least N / max_token_bytes tokens (a 1 MB prompt was tokenized in full, 8 s, before
        its 400; a 7.5 MB /tokenize cost a minute of CPU)."""
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        least = -(-num_bytes // self.max_token_bytes)
        if least > self.limits.max_model_len:
            raise APIError(400, f"{field}: {num_bytes} bytes of text are at least {least} "
                           f"tokens (no token is longer than {self.max_token_bytes} bytes), "
                           f"more than the model's context length of "
                           f"{self.limits.max_model_len} tokens", field)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token of the vocabulary stands for (its UTF-8 spelling, an
        overestimate for byte-level tokens: a safe bound)."""
        vocab = self.require_tokenizer().get_vocab()
        return max(1, max(len(t.encode("utf-8", "surrogatepass")) for t in vocab))

    def chat_token_ids(self, messages: list[protocol.ChatMessage], add_generation_prompt: bool,
                       tools: list[dict] | None = None,
                       continue_final_message: bool = False) -> list[int]:
        """The conversation through the chat template; `continue_final_message`: the
        last (assistant) message left open for the model to continue (Anthropic's
        prefill)."""
        tok = self.require_tokenizer()
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template", "messages")
        try:
            conversation = [template_message(m) for m in messages]
        except ValueError as exc:
            raise APIError(400, f"messages: {exc}", "messages") from None
        self.check_text_size("".join(str(m.get("content") or "") for m in conversation),
                             "messages")
        try:
            options = {"continue_final_message": True} if continue_final_message else {}
            text = tok.apply_chat_template(conversation, tokenize=False, tools=tools,
                                           add_generation_prompt=add_generation_prompt,
                                           **options)
        except Exception as exc:  # a template may reject any conversation it dislikes
            raise APIError(400, f"messages: the chat template failed: {exc}",
                           "messages") from None
        return tok.encode(text, add_special_tokens=False)

    # ----- what the request asks of the engine ----------------------------------------------

    def check_lengths(self, prompt_ids: list[int], requested: int | None,
                      default: int | None) -> int:
        """max_tokens for this prompt (server/validation.py)."""
        return validation.check_lengths(self.limits, prompt_ids, requested, default)

    def check_vocab(self, prompt_ids: list[int]) -> None:
        validation.check_vocab(self.limits, prompt_ids)

    def truncate_prompt(self, prompt_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens (server/validation.py)."""
        return validation.truncate_prompt(self.limits, prompt_ids, keep)

    def sampling_params(self, body: protocol.SamplingFields, max_tokens: int,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        structured: StructuredSpec | None = None,
                        skip_special_tokens: bool | None = None) -> SamplingParams:
        """The body's sampling fields as SamplingParams (400 naming the field, also when
        bad_words or DRY's breakers cannot become token ids: engine/token_words.py)."""
        params = validation.sampling_params(self.limits, body, max_tokens, logprobs,
                                            prompt_logprobs, structured, skip_special_tokens)
        try:
            self.words.check(params)
        except ValueError as exc:
            message = str(exc)
            raise APIError(400, message, error_field(message)) from None
        return params

    async def structured_spec(self, body: protocol.SamplingFields,
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
        compiler = await self.grammars.get()
        if compiler is None:
            raise APIError(400, f"{spec.field}: structured outputs need the model's tokenizer",
                           spec.field)
        try:
            await compiler.compile_async(spec)
        except StructuredOutputError as exc:
            raise APIError(400, str(exc), exc.field) from None
        if not self.engine.supports_structured_outputs:
            raise APIError(400, f"{spec.field}: this model has no tokenizer files, so no "
                           "grammar can be built for it", spec.field)
        return spec

    # ----- admission, running, answering ------------------------------------------------------

    def _refused(self, exc: Overloaded) -> APIError:
        """A refusal as its answer (503 saturated, 429 over the tenant's limits), counted."""
        self.server_metrics.record_rejection(exc.reason)
        return APIError(exc.status, str(exc),
                        kind="rate_limit_error" if exc.status == 429 else "server_error",
                        headers={"Retry-After": str(exc.retry_after_s)})

    def reserve(self, tenant: str, priority: int, sizes: list[tuple[int, int]],
                band: str | None = None) -> Reservation:
        """Admit a request's prompts by their sizes as known before any work on them
        ((estimated prompt tokens, max_tokens x n) each): 429 with Retry-After when the
        tenant is over its limits, 503 with Retry-After when the server is saturated or
        its engine stalled. Use it as a context manager: the tickets go back unless
        `respond` takes them. A batch line (`band`) gets tickets that count nowhere
        (`settle` still checks its exact size)."""
        if band is not None:
            now = time.monotonic()
            return Reservation(self.admission, [
                Ticket(tenant, size, priority, now, max(1, cost), started=True, ended=True,
                       released=True) for size, cost in sizes])
        stalled = self.engine.stalled
        if stalled is not None:
            retry = max(1, round(self.engine.config.parallel.stall_timeout))
            raise self._refused(Overloaded(stalled, retry, "engine_stalled"))
        now, tickets = time.monotonic(), []
        if not self._bound_logged:
            self._log_queue_bound(now)
        try:
            for num_prompt_tokens, max_tokens in sizes:
                tickets.append(self.admission.reserve(tenant, num_prompt_tokens, max_tokens,
                                                      now, priority))
        except Overloaded as exc:
            for ticket in tickets:
                self.admission.release(ticket)
            raise self._refused(exc) from None
        return Reservation(self.admission, tickets)

    def _log_queue_bound(self, now: float) -> None:
        """Once the engine's time per token is measured: the queue's length in requests."""
        bound = self.admission.queue_bound(now)
        if bound is not None:
            self._bound_logged = True
            requests, slots, step_s = bound
            logger.info("admission: %.1f ms a token measured, %d slots: the %g s wait bound "
                        "holds about %d waiting requests of the size admitted so far",
                        1000 * step_s, slots, self.admission.limits.max_queue_delay_s, requests)

    def admit(self, tenant: str, prompt_ids: list[int], params: SamplingParams,
              priority: int = 0, band: str | None = None) -> Ticket:
        """Count a tokenized request in (the same answers as `reserve`, and 400 when no
        wait could ever admit it; the endpoints reserve before tokenizing instead). A
        batch line (`band`) is only checked: the batch runner bounds its own lines, which
        never count against (nor get 429s from) the live requests' overload bounds."""
        try:
            if band is not None:
                self.admission.check_admissible(len(prompt_ids), params.max_tokens * params.n)
                return Ticket(tenant, len(prompt_ids), priority, time.monotonic(),
                              started=True, released=True)
            return self.admission.admit(tenant, len(prompt_ids), params.max_tokens * params.n,
                                        time.monotonic(), priority)
        except NeverAdmissible as exc:
            raise APIError(400, str(exc), exc.param) from None
        except Overloaded as exc:
            raise self._refused(exc) from None

    def settle(self, reservation: "Reservation", id_lists: list[list[int]],
               params_list: list[SamplingParams]) -> list[Ticket]:
        """The reserved tickets with each prompt's exact size (400 when no wait could ever
        admit it); from here the request's streams release them."""
        for ticket, ids, params in zip(reservation.tickets, id_lists, params_list):
            try:
                self.admission.settle(ticket, len(ids), params.max_tokens * params.n,
                                      time.monotonic())
            except NeverAdmissible as exc:
                raise APIError(400, str(exc), exc.param) from None
        reservation.taken = True
        return reservation.tickets

    async def run(self, request: Request, request_id: str, prompt: str | None,
                  prompt_ids: list[int], params: SamplingParams, priority: int, tenant: str,
                  ticket: Ticket, lora=None, scheduling: dict | None = None):
        """The request's outputs (with the LoRA adapter `lora`, None: the base model;
        `scheduling`: its deadlines, `scheduling_of`); the ticket follows its progress
        (the admission's measurements) and is released however it ends."""
        if self.request_spans is not None:  # its span joins the caller's trace
            self.request_spans.note_parent(request_id, request.headers)
        band = self.band(request)
        extra = {"band": band} if band is not None else {}
        extra.update({k: v for k, v in (scheduling or {}).items() if v is not None})
        extra = extra if self._takes_band else {}
        completed, per_token = False, None
        try:
            if params.needs_tokenized_words:  # the first time, a scan of the vocabulary
                params = await run_in_threadpool(self.words.resolve, params)
            async for output in self.engine.generate(request_id, prompt, prompt_ids, params,
                                                     priority, tenant, lora, **extra):
                self.admission.progressed(ticket, sum(len(c.token_ids) for c in output.outputs),
                                          time.monotonic(), output.finished)
                if output.finished:
                    completed, per_token = _ran_to_its_end(output)
                yield output
        except EngineFailedError as exc:
            raise APIError(500, str(exc), kind="server_error") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), kind="server_error") from None
        finally:
            self.admission.release(ticket, completed, per_token)

    async def final_output(self, request: Request, outputs: AsyncIterator):
        """The last output, or None if the client went away first (request aborted)."""
        async def consume():
            last = None
            async for out in outputs:
                last = out
            return last

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_until_disconnected(request))
        done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer in done:
            watcher.cancel()
            return consumer.result()
        consumer.cancel()  # closes the generator: the engine aborts the request
        await asyncio.gather(consumer, return_exceptions=True)
        await outputs.aclose()
        return None

    def sse(self, events: AsyncIterator[dict]) -> StreamingResponse:
        """Chat and completions chunks as server-sent events, then [DONE]; an error ends
        the stream with an error body."""
        async def body():
            try:
                async for event in events:
                    if "error" in event:  # the engine ended the request: same body as whole
                        exc = self.ended_by_engine(event["error"]["message"])
                        event = error_body(exc.status, exc.message, exc.param, exc.kind)
                    yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            except APIError as exc:
                event = error_body(exc.status, exc.message, exc.param, exc.kind)
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def respond(self, request: Request, body: protocol.SamplingFields, tenant: str,
                      id_prefix: str, texts: list[str | None], id_lists: list[list[int]],
                      params_list: list[SamplingParams], fmt: Formatting, chunks, whole,
                      lora=None, sse=None, reservation: Reservation | None = None):
        """Admit every prompt (settle the `reservation` taken before tokenizing them),
        run them, and answer: a stream of `chunks` events (framed by `sse`, default
        OpenAI's `self.sse`), or one `whole` body made from the final output of each
        prompt."""
        scheduling = self.scheduling_of(body, request)  # a 400 before any ticket is taken
        if reservation is not None:
            tickets = self.settle(reservation, id_lists, params_list)
        else:  # an endpoint that did not reserve before tokenizing
            tickets = []
            try:
                for ids, params in zip(id_lists, params_list):
                    tickets.append(self.admit(tenant, ids, params, body.priority or 0,
                                              self.band(request)))
            except APIError:
                for ticket in tickets:
                    self.admission.release(ticket)
                raise
        request_id = protocol.random_id(id_prefix)
        many = len(id_lists) > 1
        outputs = merge([self.run(request, f"{request_id}-{i}" if many else request_id,
                                  texts[i], id_lists[i], params_list[i], body.priority, tenant,
                                  tickets[i], lora, scheduling)
                         for i in range(len(id_lists))])
        model_name = self.engine.model_name if lora is None else lora.lora_name
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return (sse or self.sse)(chunks(request_id, model_name, outputs, include_usage,
                                            fmt))
        finals = await self.final_output(request, latest_per_source(outputs))
        if finals is None:  # the client went away; the requests were aborted
            return Response(status_code=499)
        for final in finals:
            if final.error is not None:
                raise self.ended_by_engine(final.error)
        return whole(request_id, model_name, finals, fmt)

    def ended_by_engine(self, reason: str) -> APIError:
        """A request the engine ended with an error: the shutdown drain's abort (503), or
        the engine refusing it at admission or ending it while it ran (400 naming the
        field at fault, e.g. a grammar that failed while generating; the checks before
        admission make admission refusals rare)."""
        if self.shutting_down or not self.engine.is_alive:
            return APIError(503, reason, kind="server_error")
        if reason.startswith(SLO_REFUSAL):  # slo_reject: the load, not the request, is at fault
            return APIError(503, reason, "slo_ttft_ms", kind="server_error")
        return APIError(400, reason, error_field(reason))

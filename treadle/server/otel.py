"""OpenTelemetry: one span per finished request, its timeline as attributes and events.

Owns the tracer (opentelemetry-sdk, a TracerProvider of its own, never the global one),
its export (OTLP over HTTP/protobuf to `--otlp-traces-endpoint`, batched by the SDK's
BatchSpanProcessor; tests hand in an exporter), and the span of a request timeline
(treadle.engine.timeline): named `llm_request` as vLLM names it, SERVER kind, from
arrival to finish, with vLLM's `gen_ai.*` attributes (request id, model, max tokens,
usage, time in queue, time to first token, e2e) and treadle's own (tenant, priority,
cached tokens, chunk and preemption counts), and one event per scheduled chunk,
preemption (with its kind) and the first token, each at its own time. A request that
came with a W3C `traceparent` header becomes a child of the caller's span.

The engine thread only enqueues finished timelines (`on_finish`); a thread of this
module builds the spans. Imported only when an endpoint is configured (install with
`pip install 'treadle[otel]'`). It decides nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from urllib.parse import urlsplit, urlunsplit

try:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP/HTTP "
                      "exporter: pip install 'treadle[otel]'") from exc

logger = logging.getLogger(__name__)

MAX_PARENTS = 10_000
"""traceparent headers remembered for requests in flight (oldest dropped beyond)."""
MAX_EVENTS = 4096
"""Events one span keeps (the SDK's default of 128 would cut long timelines short)."""


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: the endpoint as given, or with /v1/traces when it names
    no path (as OTEL_EXPORTER_OTLP_ENDPOINT is read)."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        parts = parts._replace(path="/v1/traces")
    return urlunsplit(parts)


class RequestSpans:
    """Turns finished request timelines into spans and exports them."""

    def __init__(self, endpoint: str | None, model_name: str, wall_offset: float,
                 exporter=None, service_name: str = "treadle") -> None:
        """`exporter`: a SpanExporter to use instead of OTLP/HTTP (exported span by span:
        tests); `wall_offset`: time.time() - time.monotonic() of the timelines' clock."""
        self.model_name, self.wall_offset = model_name, wall_offset
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint)))
        else:
            processor = SimpleSpanProcessor(exporter)
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            span_limits=SpanLimits(max_events=MAX_EVENTS), shutdown_on_exit=False)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("treadle")
        self._propagator = TraceContextTextMapPropagator()
        self._parents: OrderedDict[str, dict] = OrderedDict()
        self._parents_lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="treadle-otel", daemon=True)
        self._thread.start()
        self._closed = False

    def note_parent(self, request_id: str, headers) -> None:
        """Remember the caller's trace context (W3C traceparent / tracestate) of a user
        request, for its span's parent."""
        traceparent = headers.get("traceparent")
        if not traceparent:
            return
        carrier = {"traceparent": traceparent}
        if headers.get("tracestate"):
            carrier["tracestate"] = headers["tracestate"]
        with self._parents_lock:
            self._parents[request_id] = carrier
            while len(self._parents) > MAX_PARENTS:
                self._parents.popitem(last=False)

    def on_finish(self, timeline) -> None:
        """A finished RequestTimeline (called on the engine thread: only enqueues)."""
        self._queue.put(timeline)

    def _run(self) -> None:
        while True:
            timeline = self._queue.get()
            if timeline is None:
                return
            try:
                self.emit(timeline)
            except Exception:  # noqa: BLE001 - a span lost, never the exporter thread
                logger.exception("could not make the span of request %s",
                                 timeline.request_id)

    def _parent_context(self, timeline):
        key = timeline.parent_id or timeline.request_id
        with self._parents_lock:
            carrier = self._parents.get(key)
            if carrier is not None and key == timeline.request_id:
                del self._parents[key]
        if carrier is None:
            return None
        return self._propagator.extract(carrier)

    def _ns(self, t: float) -> int:
        return int((t + self.wall_offset) * 1e9)

    def emit(self, timeline) -> None:
        """The span of one finished timeline (on the exporter thread)."""
        d = timeline.to_dict(self.wall_offset)
        attributes = {
            "gen_ai.request.id": d["id"],
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.max_tokens": d["max_tokens"],
            "gen_ai.usage.prompt_tokens": d["num_prompt_tokens"],
            "gen_ai.usage.completion_tokens": d["num_output_tokens"],
            "treadle.tenant": d["tenant"] or "",
            "treadle.priority": d["priority"],
            "treadle.finish_reason": d["finish_reason"] or "",
            "treadle.num_cached_tokens": d["num_cached_tokens"],
            "treadle.num_prefill_chunks": d["num_prefill_chunks"],
            "treadle.num_decode_steps": d["num_decode_steps"],
            "treadle.num_preemptions": d["num_preemptions"],
        }
        if d["parent_id"] is not None:
            attributes["treadle.parent_id"] = d["parent_id"]
        for key, name in (("queue_wait_s", "gen_ai.latency.time_in_queue"),
                          ("ttft_s", "gen_ai.latency.time_to_first_token"),
                          ("e2e_s", "gen_ai.latency.e2e"),
                          ("first_scheduled_step", "treadle.first_scheduled_step"),
                          ("first_token_step", "treadle.first_token_step"),
                          ("finish_step", "treadle.finish_step")):
            if d[key] is not None:
                attributes[name] = d[key]
        end = timeline.finish[1] if timeline.finish else timeline.arrival
        span = self.tracer.start_span("llm_request", context=self._parent_context(timeline),
                                      kind=SpanKind.SERVER, attributes=attributes,
                                      start_time=self._ns(timeline.arrival))
        for c in timeline.chunks:
            span.add_event(f"treadle.{c.kind}", timestamp=self._ns(c.t_start), attributes={
                "step": c.first_step, "last_step": c.last_step, "num_steps": c.num_steps,
                "num_tokens": c.num_tokens, "duration_s": round(c.t_end - c.t_start, 6)})
        for step, t, kind in timeline.preemptions:
            span.add_event("treadle.preempted", timestamp=self._ns(t),
                           attributes={"step": step, "kind": kind})
        if timeline.first_token is not None:
            span.add_event("treadle.first_token", timestamp=self._ns(timeline.first_token[1]),
                           attributes={"step": timeline.first_token[0]})
        if d["finish_reason"] == "error":
            span.set_status(Status(StatusCode.ERROR, "the engine ended the request"))
        span.end(end_time=self._ns(end))

    def shutdown(self) -> None:
        """Export what is queued and stop (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=10)
        self.provider.shutdown()


"""Seeing the engine work, over HTTP: the live dashboard, request timelines, OTLP spans.

Owns the routes (two route tables) and their wiring to the engine's StepRecorder
(treadle.engine.timeline), which `install_observability` asks the engine for when any of
them is on, and keeps on the serving object (server/serving.py):

- `GET /dashboard`: one static HTML page (treadle/server/static/dashboard.html; plain
  canvas, no library, no network beyond this server), off with `--no-dashboard`;
- `GET /dashboard/events`: server-sent events every `dashboard_interval` seconds, one
  JSON object each (treadle.server.dashboard_data builds it from copies the recorder
  hands out, so the engine thread never waits for a viewer);
- `GET /v1/requests/{id}` and, for the page, `GET /dashboard/requests/{id}`: a request's
  timeline (live, or among the last `request_timelines` finished); another tenant's id
  answers 404, exactly as an unknown one;
- with `--otlp-traces-endpoint`, one span per finished request (treadle.server.otel,
  imported only then).

Keys: every route here needs the same API key as /v1 (server/middleware.py; the
/dashboard paths also take the key as a Basic-auth password, so a browser can ask for
it). It decides nothing about scheduling and never calls into the engine thread.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from pydantic import BaseModel

from treadle.server.dashboard_data import Viewer, build_event
from treadle.server.errors import APIError, quoted
from treadle.server.routes import Route, add_routes
from treadle.server.serving import OpenAIServing, serving_of

_PAGE = Path(__file__).parent / "static" / "dashboard.html"


class TimelineChunk(BaseModel):
    kind: str
    """prefill (a prompt chunk, or recomputing after a preemption) or decode (a run of
    consecutive decode steps)."""
    first_step: int
    last_step: int
    num_steps: int
    num_tokens: int
    start_s: float
    end_s: float


class TimelinePreemption(BaseModel):
    step: int
    kind: str
    """swap or recompute."""
    at_s: float


class RequestTimelineBody(BaseModel):
    id: str
    parent_id: Optional[str]
    tenant: Optional[str]
    priority: int
    status: str
    finish_reason: Optional[str]
    num_prompt_tokens: int
    num_cached_tokens: int
    max_tokens: int
    num_output_tokens: int
    arrival_time: float
    queue_wait_s: Optional[float]
    first_scheduled_step: Optional[int]
    ttft_s: Optional[float]
    first_token_step: Optional[int]
    e2e_s: Optional[float]
    finish_step: Optional[int]
    num_prefill_chunks: int
    num_decode_steps: int
    num_preemptions: int
    chunks: list[TimelineChunk]
    preemptions: list[TimelinePreemption]


class RequestTimelines(BaseModel):
    """A user request's timelines: one per engine request (its n samples, or the prompts
    of a batched completion). Times are seconds since the request's arrival."""

    id: str
    object: str = "request.timeline"
    requests: list[RequestTimelineBody]


def _timelines(request: Request, request_id: str) -> dict:
    """The caller's timelines of a request id; 404 (as for an unknown id) otherwise."""
    serving = serving_of(request)
    tenant = serving.authenticate(request)
    found = [t for t in serving.step_recorder.timelines_of(request_id) if t["tenant"] == tenant]
    if not found:
        raise APIError(404, f"no timeline of request {quoted(request_id)}: unknown, another "
                       f"tenant's, or finished longer ago than the last "
                       f"{serving.config.request_timelines} requests (request_timelines)",
                       kind="not_found_error")
    return {"id": request_id, "object": "request.timeline", "requests": found}


async def _events(serving: OpenAIServing, viewer: Viewer) -> AsyncIterator[str]:
    """One dashboard event every dashboard_interval seconds until shutdown."""
    engine = serving.engine
    max_num_seqs = engine.config.scheduler.max_num_seqs
    while not serving.shutting_down:
        event = build_event(viewer, serving.step_recorder, engine.metrics,
                            engine.tenant_weights, max_num_seqs)
        yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        await asyncio.sleep(serving.config.dashboard_interval)


async def request_timeline(request_id: str, request: Request):
    """The timeline of one of the caller's requests: arrival, queue wait, each
    scheduled chunk with its step, preemptions with their kind, first token, finish."""
    return _timelines(request, request_id)


async def dashboard_request_timeline(request_id: str, request: Request):
    """GET /v1/requests/{id} for the page (the key as Bearer or as a Basic password)."""
    return _timelines(request, request_id)


async def dashboard(request: Request):
    """The live dashboard: one static HTML page, no library, no network beyond this
    server (docs/dashboard.md)."""
    serving_of(request).authenticate(request)
    return HTMLResponse(_PAGE.read_text(encoding="utf-8"),
                        headers={"Cache-Control": "no-cache"})


async def dashboard_events(request: Request):
    """Server-sent events, one JSON object every dashboard_interval seconds until the
    client leaves or the server shuts down (the format: docs/dashboard.md)."""
    serving = serving_of(request)
    tenant = serving.authenticate(request)
    viewer = Viewer(tenant if serving.keyring.enabled else None)
    return StreamingResponse(_events(serving, viewer), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


TIMELINE_ROUTES = (
    Route("GET", "/v1/requests/{request_id}", request_timeline, response_model=RequestTimelines),
)
"""On whenever the engine records steps."""
DASHBOARD_ROUTES = (
    Route("GET", "/dashboard/requests/{request_id}", dashboard_request_timeline,
          response_model=RequestTimelines),
    Route("GET", "/dashboard", dashboard, HTMLResponse),
    Route("GET", "/dashboard/events", dashboard_events, StreamingResponse),
)
"""The page, its events and its timeline route: on unless --no-dashboard."""


def install_observability(app: FastAPI, serving: OpenAIServing) -> None:
    """Ask the engine for a step recorder and add the routes, when any is on; the OTLP
    exporter too (its spans flushed at shutdown). Sets the serving object's
    step_recorder and request_spans (None without an endpoint), which it tells the
    traceparent of each request."""
    config, engine = serving.config, serving.engine
    if not (config.dashboard or config.request_timelines or config.otlp_traces_endpoint):
        return
    recorder = engine.record_steps(config.recorded_steps, config.request_timelines)
    serving.step_recorder = recorder
    if config.otlp_traces_endpoint:
        from treadle.server.otel import RequestSpans  # opentelemetry: imported only here

        spans = RequestSpans(config.otlp_traces_endpoint, engine.model_name,
                             recorder.wall_offset)
        recorder.add_finish_listener(spans.on_finish)
        serving.request_spans = spans
        app.router.on_shutdown.append(spans.shutdown)
    add_routes(app, TIMELINE_ROUTES)
    if config.dashboard:
        add_routes(app, DASHBOARD_ROUTES)

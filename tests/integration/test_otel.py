"""OpenTelemetry spans of request timelines: through the SDK's in-memory exporter on an
offline run (every span against its timeline), and through `treadle serve
--otlp-traces-endpoint` into an OTLP/HTTP collector in this process (protobuf decoded
with opentelemetry-proto), a caller's traceparent honoured; without the flag nothing of
the OpenTelemetry SDK is imported."""

from __future__ import annotations

import gzip
import http.server
import os
import signal
import subprocess
import sys
import threading
import zlib

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter)

from server_fixtures import TINY_DEMO, running_server  # noqa: E402
from test_timelines import run as run_offline  # noqa: E402
from treadle.models.demo import write_demo_model  # noqa: E402
from treadle.server.otel import RequestSpans, traces_url  # noqa: E402



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama-otel"), "llama")


def test_one_span_per_request_carries_its_timeline(model_dir, tmp_path):
    exporter = InMemorySpanExporter()
    spans_of: dict = {}
    timelines: dict = {}

    def attach(recorder):
        spans = RequestSpans(None, "tiny", recorder.wall_offset, exporter=exporter)
        spans_of["it"] = spans
        spans.note_parent("user-3", {"traceparent":
                                     "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
        recorder.add_finish_listener(spans.on_finish)
        recorder.add_finish_listener(lambda t: timelines.__setitem__(t.request_id, t))

    recorder, stats, _ = run_offline(model_dir, tmp_path / "t.jsonl", "swap",
                                     on_recorder=attach)
    spans_of["it"].shutdown()
    finished = exporter.get_finished_spans()
    assert len(finished) == len(timelines) == 15
    assert stats["num_preemptions"] > 0
    seen_preempted = 0
    for span in finished:
        a = span.attributes
        rid = a["gen_ai.request.id"]
        t = recorder.timeline(rid)
        timeline = timelines[rid]
        assert span.name == "llm_request"
        assert a["gen_ai.response.model"] == "tiny"
        assert a["gen_ai.usage.prompt_tokens"] == t["num_prompt_tokens"]
        assert a["gen_ai.usage.completion_tokens"] == t["num_output_tokens"] == t["max_tokens"]
        assert a["gen_ai.latency.time_in_queue"] == t["queue_wait_s"]
        assert a["gen_ai.latency.time_to_first_token"] == t["ttft_s"]
        assert a["gen_ai.latency.e2e"] == t["e2e_s"]
        assert a["treadle.num_preemptions"] == len(t["preemptions"])
        assert a["treadle.parent_id"] == f"user-{rid}"
        assert a["treadle.tenant"] == t["tenant"] and a["treadle.finish_reason"] == "length"
        # arrival to finish, on the wall clock, to the microsecond the timeline keeps
        assert abs(span.start_time / 1e9 - t["arrival_time"]) < 1e-5
        assert abs((span.end_time - span.start_time) / 1e9 - t["e2e_s"]) < 1e-5
        events = [(e.name, dict(e.attributes)) for e in span.events]
        chunks = [e for e in events if e[0] in ("treadle.prefill", "treadle.decode")]
        assert [(n[len("treadle."):], e["step"], e["num_tokens"]) for n, e in chunks] == [
            (c["kind"], c["first_step"], c["num_tokens"]) for c in t["chunks"]]
        preempted = [e for n, e in events if n == "treadle.preempted"]
        assert [(e["step"], e["kind"]) for e in preempted] == [
            (p["step"], p["kind"]) for p in t["preemptions"]]
        seen_preempted += len(preempted)
        first = [e for n, e in events if n == "treadle.first_token"]
        assert first == [{"step": t["first_token_step"]}]
        stamps = {e.name: e.timestamp for e in span.events}
        assert span.start_time <= stamps["treadle.first_token"] <= span.end_time
        assert timeline.finished
    assert seen_preempted == stats["num_preemptions"]
    child = next(s for s in finished if s.attributes["gen_ai.request.id"] == "3")
    assert child.context.trace_id == 0x0af7651916cd43dd8448eb211c80319c
    assert child.parent is not None and child.parent.span_id == 0xb7ad6b7169203331
    others = [s for s in finished if s is not child]
    assert all(s.parent is None for s in others)
    assert len({s.context.trace_id for s in others}) == len(others)


def test_traces_url_adds_the_otlp_path_only_when_none_is_given():
    assert traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("http://127.0.0.1:4318/") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"


class _Collector(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace collector on 127.0.0.1: POST /v1/traces, protobuf bodies."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        self.spans: list = []
        self.paths: list[str] = []
        self.pb2 = trace_service_pb2
        collector = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                message = collector.pb2.ExportTraceServiceRequest()
                message.ParseFromString(body)
                collector.paths.append(self.path)
                for resource_spans in message.resource_spans:
                    service = {kv.key: kv.value.string_value
                               for kv in resource_spans.resource.attributes}
                    for scope_spans in resource_spans.scope_spans:
                        for span in scope_spans.spans:
                            collector.spans.append((service, span))
                reply = collector.pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)


def _value(attribute):
    v = attribute.value
    return {"string_value": v.string_value, "int_value": v.int_value,
            "double_value": v.double_value, "bool_value": v.bool_value}[v.WhichOneof("value")]


def test_served_requests_reach_an_otlp_collector(tmp_path):
    demo = str(write_demo_model(tmp_path / "m", seed=5, config_overrides=TINY_DEMO))
    collector = _Collector()
    thread = threading.Thread(target=collector.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"  # the path is added
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # export within 0.2 s, not 5 s
    try:
        with running_server(demo, "--num-kv-blocks", "64", "--no-dashboard",
                            "--otlp-traces-endpoint", endpoint) as (base, proc):
            ids = []
            for i in range(3):
                headers = {}
                if i == 1:
                    headers["traceparent"] = ("00-4bf92f3577b34da6a3ce929d0e0e4736-"
                                              "00f067aa0ba902b7-01")
                r = httpx.post(base + "/v1/completions", headers=headers, timeout=120,
                               json={"prompt": [5, 6, 7, 8], "max_tokens": 4 + i,
                                     "ignore_eos": True})
                assert r.status_code == 200, r.text
                ids.append(r.json()["id"])
            assert httpx.get(base + "/dashboard").status_code == 404  # --no-dashboard
            timelines = {rid: httpx.get(f"{base}/v1/requests/{rid}").json()["requests"][0]
                         for rid in ids}
            proc.send_signal(signal.SIGTERM)  # the shutdown flushes what is queued
            proc.wait(timeout=60)
    finally:
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        collector.shutdown()
    assert set(collector.paths) == {"/v1/traces"}
    spans = {next(_value(a) for a in span.attributes if a.key == "gen_ai.request.id"):
             (service, span) for service, span in collector.spans}
    assert set(spans) == set(ids)
    for i, rid in enumerate(ids):
        service, span = spans[rid]
        attributes = {a.key: _value(a) for a in span.attributes}
        t = timelines[rid]
        assert service["service.name"] == "treadle" and span.name == "llm_request"
        assert attributes["gen_ai.usage.completion_tokens"] == 4 + i
        assert attributes["gen_ai.usage.prompt_tokens"] == 4
        assert attributes["gen_ai.response.model"] == "tiny"
        assert attributes["treadle.tenant"] == "default"
        assert [e.name for e in span.events].count("treadle.first_token") == 1
        assert sum(1 for e in span.events if e.name in ("treadle.prefill", "treadle.decode")) \
            == len(t["chunks"])
        assert abs(span.start_time_unix_nano / 1e9 - t["arrival_time"]) < 1e-5
    _, traced = spans[ids[1]]
    assert traced.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert traced.parent_span_id.hex() == "00f067aa0ba902b7"
    assert not spans[ids[0]][1].parent_span_id


def test_without_an_endpoint_opentelemetry_is_never_imported():
    """The server's modules and the wiring of a default ServerConfig import neither the
    OpenTelemetry SDK nor its exporter; with an endpoint, the wiring imports them."""
    code = """
import sys
from types import SimpleNamespace
from fastapi import FastAPI
from treadle.engine.timeline import StepRecorder
from treadle.server.auth import KeyRing
from treadle.server.config import ServerConfig
from treadle.server.dashboard import install_observability
from treadle.server.serving import OpenAIServing
import treadle.server.api, treadle.server.serve
app = FastAPI()
scheduler = SimpleNamespace(max_num_seqs=4, scheduling_policy="fcfs", priority_aging=0.0,
                            max_num_batched_tokens=256)
from treadle.engine.limits import EngineLimits
limits = EngineLimits(vocab_size=100, max_model_len=64, num_kv_tokens=1024, block_size=16)
engine = SimpleNamespace(config=SimpleNamespace(scheduler=scheduler), limits=limits,
                         tokenizer=None, model_name="m", generate=lambda *args, **kwargs: None,
                         record_steps=lambda s, f: StepRecorder(None, s, f))
serving = OpenAIServing(engine, ServerConfig(otlp_traces_endpoint=sys.argv[1] or None),
                        KeyRing({}))
install_observability(app, serving)
assert serving.step_recorder is not None
assert (serving.request_spans is not None) == bool(sys.argv[1])
# (FastAPI itself imports the opentelemetry API package when installed: not counted)
print(any(m.startswith(("opentelemetry.sdk", "opentelemetry.exporter", "treadle.server.otel"))
          for m in sys.modules))
if serving.request_spans is not None:
    serving.request_spans.shutdown()
"""
    for endpoint, imported in (("", "False"), ("http://127.0.0.1:9/v1/traces", "True")):
        out = subprocess.run([sys.executable, "-c", code, endpoint], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == imported

"""`treadle bench dashboard`: what watching the engine costs.

Owns two measurements:

- `recorder_cost`: microseconds the engine thread spends in the StepRecorder per step
  (treadle.engine.timeline) at 1 .. 256 scheduled requests, and what building one
  dashboard event of a second's steps costs a reader — no model, the real messages.
- `served_cost`: the engine-core workload (treadle.measure.workloads.synthetic) served over
  HTTP by two `treadle serve` processes launched side by side with the same options, one
  with the recorder off (`--no-dashboard --request-timelines 0`) and one with its
  defaults, loaded in turn — off, on with nobody watching, on with a dashboard open (a
  client reading /dashboard/events, or headless Chromium showing /dashboard) — the order
  rotated each repeat so that drift on a shared machine hits each alike.

It reports what it measured (medians, ratios against "off"); it decides nothing.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from types import SimpleNamespace

from treadle.core.outputs import EngineCoreOutput, ScheduledRequest, SchedulerOutput
from treadle.engine.timeline import StepRecorder
from treadle.request import Request, RequestStatus
from treadle.sampling_params import SamplingParams

SYSTEMS = ("off", "on", "open")
"""Recorder off; recorder on, no viewer; recorder on, a dashboard open."""


class _FakeScheduler:
    """What the recorder reads of a scheduler (counts, KV usage, prefix statistics)."""

    def __init__(self, requests: dict) -> None:
        self.requests = requests
        self.num_running, self.num_waiting, self.num_swapped = len(requests), 0, 0
        self.kv = SimpleNamespace(usage=0.5, prefix_stats=SimpleNamespace(
            num_queried_tokens=0, num_hit_tokens=0))


def recorder_cost(batch_sizes=(1, 16, 64, 256), num_steps: int = 2000) -> list[dict]:
    """Per batch size: µs per step in record_scheduled + record_step (decode steps, one
    token each, no preemption), and ms to build and encode one event of 1 s of steps
    (10 steps/s) for one viewer."""
    from treadle.metrics import EngineMetrics
    from treadle.server.dashboard_data import Viewer, build_event

    rows = []
    for n in batch_sizes:
        requests = {}
        for i in range(n):
            r = Request(f"cmpl-{i:032x}", [1] * 100, SamplingParams(max_tokens=10_000),
                        tenant=f"t{i % 2}")
            r.status = RequestStatus.RUNNING
            requests[r.request_id] = r
        scheduler = _FakeScheduler(requests)
        recorder = StepRecorder(scheduler, max_steps=2048, max_finished=1000)
        for r in requests.values():
            recorder.record_arrival(r)
        outputs_of = [[EngineCoreOutput(rid, [7]) for rid in requests]]
        messages = [SchedulerOutput([ScheduledRequest(rid, 100 + s, 1, is_decoding=True)
                                     for rid in requests]) for s in range(8)]
        t0 = time.perf_counter()
        for step in range(num_steps):
            out = messages[step % 8]
            recorder.record_scheduled(step, out)
            recorder.record_step(step, 0.0, 0.01, out, outputs_of[0])
        per_step_us = (time.perf_counter() - t0) / num_steps * 1e6
        metrics = EngineMetrics("bench")
        viewer = Viewer(None, last_seq=recorder.last_seq - 10)
        t0 = time.perf_counter()
        for _ in range(20):
            viewer.last_seq = recorder.last_seq - 10
            json.dumps(build_event(viewer, recorder, metrics, {}, 256), separators=(",", ":"))
        event_ms = (time.perf_counter() - t0) / 20 * 1e3
        rows.append({"scheduled_requests": n, "recorder_us_per_step": round(per_step_us, 1),
                     "event_ms_per_second_of_steps": round(event_ms, 2)})
    return rows


class SSEViewer:
    """A dashboard client: reads /dashboard/events in a thread until stopped."""

    def __init__(self, base: str, api_key: str | None = None) -> None:
        self.base, self.api_key = base, api_key
        self.events = self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.stream("GET", self.base + "/dashboard/events", headers=headers,
                          timeout=None) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events += 1
                    self.bytes += len(line)
                if self._stop.is_set():
                    return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class BrowserViewer:
    """A dashboard open in headless Chromium (treadle.bench.headless_browser)."""

    def __init__(self, base: str, api_key: str | None = None) -> None:
        self.base, self.api_key = base, api_key
        self.events = self.bytes = 0

    def __enter__(self):
        from treadle.bench.headless_browser import HeadlessChromium

        self._browser = HeadlessChromium()
        if self.api_key:
            self._browser.set_headers({"Authorization": f"Bearer {self.api_key}"})
        self._browser.navigate(self.base + "/dashboard")
        self._browser.wait_for("window.dashboard && dashboard.events >= 1", 60)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.events = self._browser.evaluate("dashboard.events")
        finally:
            self._browser.close()


def served_cost(serve_options: list[str], num_requests: int = 64, repeats: int = 3,
                viewer: str = "sse", seed: int = 0, max_model_len: int = 2048,
                progress: bool = False, on_first: bool = False) -> dict:
    """Throughput of the engine-core workload served with the recorder off, on, and on
    with a dashboard open; see the module docstring. `on_first` launches the server with
    the recorder before the one without (to tell a launch-order effect from the
    recorder's)."""
    import contextlib

    from treadle.measure import workloads
    from treadle.measure.launch import launched_server
    from treadle.measure.http_load import run_load, served_model, summarize

    viewer_type = {"sse": SSEViewer, "browser": BrowserViewer}[viewer]
    runs: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    with contextlib.ExitStack() as stack:
        launches = {"off": [*serve_options, "--no-dashboard", "--request-timelines", "0"],
                    "on": serve_options}
        urls = {name: stack.enter_context(launched_server(launches[name]))[0]
                for name in (("on", "off") if on_first else ("off", "on"))}
        off_url, on_url = urls["off"], urls["on"]
        card = served_model(on_url)
        workload = workloads.synthetic(num_requests=num_requests, seed=seed,
                                       max_model_len=max_model_len,
                                       vocab_size=card.get("vocab_size") or 49152,
                                       num_long=min(4, num_requests))
        for repeat in range(repeats):
            order = SYSTEMS[repeat % 3:] + SYSTEMS[:repeat % 3]
            for name in order:
                url = off_url if name == "off" else on_url
                watch = viewer_type(url) if name == "open" else contextlib.nullcontext()
                with watch as v:
                    results, duration = asyncio.run(run_load(
                        url, workload, card["id"], seed=seed, progress=progress))
                summary = summarize(results, duration)
                if summary["num_failed"]:
                    raise RuntimeError(f"{name}: {summary['num_failed']} requests failed: "
                                       f"{summary['errors']}")
                runs[name].append({"repeat": repeat, "order": order.index(name),
                                   "output_tokens_per_s": summary["output_tokens_per_s"],
                                   "total_tokens_per_s": summary["total_tokens_per_s"],
                                   "duration_s": duration,
                                   "viewer_events": getattr(v, "events", None),
                                   "viewer_bytes": getattr(v, "bytes", None)})
                print(f"repeat {repeat} {name:>4}: {summary['output_tokens_per_s']:.1f} "
                      f"output tok/s in {duration:.1f} s", flush=True)
    medians = {name: statistics.median(r["output_tokens_per_s"] for r in rs)
               for name, rs in runs.items()}
    tps = {name: [r["output_tokens_per_s"] for r in rs] for name, rs in runs.items()}
    return {"workload": workload.description | {"name": workload.name},
            "serve_options": serve_options, "viewer": viewer, "repeats": repeats,
            "launched_first": "on" if on_first else "off",
            "runs": runs, "median_output_tokens_per_s": medians,
            "ratio_to_off": {name: medians[name] / medians["off"] for name in SYSTEMS},
            "ratio_open_to_on": medians["open"] / medians["on"],
            "per_repeat_open_to_on": [o / n for o, n in zip(tps["open"], tps["on"])],
            "per_repeat_on_to_off": [n / f for n, f in zip(tps["on"], tps["off"])]}

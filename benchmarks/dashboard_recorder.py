"""What the dashboard's step recorder costs the engine thread, per step, with no model:
`python benchmarks/dashboard_recorder.py [--output FILE]` (docs/dashboard.md).

Owns `recorder_cost`: microseconds the engine thread spends in the StepRecorder per step
(treadle/engine/timeline.py) at 1 .. 256 scheduled requests, and what building one
dashboard event of a second's steps costs a reader — no model, the real messages (a
stand-in scheduler holds the requests the recorder reads). It reaches into the engine's
and the server's internals (the recorder, the step messages, the dashboard's event
builder), which is why it stands here and not in treadle/bench; the served side of the
same question is `treadle bench dashboard`. It reports what it measured; nothing here is
a target.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from treadle.core.outputs import EngineCoreOutput, ScheduledRequest, SchedulerOutput
from treadle.engine.timeline import StepRecorder
from treadle.measure.report import environment, format_table, write_json
from treadle.request import Request, RequestStatus
from treadle.sampling_params import SamplingParams


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/dashboard_recorder.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=None,
                        help="JSON result (default results/dashboard_recorder.json)")
    args = parser.parse_args(argv)
    result = {"recorder": recorder_cost()}
    print(format_table(result["recorder"], ["scheduled_requests", "recorder_us_per_step",
                                            "event_ms_per_second_of_steps"]))
    result["environment"] = environment()
    print("wrote", write_json(args.output or Path("results") / "dashboard_recorder.json",
                              result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The timeline picture of a per-step trace (`treadle trace plot FILE`).

Owns turning a trace (treadle.engine.trace) into per-request segments and drawing them:
one row per request in arrival order, time to the right, each stretch coloured by what
the request was doing: waiting (not yet started, or running but given no tokens in a
step), prefill (prompt chunks and recomputes), decode, or preempted (its KV taken away
until it runs again). It is the picture of continuous and out-of-order batching.
Must not: run the engine, or need anything beyond matplotlib (Agg backend, no display).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from treadle.engine.trace import Trace, read_trace

COLOURS = {
    "waiting": "#cfcfcf",
    "prefill": "#1f77b4",
    "decode": "#2ca02c",
    "preempted": "#d62728",
}


@dataclass(frozen=True)
class Segment:
    """One stretch of one request's timeline."""

    request_id: str
    state: str
    """waiting, prefill, decode or preempted."""
    start: float
    end: float


def timeline(trace: Trace) -> dict[str, list[Segment]]:
    """Segments per request, requests in arrival order (then order of first appearance).

    A request's bar for step k spans from that step's start to the next step's start
    (or its own end for the last step), so consecutive steps join without gaps.
    """
    steps = trace.steps
    starts = [s.t_start for s in steps]

    def span_end(index: int) -> float:
        return starts[index + 1] if index + 1 < len(steps) else steps[index].t_end

    runs: dict[str, list[tuple[int, str]]] = {}
    preempted_at: dict[str, list[int]] = {}
    for index, step in enumerate(steps):
        for request_id, _num_tokens, kind in step.scheduled:
            runs.setdefault(request_id, []).append((index, kind))
        for request_id in step.preempted:
            preempted_at.setdefault(request_id, []).append(index)

    order = list(trace.arrivals) + [rid for rid in runs if rid not in trace.arrivals]
    result: dict[str, list[Segment]] = {}
    for request_id in order:
        segments: list[Segment] = []
        request_runs = runs.get(request_id, [])
        arrival = trace.arrivals.get(request_id)
        if request_runs:
            first = starts[request_runs[0][0]]
            if arrival is not None and arrival.t < first:
                segments.append(Segment(request_id, "waiting", arrival.t, first))
        preemptions = preempted_at.get(request_id, [])
        previous: int | None = None
        for index, kind in request_runs:
            if previous is not None and index > previous + 1:
                gap_state = ("preempted" if any(previous < p <= index for p in preemptions)
                             else "waiting")
                segments.append(Segment(request_id, gap_state, starts[previous + 1],
                                        starts[index]))
            segments.append(Segment(request_id, kind, starts[index], span_end(index)))
            previous = index
        if previous is not None and any(p > previous for p in preemptions):
            end = trace.ends.get(request_id, (steps[-1].t_end, ""))[0]
            segments.append(Segment(request_id, "preempted", starts[previous + 1], end))
        if not request_runs and arrival is not None and steps:
            end = trace.ends.get(request_id, (steps[-1].t_end, ""))[0]
            segments.append(Segment(request_id, "waiting", arrival.t, max(end, arrival.t)))
        result[request_id] = _merge(segments)
    return result


def _merge(segments: list[Segment]) -> list[Segment]:
    """Join touching segments of the same state (fewer rectangles to draw)."""
    merged: list[Segment] = []
    for seg in segments:
        if merged and merged[-1].state == seg.state and abs(merged[-1].end - seg.start) < 1e-9:
            merged[-1] = Segment(seg.request_id, seg.state, merged[-1].start, seg.end)
        else:
            merged.append(seg)
    return merged


def plot_trace(trace_path: str | Path, png_path: str | Path | None = None,
               max_rows: int = 400, title: str | None = None) -> Path:
    """Draw the trace as a timeline PNG; returns its path (FILE.png next to the trace
    when not given). Only the first `max_rows` requests are drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    trace_path = Path(trace_path)
    png_path = Path(png_path) if png_path is not None else trace_path.with_suffix(".png")
    trace = read_trace(trace_path)
    rows = list(timeline(trace).items())[:max_rows]
    height = min(40.0, 1.5 + 0.22 * max(len(rows), 4))
    fig, ax = plt.subplots(figsize=(12, height))
    for row, (request_id, segments) in enumerate(rows):
        for state in COLOURS:
            spans = [(s.start, s.end - s.start) for s in segments if s.state == state]
            if spans:
                ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLOURS[state],
                               linewidth=0)
    labels = []
    for request_id, _ in rows:
        arrival = trace.arrivals.get(request_id)
        extra = ""
        if arrival is not None and (arrival.priority or arrival.tenant):
            extra = f" p{arrival.priority}" + (f" {arrival.tenant}" if arrival.tenant else "")
        labels.append(request_id + extra)
    if len(rows) <= 80:
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(labels, fontsize=7)
    else:
        ax.set_ylabel("request (arrival order)")
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("seconds")
    num_tokens = sum(trace.tokens_by_request().values())
    ax.set_title(title or f"{trace_path.name}: policy {trace.policy}, {len(trace.steps)} steps, "
                 f"{len(trace.arrivals)} requests, {num_tokens} tokens", loc="left", fontsize=10)
    ax.legend(handles=[Patch(color=c, label=s) for s, c in COLOURS.items()],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncol=4, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path

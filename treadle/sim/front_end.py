"""The latency a served request spends outside the engine, measured on a real run.

A client's TTFT runs from its send to its first streamed token; the engine's (what a
trace and the simulator see) from the request's arrival at the engine to the end of the
step that produced that token. Between them lie the server's front end: the HTTP request
read and validated, the prompt tokenized, the request handed to the engine thread, and
the first token detokenized and written as an SSE chunk. On a 2-core CPU host that was
10-15 ms per request (round 16, docs/simulator.md): at a TTFT p50 of ~100 ms, a bias the
simulator must carry to predict what clients measure (`SimConfig.front_end_ms`, which
the fleet adds before each request reaches its replica).

Owns `front_end_seconds`: a served run's trace (engine arrivals and steps) against the
load generator's per-request records of the same run (`requests` of a `treadle bench
serve` result), matched by send order, and the median of the per-request differences.
Must not: run anything.
"""

from __future__ import annotations

import statistics

from treadle.engine.trace import Trace


def engine_ttfts(trace: Trace) -> list[float]:
    """Seconds from each request's arrival at the engine to the end of the step that gave
    its first token (the last prefill step before its first decode; without a decode, its
    last prefill step; a one-token prompt, scheduled as a decode from the start: its first
    step), in arrival order; requests that got no token are left out."""
    first: dict[str, float] = {}
    decoding: set[str] = set()
    for step in sorted(trace.steps, key=lambda s: s.step):
        for request_id, _, kind in step.scheduled:
            if request_id in decoding:
                continue
            if kind == "decode":
                decoding.add(request_id)
                first.setdefault(request_id, step.t_end)
            else:
                first[request_id] = step.t_end
    arrivals = sorted(trace.arrivals.values(), key=lambda a: a.t)
    return [first[a.request_id] - a.t for a in arrivals if a.request_id in first]


def front_end_seconds(trace: Trace, client_requests: list[dict]) -> dict:
    """The front end's seconds per request: the median over requests of the client's TTFT
    minus the engine's, the i-th request sent matched with the i-th to arrive at the
    engine (a median, so that two requests sent at nearly the same time and arriving
    swapped barely move it). `client_requests`: a bench serve result's `requests` (start_s,
    ttft_s, error)."""
    sent = sorted((r for r in client_requests if not r.get("error") and r.get("ttft_s")
                   is not None), key=lambda r: r["start_s"])
    engine = engine_ttfts(trace)
    n = min(len(sent), len(engine))
    if n == 0:
        raise ValueError("no request of the run has both a client TTFT and an engine one")
    if len(sent) != len(engine):
        raise ValueError(f"the run's result has {len(sent)} answered requests and its trace "
                         f"{len(engine)}: not records of the same run")
    differences = [sent[i]["ttft_s"] - engine[i] for i in range(n)]
    ordered = sorted(differences)
    return {"front_end_s": statistics.median(differences), "num_requests": n,
            "p10_s": ordered[n // 10], "p90_s": ordered[(9 * n) // 10]}

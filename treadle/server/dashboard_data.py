"""What one dashboard update carries: the engine's recent steps and figures, as one viewer
may see them.

Owns turning a StepRecorder's snapshot (treadle.engine.timeline) and the metrics registry
(treadle.metrics, the very values /metrics shows) into the JSON of one server-sent event:
gauges and totals, the prefix-cache hit rate, TTFT / TPOT percentiles over the last
minute, each tenant's share of the tokens against its share of the weights, and the new
steps (tokens split prefill / decode, batch slot efficiency = scheduled requests over
max_num_seqs, and the rows of the step timeline). A viewer who is a tenant of a keyed
server gets its own requests' rows only, and the other tenants summed as "others";
aggregate figures are everyone's. Pure functions and one small per-viewer state: no
HTTP, no engine calls beyond the recorder's and the metrics' readers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

KIND_CODES = {"prefill": 0, "decode": 1}
PREEMPTION_CODES = {"recompute": 2, "swap": 3}
"""Cell codes of the step timeline: prefill chunk, decode, preempted (recompute), swapped."""

WINDOW_S = 60.0
MAX_STEPS_PER_EVENT = 512
"""Steps one event carries at most (the first event of a viewer: the most recent ones)."""
OTHERS = "others"


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation, as numpy's default."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def latency_summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"count": len(ordered), "p50": percentile(ordered, 50),
            "p90": percentile(ordered, 90), "p99": percentile(ordered, 99)}


def window_delta(samples: list, now: float, window_s: float = WINDOW_S):
    """(oldest sample within the window, newest sample), or None with fewer than two
    samples in it: differences of cumulative counters over the last window_s seconds."""
    recent = [s for s in samples if s.t >= now - window_s]
    if len(recent) < 2:
        return None
    return recent[0], recent[-1]


def tenant_shares(samples: list, weights: dict[str, float], now: float,
                  viewer: str | None) -> list[dict]:
    """Tokens computed per tenant over the last minute, each tenant's share of them, and
    its share of the weights of the tenants that ran. `viewer` (a keyed tenant) sees
    itself and the rest summed as "others"; None sees every tenant."""
    span = window_delta(samples, now)
    if span is None:
        return []
    old, new = span
    tokens = {t: n - old.tokens_by_tenant.get(t, 0) for t, n in new.tokens_by_tenant.items()}
    tokens = {t: n for t, n in tokens.items() if n > 0}
    total = sum(tokens.values())
    if not total:
        return []
    weight = {t: weights.get(t, 1.0) for t in tokens}
    total_weight = sum(weight.values())
    rows = [{"tenant": t if t is not None else "(none)", "tokens": n, "share": n / total,
             "weight": weight[t], "weight_share": weight[t] / total_weight}
            for t, n in sorted(tokens.items(), key=lambda item: -item[1])]
    if viewer is None:
        return rows
    mine = [r for r in rows if r["tenant"] == viewer]
    rest = [r for r in rows if r["tenant"] != viewer]
    if rest:
        mine.append({"tenant": OTHERS, "tokens": sum(r["tokens"] for r in rest),
                     "share": sum(r["share"] for r in rest), "weight": None,
                     "weight_share": sum(r["weight_share"] for r in rest)})
    return mine


@dataclass
class Viewer:
    """One open dashboard: who looks, and the last step it was sent."""

    tenant: str | None
    """Its tenant on a keyed server (its rows only); None on an open server (all rows)."""
    last_seq: int = 0


def step_rows(steps: list, viewer: Viewer, max_num_seqs: int, wall_offset: float) -> list:
    """Per step: [seq, step, start (Unix s), duration (s), prefill tokens, decode tokens,
    scheduled requests, slot efficiency, running, waiting, swapped, KV usage, cells,
    finished], cells = [request_id, tokens, code] per request the viewer may see (codes:
    KIND_CODES, PREEMPTION_CODES with tokens 0), finished = request ids."""
    tenant = viewer.tenant
    out = []
    for s in steps:
        cells = [[rid, n, KIND_CODES[kind]] for rid, n, kind, t in s.scheduled
                 if tenant is None or t == tenant]
        cells += [[rid, 0, PREEMPTION_CODES[kind]] for rid, kind, t in s.preempted
                  if tenant is None or t == tenant]
        visible = {c[0] for c in cells} if tenant is not None else None
        finished = [rid for rid, _ in s.finished if visible is None or rid in visible]
        out.append([s.seq, s.step, round(s.t_start + wall_offset, 4),
                    round(s.t_end - s.t_start, 5), s.num_prefill_tokens, s.num_decode_tokens,
                    len(s.scheduled), round(len(s.scheduled) / max_num_seqs, 4),
                    s.num_running, s.num_waiting, s.num_swapped, round(s.kv_usage, 4),
                    cells, finished])
    return out


def build_event(viewer: Viewer, recorder, metrics, weights: dict[str, float],
                max_num_seqs: int, clock=time.monotonic) -> dict:
    """The next event for this viewer (advances its last step)."""
    now = clock()
    steps = recorder.steps_after(viewer.last_seq, MAX_STEPS_PER_EVENT)
    if steps:
        viewer.last_seq = steps[-1].seq
    else:
        viewer.last_seq = max(viewer.last_seq, 0)
    snapshot = metrics.snapshot()

    def value(name: str) -> float:
        return snapshot.get(name, 0.0)

    queried = value("prefix_cache_queries_total")
    hits = value("prefix_cache_hits_total")
    samples = recorder.samples()
    span = window_delta(samples, now)
    hit_rate_1m = None
    if span is not None:
        q = span[1].prefix_queried_tokens - span[0].prefix_queried_tokens
        hit_rate_1m = (span[1].prefix_hit_tokens - span[0].prefix_hit_tokens) / q if q else None
    return {
        "t": round(time.time(), 3),
        "max_num_seqs": max_num_seqs,
        "viewer": viewer.tenant,
        "gauges": {"running": value("num_requests_running"),
                   "waiting": value("num_requests_waiting"),
                   "swapped": value("num_requests_swapped"),
                   "kv_usage": value("kv_cache_usage_perc"),
                   "batch_slot_efficiency": value("batch_slot_efficiency")},
        "totals": {"requests_finished": value("request_success_total"),
                   "prompt_tokens": value("prompt_tokens_total"),
                   "generation_tokens": value("generation_tokens_total"),
                   "preemptions": value("num_preemptions_total"),
                   "preemptions_swap": value("num_preemptions_swap_total"),
                   "prefix_cache_queries": queried, "prefix_cache_hits": hits},
        "prefix_hit_rate": hits / queried if queried else None,
        "prefix_hit_rate_1m": hit_rate_1m,
        "latency_1m": {"ttft": latency_summary(metrics.recent_ttft.values()),
                       "tpot": latency_summary(metrics.recent_tpot.values())},
        "tenants": tenant_shares(samples, weights, now, viewer.tenant),
        "steps": step_rows(steps, viewer, max_num_seqs, recorder.wall_offset),
    }

"""A simulation's figures, in the shape of `treadle bench serve` results, and its plots.

Owns turning a FleetResult into the JSON result: the request records become
treadle.measure.http_load.RequestResult values and go through measure.http_load.summarize (so TTFT,
TPOT, ITL, E2E, throughput and goodput are defined exactly as for a measured run; ITL
percentiles come from the fleet's array of gaps, one per output), per-priority and
per-label figures as bench serve and the mixed-priority replay report them, per-replica
engine figures (steps, batch sizes, preemptions, prefix hits), the sampled time series,
and the per-request records; and the plots (latency CDFs; queue depth and KV usage over
time). `compare` sets a simulated result against a measured one. Must not: simulate.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from treadle.measure.report import percentiles
from treadle.measure.http_load import RequestResult, request_records, summarize
from treadle.sim.fleet import FleetResult


def request_results(result: FleetResult) -> list[RequestResult]:
    out = []
    for record in result.records:
        sim = record.request
        ok = record.error is None and record.first_token is not None
        out.append(RequestResult(
            ok=ok, start=sim.arrival, prompt_tokens=sim.prompt_len,
            output_tokens=record.num_tokens,
            ttft=record.first_token - sim.arrival if ok else None,
            e2e=record.last_token - sim.arrival if ok else None,
            priority=sim.priority, error=record.error))
    return out


def summarize_fleet(result: FleetResult, slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None, with_requests: bool = True) -> dict:
    """The bench-serve-shaped summary of a simulation (latencies in milliseconds)."""
    results = request_results(result)
    duration = max([r.start + r.e2e for r in results if r.ok] or [result.end_time]) or 1e-9
    summary = summarize(results, duration, slo_ttft_ms, slo_tpot_ms)
    summary["itl_ms"] = percentiles(np.frombuffer(result.itl_s, dtype=float) * 1000.0)
    levels = sorted({r.priority for r in results})
    if len(levels) > 1:
        for level in levels:
            subset = [r for r in results if r.priority == level]
            summary[f"priority_{level}"] = summarize(subset, duration, slo_ttft_ms, slo_tpot_ms)
    labels = sorted({rec.request.label for rec in result.records if rec.request.label})
    for label in labels:
        subset = [r for r, rec in zip(results, result.records) if rec.request.label == label]
        summary[f"label_{label}"] = summarize(subset, duration, slo_ttft_ms, slo_tpot_ms)
    replicas = [r.stats() for r in result.replicas]
    total_steps = sum(r["num_steps"] for r in replicas)
    summary["simulation"] = {
        "mode": result.mode, "num_replicas": len(result.replicas),
        "simulated_s": result.end_time, "wall_s": result.wall_s,
        "num_events": result.num_events, "num_steps": total_steps,
        "steps_per_wall_s": total_steps / result.wall_s if result.wall_s else math.nan,
        "replicas": replicas, **result.info}
    summary["timeseries"] = {str(r.index) if r.role == "colocated" else f"{r.role}-{r.index}":
                             r.timeseries() for r in result.replicas}
    if with_requests:
        rows = request_records(results)
        for row, record in zip(rows, result.records):
            row["replica"] = record.replica
            if record.decode_replica is not None:
                row["decode_replica"] = record.decode_replica
                row["kv_transfer_s"] = record.transfer_s
            if record.request.label:
                row["label"] = record.request.label
        summary["requests"] = rows
    return summary


_COMPARED = (("ttft_ms", "median"), ("ttft_ms", "p99"), ("tpot_ms", "median"),
             ("tpot_ms", "p99"), ("e2e_ms", "median"), ("e2e_ms", "p99"),
             ("output_tokens_per_s", None), ("total_tokens_per_s", None))


def compare(simulated: dict, measured: dict) -> list[dict]:
    """Rows of (figure, measured, simulated, relative error) for two bench-serve-shaped
    results (the error is simulated / measured - 1)."""
    rows = []
    for key, stat in _COMPARED:
        m = measured.get(key) if stat is None else (measured.get(key) or {}).get(stat)
        s = simulated.get(key) if stat is None else (simulated.get(key) or {}).get(stat)
        if m is None or s is None:
            continue
        name = key if stat is None else f"{key} {stat}"
        rows.append({"figure": name, "measured": m, "simulated": s,
                     "error": s / m - 1.0 if m else math.nan})
    return rows


def plot(summary: dict, out_dir: str | Path, title: str = "simulation") -> list[Path]:
    """latency.png (TTFT and TPOT CDFs) and timeseries.png (waiting requests and KV usage
    per replica) from a summary with request records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    rows = summary.get("requests") or []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ttft_s", "TTFT (s)"), (axes[1], "tpot_s", "TPOT (ms)")):
        values = np.sort([r[key] for r in rows if r.get(key) is not None])
        if key == "tpot_s":
            values = values * 1000
        if values.size:
            ax.plot(values, np.arange(1, values.size + 1) / values.size)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: latency CDFs")
    fig.tight_layout()
    paths.append(out_dir / "latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    series = summary.get("timeseries") or {}
    fig, axes = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for name, s in series.items():
        axes[0].plot(s["t_s"], s["waiting"], lw=0.8, label=name)
        axes[1].plot(s["t_s"], s["kv_usage"], lw=0.8, label=name)
    axes[0].set_ylabel("waiting requests")
    axes[1].set_ylabel("KV usage")
    axes[1].set_xlabel("simulated time (s)")
    if 0 < len(series) <= 16:
        axes[0].legend(fontsize=6, ncol=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: per-replica queue depth and KV usage")
    fig.tight_layout()
    paths.append(out_dir / "timeseries.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths

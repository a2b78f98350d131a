"""`treadle simulate size`: the smallest fleet that meets an SLO, by simulation.

Owns the search over mode (colocated, disaggregated) x tensor-parallel degree x policy x
token budget, and within each combination the smallest replica count: doubling until a
fleet meets the SLO, then bisecting between the last that failed and the first that met
it (so the answer's predecessor was simulated and failed; the search assumes that more
replicas never hurt). P/D is searched in three one-dimensional steps: the smallest
prefill pool meeting the TTFT target with a large decode pool (TTFT is made on the
prefill side), then the smallest decode pool meeting every target with that prefill
pool, then fewer prefill replicas if the full SLO still holds. A fleet meets the SLO when
p99 TTFT and p99 TPOT of the judged requests are within their targets (and the goodput
fraction, when given), with every judged request served; a run is cut short by the
fleet's SloMonitor as soon as it cannot meet them. The smallest fleet is the fewest
devices (replicas x TP), then the lowest p99 TTFT. Every evaluation is kept in the
result. Must not: contain scheduling logic.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Callable

import numpy as np

from treadle.sim.config import SimConfig, SizingConfig
from treadle.sim.fleet import SloMonitor
from treadle.sim.results import request_results
from treadle.sim.simulate import build, run

DECODE_POOL_FOR_PREFILL_SEARCH = 16
"""P/D step 1: decode replicas while the prefill pool is searched (TTFT does not depend on
the decode pool, as long as it is large enough to take the transfers)."""


def judge(result, sizing: SizingConfig) -> dict:
    """SLO figures of a FleetResult over the judged requests (priority <= slo_priority)."""
    results = request_results(result)
    level = sizing.slo_priority
    judged = [r for r in results if level is None or r.priority <= level]
    ok = [r for r in judged if r.ok]
    ttfts = np.array([r.ttft for r in ok]) * 1000
    tpots = np.array([r.tpot for r in ok if r.tpot is not None]) * 1000
    ttft_p99 = float(np.percentile(ttfts, 99)) if ttfts.size else math.nan
    tpot_p99 = float(np.percentile(tpots, 99)) if tpots.size else math.nan
    good = sum(1 for r in ok if r.ttft * 1000 <= sizing.target_ttft_p99_ms
               and (r.tpot is None or r.tpot * 1000 <= sizing.target_tpot_p99_ms))
    goodput = good / len(judged) if judged else math.nan
    meets = (not result.stopped_early and len(ok) == len(judged) and bool(judged)
             and ttft_p99 <= sizing.target_ttft_p99_ms
             and (not tpots.size or tpot_p99 <= sizing.target_tpot_p99_ms)
             and (sizing.target_goodput is None or goodput >= sizing.target_goodput))
    return {"meets": meets, "ttft_p99_ms": ttft_p99, "tpot_p99_ms": tpot_p99,
            "goodput_fraction": goodput, "num_judged": len(judged), "num_ok": len(ok),
            "stopped_early": result.stopped_early}


def evaluate(config: SimConfig, engine_options: dict, sizing: SizingConfig,
             ttft_only: bool = False) -> dict:
    """Simulate one fleet and judge it (a monitor stops it once the SLO is missed)."""
    setup = build(config, engine_options)
    level = sizing.slo_priority
    num_judged = sum(1 for r in setup.requests if level is None or r.priority <= level)
    monitor = SloMonitor(num_judged, sizing.target_ttft_p99_ms / 1000,
                         None if ttft_only else sizing.target_tpot_p99_ms / 1000,
                         None if ttft_only else sizing.target_goodput, level)
    result = run(setup, monitor)
    verdict = judge(result, dataclasses.replace(sizing, target_tpot_p99_ms=math.inf)
                    if ttft_only else sizing)
    verdict["wall_s"] = result.wall_s
    verdict["simulated_s"] = result.end_time
    return verdict


def smallest(passes: Callable[[int], bool], low: int, high: int) -> int | None:
    """The smallest n in [low, high] with passes(n), assuming passes is monotone: doubling
    from `low`, then bisection. None when even `high` fails."""
    last_fail = low - 1
    n = low
    while not passes(n):
        last_fail = n
        if n >= high:
            return None
        n = min(high, 2 * n)
    while n - last_fail > 1:
        mid = (n + last_fail) // 2
        if passes(mid):
            n = mid
        else:
            last_fail = mid
    return n


def search(sizing: SizingConfig, config: SimConfig, engine_options: dict,
           progress: bool = False) -> dict:
    """Every combination's smallest fleet, every evaluation, and the best of all."""
    evaluations: list[dict] = []
    candidates: list[dict] = []
    started = time.perf_counter()

    def run_point(point: dict, cfg: SimConfig, options: dict, ttft_only: bool = False) -> bool:
        verdict = evaluate(cfg, options, sizing, ttft_only)
        row = point | verdict | {"ttft_only": ttft_only}
        evaluations.append(row)
        if progress:
            print(f"  {_describe(row)}: {'meets' if verdict['meets'] else 'misses'} "
                  f"(p99 TTFT {verdict['ttft_p99_ms']:.0f} ms, p99 TPOT "
                  f"{verdict['tpot_p99_ms']:.1f} ms{', stopped early' if verdict['stopped_early'] else ''}"
                  f"; {verdict['wall_s']:.0f} s)", flush=True)
        return verdict["meets"]

    chunks = sizing.chunks or [engine_options.get("max_num_batched_tokens")]
    for mode in sizing.modes:
        for tp in sizing.tp_degrees:
            for policy in sizing.policies:
                for chunk in chunks:
                    options = dict(engine_options, scheduling_policy=policy)
                    if chunk is not None:
                        options["max_num_batched_tokens"] = chunk
                    base = {"mode": mode, "tensor_parallel_size": tp, "policy": policy,
                            "max_num_batched_tokens": chunk}
                    try:
                        if mode == "colocated":
                            found = _search_colocated(base, config, options, sizing, tp,
                                                      run_point)
                        else:
                            found = _search_disaggregated(base, config, options, sizing, tp,
                                                          run_point)
                    except ValueError as exc:  # e.g. a TP degree the model cannot split
                        if progress:
                            print(f"  {base['mode']} tp={tp} {policy}: {exc}", flush=True)
                        found = base | {"replicas": None, "devices": None, "error": str(exc)}
                    row = _found_row({"evaluations": evaluations}, found)
                    found |= {k: row.get(k, math.nan) for k in
                              ("ttft_p99_ms", "tpot_p99_ms", "goodput_fraction")}
                    candidates.append(found)
    feasible = [c for c in candidates if c["replicas"] is not None]
    best = min(feasible, key=lambda c: (c["devices"], c["ttft_p99_ms"])) if feasible else None
    return {"sizing": dataclasses.asdict(sizing), "simulation": dataclasses.asdict(config),
            "engine_options": engine_options, "candidates": candidates, "best": best,
            "evaluations": evaluations, "wall_s": time.perf_counter() - started}


def _search_colocated(base, config, options, sizing, tp, run_point) -> dict:
    def passes(n: int) -> bool:
        cfg = dataclasses.replace(config, replicas=n, prefill_replicas=0, decode_replicas=0,
                                  tensor_parallel_size=tp)
        return run_point(base | {"replicas": n}, cfg, options)

    n = smallest(passes, 1, sizing.max_replicas)
    return base | {"replicas": n, "devices": n * tp if n else None}


def _search_disaggregated(base, config, options, sizing, tp, run_point) -> dict:
    decode_pool = min(sizing.max_replicas, DECODE_POOL_FOR_PREFILL_SEARCH)

    def cfg(p: int, d: int) -> SimConfig:
        return dataclasses.replace(config, prefill_replicas=p, decode_replicas=d,
                                   tensor_parallel_size=tp)

    prefill = smallest(lambda p: run_point(base | {"prefill": p, "decode": decode_pool},
                                           cfg(p, decode_pool), options, ttft_only=True),
                       1, sizing.max_replicas)
    if prefill is None:
        return base | {"replicas": None, "devices": None, "prefill": None, "decode": None}
    decode = smallest(lambda d: run_point(base | {"prefill": prefill, "decode": d},
                                          cfg(prefill, d), options), 1, sizing.max_replicas)
    if decode is None:
        return base | {"replicas": None, "devices": None, "prefill": prefill, "decode": None}
    while prefill > 1 and run_point(base | {"prefill": prefill - 1, "decode": decode},
                                    cfg(prefill - 1, decode), options):
        prefill -= 1
    return base | {"replicas": prefill + decode, "devices": (prefill + decode) * tp,
                   "prefill": prefill, "decode": decode}


def _describe(row: dict) -> str:
    fleet = (f"{row['replicas']} replicas" if row.get("mode") == "colocated"
             else f"{row.get('prefill')}P+{row.get('decode')}D")
    chunk = row.get("max_num_batched_tokens")
    return (f"{row['mode']} tp={row['tensor_parallel_size']} {row['policy']}"
            f"{f' budget={chunk}' if chunk else ''} {fleet}")


def table(result: dict) -> str:
    from treadle.measure.report import format_table

    rows = []
    for c in result["candidates"]:
        found = c
        rows.append({"mode": c["mode"], "tp": c["tensor_parallel_size"], "policy": c["policy"],
                     "budget": c.get("max_num_batched_tokens"),
                     "fleet": ("-" if c["replicas"] is None else
                               f"{c['replicas']}" if c["mode"] == "colocated"
                               else f"{c['prefill']}P+{c['decode']}D"),
                     "devices": c["devices"], "p99 TTFT ms": found.get("ttft_p99_ms"),
                     "p99 TPOT ms": found.get("tpot_p99_ms"),
                     "goodput": found.get("goodput_fraction")})
        if c.get("error"):
            rows[-1]["fleet"] = "error"
    text = format_table(rows, ["mode", "tp", "policy", "budget", "fleet", "devices",
                               "p99 TTFT ms", "p99 TPOT ms", "goodput"])
    for c in result["candidates"]:
        if c.get("error"):
            text += f"\n{c['mode']} tp={c['tensor_parallel_size']} {c['policy']}: {c['error']}"
    best = result.get("best")
    if best is not None:
        text += f"\nsmallest: {_describe(best)} ({best['devices']} devices)"
    else:
        text += "\nno fleet within max_replicas meets the SLO"
    return text


def _found_row(result: dict, candidate: dict) -> dict:
    """The evaluation of a candidate's found fleet (its figures)."""
    if candidate["replicas"] is None:
        return {}
    for row in reversed(result["evaluations"]):
        same = all(row.get(k) == candidate.get(k) for k in
                   ("mode", "tensor_parallel_size", "policy", "max_num_batched_tokens"))
        if not same or not row["meets"] or row.get("ttft_only"):
            continue
        if candidate["mode"] == "colocated" and row.get("replicas") == candidate["replicas"]:
            return row
        if (candidate["mode"] != "colocated" and row.get("prefill") == candidate["prefill"]
                and row.get("decode") == candidate["decode"]):
            return row
    return {}


def plot_search(result: dict, out_dir: str | Path) -> Path:
    """size.png: p99 TTFT and p99 TPOT of every evaluated fleet, per combination."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    groups: dict[str, list[dict]] = {}
    for row in result["evaluations"]:
        if row.get("ttft_only"):
            continue
        key = (f"{row['mode']} tp={row['tensor_parallel_size']} {row['policy']}"
               f"{' b=' + str(row['max_num_batched_tokens']) if row.get('max_num_batched_tokens') else ''}")
        groups.setdefault(key, []).append(row)
    for key, rows in groups.items():
        def devices(r):
            n = r["replicas"] if r["mode"] == "colocated" else r["prefill"] + r["decode"]
            return n * r["tensor_parallel_size"]
        rows = sorted(rows, key=devices)
        xs = [devices(r) for r in rows]
        axes[0].plot(xs, [r["ttft_p99_ms"] for r in rows], "o-", label=key)
        axes[1].plot(xs, [r["tpot_p99_ms"] for r in rows], "o-", label=key)
    sizing = result["sizing"]
    axes[0].axhline(sizing["target_ttft_p99_ms"], color="k", ls="--", lw=0.8)
    axes[1].axhline(sizing["target_tpot_p99_ms"], color="k", ls="--", lw=0.8)
    axes[0].set_ylabel("p99 TTFT (ms)")
    axes[1].set_ylabel("p99 TPOT (ms)")
    for ax in axes:
        ax.set_xlabel("devices (replicas x TP)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("fleet size search (runs cut short by the SLO monitor show partial figures)")
    fig.tight_layout()
    path = out_dir / "size.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

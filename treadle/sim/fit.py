"""Fit a linear step-time model on a real run's per-step trace, and say how wrong it is.

Owns the least-squares fit of `LinearStepModel` on a `--trace` file
(treadle/engine/trace.py): each step's duration (t_end - t_start: schedule, forward,
sample, update) against its features (prefill tokens and rows, decode tokens, decode
context tokens read, prefill (query, key) pairs attended, swap bytes), with
non-negative coefficients (a feature whose coefficient comes out negative is dropped and
the rest refitted: a negative cost per token is noise, not physics), split in two where
that fits better (a narrow regime for steps of few linear rows, which the engine runs
with other kernels: `choose_split`); and of the time
between a step's end and the next one's start while requests are in flight (output
processing), against the step's rows. `evaluate` reports the errors of any step-time
model on any trace: mean and weighted absolute percentage error, R^2, and the ratio of
predicted to measured busy time (the bias behind simulated throughput). Version-1 traces
have no context or swap features; their fit uses prefill and decode tokens only.
Nothing here runs the scheduler.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from treadle.engine.trace import FEATURE_NAMES, Trace, TraceStep, read_trace
from treadle.sim.step_model import LinearStepModel, linear_rows

FIT_COLUMNS = ("prefill_tokens", "prefill_rows", "decode_tokens", "decode_context_tokens",
               "prefill_attention_pairs", "swap_bytes")
"""What the fit regresses on (swap_bytes: swap_out_bytes + swap_in_bytes, one rate)."""


def step_features(step: TraceStep) -> dict:
    """A step's features: recorded (version 2), or what `scheduled` gives (version 1)."""
    if step.features is not None:
        return {name: step.features.get(name, 0) for name in FEATURE_NAMES}
    f = dict.fromkeys(FEATURE_NAMES, 0)
    for _, num_tokens, kind in step.scheduled:
        if kind == "decode":
            f["decode_rows"] += 1
            f["decode_tokens"] += num_tokens
        else:
            f["prefill_rows"] += 1
            f["prefill_tokens"] += num_tokens
    return f


def _column(f: dict, name: str) -> float:
    if name == "swap_bytes":
        return f["swap_out_bytes"] + f["swap_in_bytes"]
    return f[name]


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: fit, drop the most negative column,
    refit, until none is negative (columns of zeros never enter)."""
    scale = np.abs(x).max(axis=0)
    active = [j for j in range(x.shape[1]) if scale[j] > 0]
    coef = np.zeros(x.shape[1])
    while active:
        xs = x[:, active] / scale[active]
        solution, *_ = np.linalg.lstsq(xs, y, rcond=None)
        solution = solution / scale[active]
        worst = int(np.argmin(solution))
        if solution[worst] >= 0:
            coef[active] = solution
            return coef
        del active[worst]
    return coef


OUTLIER_MADS = 8.0
"""A step whose residual after a first fit is more than this many (scaled) median
absolute deviations from the median residual is left out of the final fit: on a shared
machine a step can stall for seconds (the process descheduled, memory reclaimed), which
is the machine's noise, not the step's cost. The report counts them."""


def robust_lstsq(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """nonnegative_lstsq, refitted without outliers (OUTLIER_MADS); returns the
    coefficients and the mask of the points kept."""
    keep = np.ones(len(y), dtype=bool)
    coef = nonnegative_lstsq(x, y)
    for _ in range(3):
        residual = y - x @ coef
        center = np.median(residual[keep])
        spread = 1.4826 * np.median(np.abs(residual[keep] - center))
        new_keep = np.abs(residual - center) <= OUTLIER_MADS * max(spread, 1e-12)
        if new_keep.sum() < max(x.shape[1] + 1, len(y) // 2) or (new_keep == keep).all():
            break
        keep = new_keep
        coef = nonnegative_lstsq(x[keep], y[keep])
    return coef, keep


def busy_gaps(trace: Trace) -> list[tuple[TraceStep, float]]:
    """(step, seconds until the next step started) for every step after which requests
    were still in flight (so the engine went straight on: the gap is its own overhead)."""
    steps = sorted(trace.steps, key=lambda s: s.step)
    arrivals = sorted(a.t for a in trace.arrivals.values())
    ends = sorted(t for t, _ in trace.ends.values())
    gaps = []
    num_finished = 0
    a = e = 0
    for step, nxt in zip(steps, steps[1:]):
        num_finished += len(step.finished)
        while a < len(arrivals) and arrivals[a] <= step.t_end:
            a += 1
        while e < len(ends) and ends[e] <= step.t_end:
            e += 1
        if a - num_finished - e > 0:
            gaps.append((step, max(0.0, nxt.t_start - step.t_end)))
    return gaps


def evaluate(model, trace: Trace | list[Trace]) -> dict:
    """How well `model` predicts the trace's step durations (and busy gaps); over several
    traces, their steps and gaps together."""
    traces = trace if isinstance(trace, list) else [trace]
    steps = [s for t in traces for s in t.steps]
    measured = np.array([s.t_end - s.t_start for s in steps])
    predicted = np.array([model.step_seconds(step_features(s)) for s in steps])
    report = _errors(predicted, measured)
    gaps = [g for t in traces for g in busy_gaps(t)]
    if gaps:
        g_measured = np.array([g for _, g in gaps])
        g_predicted = np.array([model.gap_seconds(step_features(s)) for s, _ in gaps])
        report["gap"] = {"num_gaps": len(gaps), "measured_mean_s": float(g_measured.mean()),
                         "predicted_mean_s": float(g_predicted.mean())}
        busy = measured.sum() + g_measured.sum()
        report["busy_time_ratio"] = float((predicted.sum() + g_predicted.sum()) / busy)
    return report


def _errors(predicted: np.ndarray, measured: np.ndarray) -> dict:
    if measured.size == 0:
        raise ValueError("the trace has no steps to fit or evaluate")
    err = predicted - measured
    rel = np.abs(err) / np.maximum(measured, 1e-9)
    total = float(((measured - measured.mean()) ** 2).sum())
    return {
        "num_steps": int(measured.size),
        "measured_mean_s": float(measured.mean()), "predicted_mean_s": float(predicted.mean()),
        "mean_abs_pct_error": float(rel.mean()),
        "median_abs_pct_error": float(np.median(rel)),
        "p90_abs_pct_error": float(np.percentile(rel, 90)),
        "weighted_abs_pct_error": float(np.abs(err).sum() / measured.sum()),
        "r2": float(1.0 - (err ** 2).sum() / total) if total > 0 else float("nan"),
        "step_time_ratio": float(predicted.sum() / measured.sum()),
    }


NARROW_CANDIDATES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
"""Linear-row counts tried as the split between narrow and wide steps."""
MIN_STEPS_PER_SIDE = 20
"""A split is tried only where each side has at least this many steps to fit."""
MIN_SPLIT_GAIN = 0.05
"""A split is kept only if it lowers the absolute error over the steps by this fraction:
two sets of coefficients must earn their keep."""


def _coefficients(coef: np.ndarray) -> dict[str, float]:
    """FIT_COLUMNS' coefficients (after the intercept) as the model's feature names."""
    coefficients = {c: float(v) for c, v in zip(FIT_COLUMNS, coef[1:]) if c != "swap_bytes"}
    coefficients["swap_out_bytes"] = coefficients["swap_in_bytes"] = float(coef[-1])
    return coefficients


def choose_split(x: np.ndarray, y: np.ndarray, rows: np.ndarray
                 ) -> tuple[int, np.ndarray, np.ndarray | None, np.ndarray, dict]:
    """One fit of every step, or a narrow fit (steps of <= T linear rows) and a wide one,
    whichever predicts the steps better (the split must gain MIN_SPLIT_GAIN of the
    absolute error over the steps the single fit keeps). Returns (T or 0, wide
    coefficients, narrow coefficients or None, the kept mask, the errors of each
    candidate split)."""
    coef, keep = robust_lstsq(x, y)
    base = float(np.abs(x[keep] @ coef - y[keep]).sum())
    best = (0, coef, None, keep, base)
    tried = {"none": base}
    for t in NARROW_CANDIDATES:
        narrow = rows <= t
        if min(narrow.sum(), (~narrow).sum()) < max(MIN_STEPS_PER_SIDE, 2 * x.shape[1]):
            continue
        narrow_coef, narrow_keep = robust_lstsq(x[narrow], y[narrow])
        wide_coef, wide_keep = robust_lstsq(x[~narrow], y[~narrow])
        predicted = np.where(narrow, x @ narrow_coef, x @ wide_coef)
        error = float(np.abs(predicted[keep] - y[keep]).sum())
        tried[str(t)] = error
        if error < best[4]:
            split_keep = np.empty_like(keep)
            split_keep[narrow], split_keep[~narrow] = narrow_keep, wide_keep
            best = (t, wide_coef, narrow_coef, split_keep, error)
    if best[0] and best[4] > (1.0 - MIN_SPLIT_GAIN) * base:
        best = (0, coef, None, keep, base)
    return best[0], best[1], best[2], best[3], tried


def fit_trace(trace: Trace | list[Trace], source: str = "") -> LinearStepModel:
    """Least-squares LinearStepModel of the trace's steps (and busy gaps), with a narrow
    regime where one fits the steps better (choose_split); the fit's own errors on the
    trace are in `fit_report`. A list of traces (runs of one engine configuration) is
    fitted as one pool of steps: a model that does not hang on one run's minute of a
    machine whose speed drifts."""
    traces = trace if isinstance(trace, list) else [trace]
    steps = [s for t in traces for s in t.steps]
    if not steps:
        raise ValueError(f"trace {source or ''} has no steps to fit")
    feats = [step_features(s) for s in steps]
    x = np.array([[1.0] + [_column(f, c) for c in FIT_COLUMNS] for f in feats])
    y = np.array([s.t_end - s.t_start for s in steps])
    rows = np.array([linear_rows(f) for f in feats])
    narrow_max_rows, coef, narrow_coef, keep, split_errors = choose_split(x, y, rows)
    gaps = [g for t in traces for g in busy_gaps(t)]
    gap_intercept = gap_per_row = 0.0
    if len(gaps) >= 2:
        gx = np.array([[1.0, s.features["decode_rows"] + s.features["prefill_rows"]
                        if s.features else len(s.scheduled)] for s, _ in gaps])
        gap_coef, _ = robust_lstsq(gx, np.array([g for _, g in gaps]))
        gap_intercept, gap_per_row = (float(v) for v in gap_coef)
    # The outliers are left out of the coefficients' shape but not out of the time: a
    # robust fit predicts the typical step, and a run's throughput and queues are made of
    # every step, stalls included. Scaling both regimes by measured / predicted over all
    # steps makes the model's total the run's total (its `level`).
    predicted = (np.where(rows <= narrow_max_rows, x @ narrow_coef, x @ coef)
                 if narrow_max_rows else x @ coef)
    level = float(y.sum() / predicted.sum()) if predicted.sum() > 0 else 1.0
    coef = coef * level
    narrow_coef = None if narrow_coef is None else narrow_coef * level
    coefficients = _coefficients(coef)
    names = ",".join(Path(p).name for p in source.split(",") if p) or "trace"
    model = LinearStepModel(float(coef[0]), coefficients, gap_intercept, gap_per_row,
                            name=f"fit({names})", source=source,
                            narrow_max_rows=narrow_max_rows,
                            narrow_intercept=0.0 if narrow_coef is None else float(narrow_coef[0]),
                            narrow_coefficients={} if narrow_coef is None
                            else _coefficients(narrow_coef))
    outliers = [steps[i] for i in np.flatnonzero(~keep)]
    kept, first = [], 0
    for t in traces:
        mask = keep[first:first + len(t.steps)]
        first += len(t.steps)
        kept.append(Trace(t.policy, t.arrivals, [s for s, k in zip(t.steps, mask) if k],
                          t.ends, t.version, t.engine))
    model.fit_report = evaluate(model, traces) | {
        "trace_version": min(t.version for t in traces), "engine": traces[0].engine,
        "num_traces": len(traces), "level": level,
        "num_outliers": len(outliers), "narrow_max_rows": narrow_max_rows,
        "split_abs_error_s": split_errors,
        "outlier_seconds": float(sum(s.t_end - s.t_start for s in outliers)),
        "without_outliers": evaluate(model, kept)}
    return model


def fit_trace_file(path: str | Path) -> LinearStepModel:
    """The fit of one trace file, or of several pooled: "A.jsonl,B.jsonl"."""
    paths = [p for p in str(path).split(",") if p]
    return fit_trace([read_trace(p) for p in paths], ",".join(paths))

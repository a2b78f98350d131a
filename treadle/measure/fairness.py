"""Fairness between tenants, measured as the VTC paper measures it (Sheng et al., "Fairness
in Serving Large Language Models", OSDI'24): its workload suites, a tenant's service,
Jain's index, and the largest service gap between two backlogged tenants against the
paper's bound.

Owns, for `treadle bench fairness` (run on the simulator, treadle/sim/fairness.py, or on
the real engine, treadle/bench/fairness.py, which both feed it):
- `SUITES`: the paper's synthetic suites, their shapes reproduced (each tenant's arrival
  pattern and request lengths; rates and lengths scaled to the engine measured, see
  `make_requests`): overload, proportional, on_off, on_off_overload, poisson_short_long,
  increase, dist_shift;
- `rpm_admit`: the requests-per-minute limit the paper compares against (a tenant's
  requests past its limit in the last minute are refused);
- `ServiceLog`: what each step served each tenant and which tenants were backlogged
  (had a request waiting), appended by the runner step by step;
- `summarize`: the figures: per-tenant service over time, Jain's index over windows of
  backlogged tenants, and `max_backlogged_gap` against `bound` = 2 x the largest
  request's cost;
- `plot`: per-tenant service rate over time, one panel per policy, as a PNG.

Service, as the paper defines it: a tenant's weighted tokens, w_p x prompt tokens
processed + w_q x output tokens generated, over the tenant's weight. treadle's token
weights are w_p = w_q = 1 (the `fair` policy's counters charge every scheduled token
once, core/fair_share.py), so a request's cost is its prompt plus its output tokens, and
a step serves each tenant the tokens it schedules for it. The paper's bound (Theorem
4.4): two tenants backlogged over an interval receive weighted service within 2U of each
other, U the largest cost of one request. Must not: run an engine or a simulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PAPER_CAPACITY_RPS = 1.8
"""Requests of 256 prompt + 256 output tokens per second that the paper's server (S-LoRA,
Llama-2-7B on an A10G) serves at saturation, as its suites imply: in `proportional` the
tenants at 0.25 and 0.5 req/s are under their third of it while the total of 2.25 req/s
overloads it, so 1.5 < C < 2.25; in `on_off` 0.5 req/s is under half. The suites' rates
are scaled by (the engine's measured capacity / this)."""

PAPER_TOKENS = 256
"""The paper's request length (prompt and output) in the uniform suites."""


@dataclass(frozen=True)
class FairRequest:
    """One request of a suite (seconds from the start)."""

    arrival: float
    tenant: str
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    duration_s: float
    """The paper's duration."""


SUITES = {s.name: s for s in (
    Suite("overload", "two tenants at 1.5 and 3 req/s, both past their half: equal service "
          "(requests at fixed intervals)", 360),
    Suite("proportional", "three tenants at 0.25, 0.5 and 1.5 req/s: the two light ones get "
          "all they ask, the heavy one the rest", 600),
    Suite("on_off", "tenant A at 0.5 req/s, on and off every 60 s; tenant B at 2 req/s: A "
          "is served as it asks whenever it is on (on_off_less)", 600),
    Suite("on_off_overload", "tenant A at 2 req/s on and off every 60 s; tenant B at 3 "
          "req/s: equal service while both are on", 600),
    Suite("poisson_short_long", "Poisson arrivals, 8 req/s of short requests (a quarter "
          "of the tokens) and 1.5 req/s of long ones: service, not request counts, shared",
          600),
    Suite("increase", "tenant A at 0.5 req/s; tenant B's rate rising from 0.2 to 2 req/s",
          600),
    Suite("dist_shift", "three phases of 300 s: on_off (0.5 / 2 req/s), overload (1 / 1 "
          "req/s), proportional (0.5 / 1.5 req/s)", 900),
)}


def _uniform(rng, tenant: str, rate: float, start: float, end: float, length: int,
             on_off: float = 0.0) -> list[FairRequest]:
    """Requests at fixed intervals of 1/rate from a random offset; with `on_off`, none in
    the odd periods of that many seconds (the tenant is off)."""
    out, t = [], start + rng.random() / rate
    while t < end:
        if not (on_off and int((t - start) // on_off) % 2 == 1):
            out.append(FairRequest(t, tenant, length, length))
        t += 1.0 / rate
    return out


def _suite_requests(name: str, duration: float, length: int, rng) -> list[FairRequest]:
    """The paper's arrivals for suite `name` (rates in the paper's requests per second,
    over `duration` seconds, requests of `length` prompt and output tokens)."""
    if name == "overload":
        return _uniform(rng, "A", 1.5, 0, duration, length) + _uniform(rng, "B", 3, 0, duration,
                                                                        length)
    if name == "proportional":
        return [r for tenant, rate in (("A", 0.25), ("B", 0.5), ("C", 1.5))
                for r in _uniform(rng, tenant, rate, 0, duration, length)]
    if name in ("on_off", "on_off_overload"):
        a, b = (0.5, 2.0) if name == "on_off" else (2.0, 3.0)
        return (_uniform(rng, "A", a, 0, duration, length, on_off=duration / 10)
                + _uniform(rng, "B", b, 0, duration, length))
    if name == "poisson_short_long":
        out, t = [], 0.0
        while True:
            t += rng.exponential(1.0 / 9.5)
            if t >= duration:
                return out
            short = rng.random() < 8 / 9.5
            n = length // 4 if short else length
            out.append(FairRequest(t, "short" if short else "long", n, n))
    if name == "increase":
        out, t = _uniform(rng, "A", 0.5, 0, duration, length), 0.0
        while True:
            t += 1.0 / (0.2 + 1.8 * t / duration)
            if t >= duration:
                return out
            out.append(FairRequest(t, "B", length, length))
    if name == "dist_shift":
        third = duration / 3
        return (_uniform(rng, "A", 0.5, 0, third, length, on_off=duration / 15)
                + _uniform(rng, "B", 2.0, 0, third, length)
                + _uniform(rng, "A", 1.0, third, 2 * third, length)
                + _uniform(rng, "B", 1.0, third, 2 * third, length)
                + _uniform(rng, "A", 0.5, 2 * third, duration, length)
                + _uniform(rng, "B", 1.5, 2 * third, duration, length))
    raise ValueError(f"suite must be one of {', '.join(SUITES)}, got {name!r}")


def make_requests(name: str, capacity_rps: float, duration_scale: float = 1.0,
                  token_scale: float = 1.0, seed: int = 0) -> list[FairRequest]:
    """Suite `name` on an engine that serves `capacity_rps` requests of the suite's
    length per second at saturation: the paper's arrival pattern, its rates times
    capacity_rps / PAPER_CAPACITY_RPS (time compressed by that factor: the same number of
    requests, the same overload), its durations (and on/off periods) times
    `duration_scale` / that factor, lengths times `token_scale`. Sorted by arrival."""
    if name not in SUITES:
        raise ValueError(f"suite must be one of {', '.join(SUITES)}, got {name!r}")
    for what, value in (("capacity_rps", capacity_rps), ("duration_scale", duration_scale),
                        ("token_scale", token_scale)):
        if not value > 0:
            raise ValueError(f"{what} must be > 0, got {value}")
    speed = capacity_rps / PAPER_CAPACITY_RPS
    length = max(4, round(PAPER_TOKENS * token_scale))
    paper = _suite_requests(name, SUITES[name].duration_s * duration_scale, length,
                            np.random.default_rng(seed))
    return sorted((FairRequest(r.arrival / speed, r.tenant, r.prompt_len, r.output_len)
                   for r in paper), key=lambda r: (r.arrival, r.tenant))


def rpm_admit(requests: list[FairRequest], limit: int) -> tuple[list[FairRequest], int]:
    """The requests a per-tenant limit of `limit` requests per minute lets in (a request
    arriving when its tenant had `limit` admitted in the last 60 s is refused, as an API
    gateway's RPM limit does), and how many were refused."""
    if limit < 1:
        raise ValueError(f"the RPM limit must be >= 1, got {limit}")
    admitted, recent = [], {}
    for r in requests:
        window = [t for t in recent.get(r.tenant, []) if t > r.arrival - 60.0]
        if len(window) < limit:
            window.append(r.arrival)
            admitted.append(r)
        recent[r.tenant] = window
    return admitted, len(requests) - len(admitted)


@dataclass
class ServiceLog:
    """Step by step: when it ended, the tokens it served each tenant, and which tenants
    were backlogged (had a request waiting or swapped out) as it was scheduled."""

    times: list[float] = field(default_factory=list)
    served: list[dict[str, int]] = field(default_factory=list)
    backlogged: list[frozenset[str]] = field(default_factory=list)

    def step(self, t: float, served: dict[str, int], backlogged) -> None:
        self.times.append(t)
        self.served.append(served)
        self.backlogged.append(frozenset(backlogged))


def jain(values) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when equal, 1/n when one has all."""
    x = np.asarray(list(values), dtype=float)
    if len(x) == 0 or not np.any(x):
        return 1.0
    return float(x.sum() ** 2 / (len(x) * (x ** 2).sum()))


def cumulative_service(log: ServiceLog, tenants: list[str],
                       weights: dict[str, float]) -> np.ndarray:
    """[step, tenant] weighted service received up to the end of each step."""
    served = np.array([[s.get(t, 0) / weights.get(t, 1.0) for t in tenants]
                       for s in log.served], dtype=float).reshape(len(log.served), len(tenants))
    return np.cumsum(served, axis=0)


def max_backlogged_gap(log: ServiceLog, tenants: list[str],
                       weights: dict[str, float]) -> tuple[float, dict]:
    """The largest |W_f(t1, t2) - W_g(t1, t2)| over every pair of tenants and every
    interval in which both stayed backlogged (the paper's fairness measure), with where
    it happened. Over a maximal run of steps where f and g are both backlogged, the
    largest gap of any interval in it is max D - min D, D = W_f - W_g at step ends (the
    run's start counted from the step before it)."""
    cum = cumulative_service(log, tenants, weights)
    start = np.zeros(len(tenants))
    best, where = 0.0, {}
    for i, f in enumerate(tenants):
        for j in range(i + 1, len(tenants)):
            g = tenants[j]
            run_min = run_max = None
            run_start = 0
            for k, backlog in enumerate(log.backlogged):
                if f in backlog and g in backlog:
                    before = cum[k - 1] if k else start
                    d_before, d = before[i] - before[j], cum[k][i] - cum[k][j]
                    if run_min is None:
                        run_min = run_max = d_before
                        run_start = k
                    run_min, run_max = min(run_min, d), max(run_max, d)
                    if run_max - run_min > best:
                        best = run_max - run_min
                        where = {"tenants": [f, g], "from_s": log.times[run_start - 1]
                                 if run_start else 0.0, "to_s": log.times[k]}
                else:
                    run_min = run_max = None
    return best, where


def windowed_jain(log: ServiceLog, tenants: list[str], weights: dict[str, float],
                  window_s: float) -> list[float]:
    """Jain's index of the weighted service of the tenants backlogged throughout each
    window of `window_s` seconds (windows with fewer than two of them are skipped)."""
    if not log.times:
        return []
    out, k, n = [], 0, len(log.times)
    t0 = 0.0
    while k < n:
        end = t0 + window_s
        served: dict[str, float] = {}
        backlogged: set[str] | None = None
        while k < n and log.times[k] <= end:
            for t, v in log.served[k].items():
                served[t] = served.get(t, 0.0) + v / weights.get(t, 1.0)
            backlogged = (set(log.backlogged[k]) if backlogged is None
                          else backlogged & log.backlogged[k])
            k += 1
        if backlogged and len(backlogged) >= 2:
            out.append(jain(served.get(t, 0.0) for t in tenants if t in backlogged))
        t0 = end
    return out


def summarize(log: ServiceLog, requests: list[FairRequest], weights: dict[str, float],
              window_s: float, ttfts: dict[str, list[float]] | None = None,
              num_refused: int = 0) -> dict:
    """The figures of one run (see the module): service per tenant, Jain's index over
    windows of backlogged tenants, the largest backlogged gap against the bound."""
    tenants = sorted({r.tenant for r in requests})
    bound = 2 * max((r.prompt_len + r.output_len) / weights.get(r.tenant, 1.0)
                    for r in requests)
    gap, where = max_backlogged_gap(log, tenants, weights)
    jains = windowed_jain(log, tenants, weights, window_s)
    cum = cumulative_service(log, tenants, weights)
    total = cum[-1] if len(cum) else np.zeros(len(tenants))
    duration = log.times[-1] if log.times else 0.0
    return {
        "tenants": tenants,
        "service": {t: float(total[i]) for i, t in enumerate(tenants)},
        "service_tokens_per_s": (float(total.sum()) / duration) if duration else 0.0,
        "jain_mean": float(np.mean(jains)) if jains else None,
        "jain_min": float(np.min(jains)) if jains else None,
        "num_windows": len(jains),
        "max_backlogged_gap": float(gap), "gap_at": where,
        "bound": float(bound), "within_bound": bool(gap <= bound),
        "num_refused": num_refused,
        "ttft_p50_s": {t: _pct(v, 50) for t, v in (ttfts or {}).items()},
        "ttft_p99_s": {t: _pct(v, 99) for t, v in (ttfts or {}).items()},
        "duration_s": duration,
    }


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def service_rates(log: ServiceLog, tenants: list[str], weights: dict[str, float],
                  window_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(window centres, [window, tenant] weighted tokens per second)."""
    if not log.times:
        return np.zeros(0), np.zeros((0, len(tenants)))
    edges = np.arange(0.0, log.times[-1] + window_s, window_s)
    rates = np.zeros((len(edges) - 1, len(tenants)))
    idx = np.minimum(np.searchsorted(edges, log.times, side="left") - 1, len(edges) - 2)
    for k, served in enumerate(log.served):
        for i, t in enumerate(tenants):
            rates[max(idx[k], 0), i] += served.get(t, 0) / weights.get(t, 1.0)
    return (edges[:-1] + edges[1:]) / 2, rates / window_s


def plot(runs: dict[str, tuple[ServiceLog, dict]], tenants: list[str],
         weights: dict[str, float], window_s: float, title: str, path: str | Path) -> Path:
    """Per-tenant weighted service rate over time, one panel per policy (the paper's
    figures), with each panel's Jain index and gap / bound in its title."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.6 * len(runs)), sharex=True,
                             squeeze=False)
    for ax, (policy, (log, summary)) in zip(axes[:, 0], runs.items()):
        centres, rates = service_rates(log, tenants, weights, window_s)
        for i, t in enumerate(tenants):
            ax.plot(centres, rates[:, i], label=f"tenant {t}")
        j = summary["jain_mean"]
        ax.set_title(f"{policy}: Jain {'-' if j is None else f'{j:.3f}'}, max backlogged gap "
                     f"{summary['max_backlogged_gap']:.0f} / bound {summary['bound']:.0f} "
                     "tokens", fontsize=9)
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def capacity_rps(tokens_per_s: float, prompt_len: int, output_len: int) -> float:
    """Requests per second an engine serving `tokens_per_s` (prompt + output) sustains."""
    return tokens_per_s / (prompt_len + output_len) if tokens_per_s > 0 else math.nan

"""The VTC paper's fairness suites on the simulator's clock (`treadle bench fairness`).

Owns running one suite (treadle/measure/fairness.py makes its requests and reads the
figures) on one simulated replica: the production Scheduler on a step-time model
(`roofline` on a hardware and model preset by default: the benchmark model,
SmolLM2-135M, on this machine's measured CPU), under `fcfs`, `fcfs` behind a per-tenant
requests-per-minute limit (`rpm`, the paper's baseline), or `fair`; each step's service
per tenant and the backlogged tenants go to a ServiceLog through the replica's step
observer. Also the engine's capacity for the suite's requests (`capacity_rps`: a backlog
served to the end), which the suites' rates are scaled by.

Why the simulator is faithful here: fairness is decided by the scheduler alone (which
request each step serves, the fair policy's counters), and the simulator runs the
production scheduler, KV manager and admission unchanged; the step-time model only sets
how many steps fit in a second, which scales every tenant alike. What it does not model
(noise of a shared machine, the front end) moves latencies, not shares. Must not:
contain scheduling logic.
"""

from __future__ import annotations

from dataclasses import replace

from treadle.measure import fairness as fm
from treadle.router.routers import make_router
from treadle.sim.clock import SimClock
from treadle.sim.config import SimConfig
from treadle.sim.fleet import Fleet
from treadle.sim.replica import Replica
from treadle.sim.simulate import build
from treadle.sim.workload import PromptMaker, SimRequest

POLICIES = ("fcfs", "rpm", "fair")
"""What a suite is run under: the engine's policies fcfs and fair, and rpm (fcfs behind a
per-tenant requests-per-minute limit)."""


def sim_setup(hardware: str = "cpu-here", model_shape: str = "smollm2-135m",
              step_model: str = "roofline", **engine_options):
    """The simulated replica's spec and step model for these engine options (a tiny
    synthetic workload stands in for build's request list; the suite brings its own)."""
    config = SimConfig(workload="synthetic", num_requests=4, step_model=step_model,
                       hardware=hardware, model_shape=model_shape, max_model_len=4096)
    return build(config, engine_options)


def simulate(requests: list[fm.FairRequest], setup, policy: str,
             tenant_weights: dict[str, float] | None = None) -> tuple[fm.ServiceLog, dict]:
    """Run `requests` on one replica under `policy` (fcfs or fair; rpm is fcfs after
    `fm.rpm_admit`): the service log, and each tenant's TTFTs."""
    spec = setup.replica_spec
    weights = ",".join(f"{t}={w}" for t, w in (tenant_weights or {}).items())
    scheduler = replace(spec.scheduler, scheduling_policy=policy, tenant_weights=weights)
    spec = replace(spec, scheduler=scheduler)
    clock = SimClock()
    replica = Replica(0, spec, setup.step_model, clock)
    tenant_of = {str(i): r.tenant for i, r in enumerate(requests)}
    log = fm.ServiceLog()

    def observe(now: float, output, seconds: float) -> None:
        served: dict[str, int] = {}
        for s in output.scheduled:
            tenant = tenant_of[s.request_id]
            served[tenant] = served.get(tenant, 0) + s.num_scheduled_tokens
        queued = replica.scheduler.fair_share.num_queued
        log.step(now + seconds, served, {t for t, n in queued.items() if n > 0})

    replica.step_observer = observe
    sims = [SimRequest(i, r.arrival, r.prompt_len, r.output_len, tenant=r.tenant)
            for i, r in enumerate(requests)]
    fleet = Fleet([replica], make_router("round-robin"), clock,
                  PromptMaker(len(sims), seed=0))
    result = fleet.run(sims)
    ttfts: dict[str, list[float]] = {}
    for record in result.records:
        if record.first_token is not None:
            ttfts.setdefault(record.request.tenant, []).append(
                record.first_token - record.request.arrival)
    return log, ttfts


def capacity_rps(setup, prompt_len: int, output_len: int, num_requests: int = 200) -> float:
    """Requests of this size per second the replica serves at saturation: a backlog of
    `num_requests` arriving together, served to the end under fcfs."""
    requests = [fm.FairRequest(0.0, "A", prompt_len, output_len) for _ in range(num_requests)]
    log, _ = simulate(requests, setup, "fcfs")
    return num_requests / log.times[-1]


def run_suite(name: str, policies=POLICIES, duration_scale: float = 1.0,
              token_scale: float = 1.0, window_s: float | None = None,
              tenant_weights: dict[str, float] | None = None, rpm_limit: int | None = None,
              seed: int = 0, setup=None, capacity: float | None = None,
              **engine_options) -> dict:
    """Suite `name` under each policy, side by side: the figures of each
    (measure/fairness.py summarize) and their logs (for the plot). `capacity`: requests
    per second the rates are scaled to (measured on a backlog when not given)."""
    setup = setup or sim_setup(**engine_options)
    length = max(4, round(fm.PAPER_TOKENS * token_scale))
    capacity = capacity or capacity_rps(setup, length, length)
    requests = fm.make_requests(name, capacity, duration_scale, token_scale, seed)
    weights = tenant_weights or {}
    tenants = sorted({r.tenant for r in requests})
    window = window_s or max(1.0, requests[-1].arrival / 40)
    limit = rpm_limit or max(1, round(capacity * 60 / len(tenants)))
    runs = {}
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        admitted, refused = ((fm.rpm_admit(requests, limit)) if policy == "rpm"
                             else (requests, 0))
        log, ttfts = simulate(admitted, setup, "fcfs" if policy == "rpm" else policy, weights)
        runs[policy] = (log, fm.summarize(log, requests, weights, window, ttfts, refused))
    return {"suite": name, "description": fm.SUITES[name].description, "engine": "simulator",
            "step_model": setup.step_model.describe().get("kind", "roofline"),
            "capacity_rps": capacity, "num_requests": len(requests), "tenants": tenants,
            "weights": weights, "rpm_limit": limit, "window_s": window,
            "duration_s": requests[-1].arrival, "runs": runs}

"""One simulated replica: the production Scheduler and KV manager, a fake runner, a step-time
model, all on the simulated clock.

Owns a replica's engine loop cut into the two events the fleet schedules: `start_step`
(Scheduler.schedule() at the current simulated time; the step-time model prices the
SchedulerOutput and says when the step ends) and `finish_step` (the fake runner's
ModelRunnerOutput goes through Scheduler.update_from_output() at the end time). The
scheduling, admission, chunking, preemption (swap or recompute), priorities, fair share
and prefix caching are treadle.core's own, unchanged; the admission check of a new
request is EngineCore.admission_error itself. Also owns what a router sees of the replica
(treadle.router's ReplicaLoad: requests in flight, queue depth, KV usage), the KV a P/D transfer
delivers (`receive_kv`), and its sampled time series (running, waiting, swapped, KV
usage, sampled after a step is scheduled, at most once per interval). It never advances
the clock: the fleet does.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from treadle.config import CacheConfig, EngineConfig, SchedulerConfig
from treadle.core.outputs import EngineCoreOutput
from treadle.core.policy import PreemptionCosts
from treadle.core.scheduler import Scheduler
from treadle.engine.core import EngineCore
from treadle.engine.limits import EngineLimits
from treadle.engine.trace import step_features
from treadle.request import Request
from treadle.router.routers import ReplicaLoad
from treadle.sampling_params import SamplingParams
from treadle.sim.clock import SimClock
from treadle.sim.runner import SimRunner


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica of a pool is built from."""

    scheduler: SchedulerConfig
    cache: CacheConfig
    num_kv_blocks: int
    num_swap_blocks: int
    max_model_len: int
    vocab_size: int
    kv_bytes_per_token: int
    preemption_costs: PreemptionCosts | None = None
    num_spec_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    timeseries_interval: float = 1.0
    """Seconds of simulated time between two samples of the replica's state."""


class _AdmissionFacts:
    """The attributes EngineCore.admission_error reads, for a replica without an engine:
    the check a request goes through is the engine's own, not a copy."""

    def __init__(self, spec: ReplicaSpec) -> None:
        self.config = EngineConfig(cache=spec.cache, scheduler=spec.scheduler)
        self.vocab_size = spec.vocab_size
        self.max_model_len = spec.max_model_len
        self.num_kv_blocks = spec.num_kv_blocks
        self.limits = EngineLimits.from_core(self)


class Replica:
    """The scheduler of one engine, stepped by the fleet's events."""

    def __init__(self, index: int, spec: ReplicaSpec, step_model, clock: SimClock,
                 seed: int = 0, role: str = "colocated") -> None:
        self.index = index
        self.role = role
        self.spec = spec
        self.clock = clock
        self.step_model = step_model
        self.scheduler = Scheduler(spec.scheduler, spec.cache, spec.num_kv_blocks,
                                   spec.max_model_len, spec.num_swap_blocks,
                                   spec.preemption_costs, clock=clock)
        self.runner = SimRunner(spec.num_spec_tokens, spec.spec_acceptance_rate,
                                seed=seed * 1_000_003 + index)
        self._admission = _AdmissionFacts(spec)
        self._swap_block_bytes = spec.kv_bytes_per_token * spec.cache.block_size
        self._pending = None
        self.step_observer = None
        """Called with (simulated start time, SchedulerOutput, its seconds) for every step
        that runs (what follows each step: treadle/sim/fairness.py)."""
        self.active = False
        """A step is in flight or about to start (the fleet holds an event for it)."""
        self.busy_s = 0.0
        self.num_kv_received = 0
        self.num_kv_fallbacks = 0
        """P/D: transfers whose blocks did not fit; the decode replica recomputed them."""
        self._next_sample = 0.0
        self.series_t = array("d")
        self.series_running = array("l")
        self.series_waiting = array("l")
        self.series_swapped = array("l")
        self.series_kv_usage = array("d")

    # ----- what a router sees -------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.requests)

    @property
    def kv_usage(self) -> float:
        return self.scheduler.kv.usage

    def load(self, position: int) -> ReplicaLoad:
        """What a router reads of this replica, at `position` in its pool: healthy, its
        unfinished requests (what a front end has sent there and not seen finish), its
        waiting queue and KV usage, exact at the simulated time."""
        return ReplicaLoad(position, True, self.num_unfinished, self.num_waiting,
                           self.kv_usage)

    # ----- requests -----------------------------------------------------------------------

    def make_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                     arrival: float, priority: int = 0, tenant: str | None = None,
                     **scheduling) -> Request:
        """`scheduling`: band, slo_ttft_ms, slo_tpot_ms (treadle/request.py)."""
        return Request(request_id, prompt_token_ids,
                       SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       arrival_time=arrival, priority=priority, cache_salt=tenant,
                       tenant=tenant, **scheduling)

    def add(self, request: Request) -> str | None:
        """Admit a request to the scheduler, or return why the engine would refuse it."""
        error = EngineCore.admission_error(self._admission, request)
        if error is None:
            self.scheduler.add_request(request)
        return error

    def receive_kv(self, request: Request, num_tokens: int) -> bool:
        """P/D: the KV of the first `num_tokens` of `request`'s prompt (the prefill
        replica's prompt) arrives. Treadle has no KV connector yet; the transferred blocks
        land as prefix-cache blocks (allocated, filled, registered and released by a
        stand-in request), so the scheduler admits the request with a prefix hit of every
        full block and computes the rest (under a block, plus the first token). False when
        the blocks do not fit (the decode replica then recomputes the prompt)."""
        kv = self.scheduler.kv
        stand_in = Request(f"\x00kv-transfer:{request.request_id}",
                           request.prompt_token_ids[:num_tokens], request.sampling_params,
                           cache_salt=request.cache_salt)
        if not kv.enable_prefix_caching or not kv.allocate_slots(stand_in, num_tokens):
            self.num_kv_fallbacks += 1
            return False
        stand_in.num_computed_tokens = num_tokens
        kv.cache_full_blocks(stand_in)
        kv.free(stand_in)
        kv.forget(stand_in)
        self.num_kv_received += 1
        return True

    # ----- one step -----------------------------------------------------------------------

    def start_step(self) -> float | None:
        """Schedule a step at the current simulated time; its end time, or None when there
        is nothing to run."""
        now = self.clock.now
        scheduler = self.scheduler
        output = scheduler.schedule()
        if output.is_empty and output.preempted_request_ids:
            output = scheduler.schedule()  # the step only preempted: the engine goes on
        if now >= self._next_sample:
            self._sample(now)  # after scheduling: what is left waiting
        if output.is_empty:
            return None
        features = step_features(output, self._swap_block_bytes)
        seconds = self.step_model.step_seconds(features)
        self._pending = (output, features, seconds)
        self.busy_s += seconds
        if self.step_observer is not None:
            self.step_observer(now, output, seconds)
        return now + seconds

    def take_ended(self) -> list[EngineCoreOutput]:
        """Requests the scheduler ended on its own (a policy's refusals), to report."""
        return self.scheduler.take_ended_outputs()

    def finish_step(self) -> tuple[list[EngineCoreOutput], float]:
        """End the step in flight at the current simulated time: the runner's tokens go
        through update_from_output. Returns the outputs and the gap before the next step."""
        output, features, seconds = self._pending
        self._pending = None
        outputs = self.scheduler.update_from_output(output, self.runner(output))
        gap = self.step_model.gap_seconds(features)
        self.scheduler.observe_step_time(output, seconds + gap)
        return outputs, gap

    def _sample(self, now: float) -> None:
        s = self.scheduler
        self.series_t.append(now)
        self.series_running.append(len(s.running))
        self.series_waiting.append(len(s.waiting))
        self.series_swapped.append(len(s.swapped))
        self.series_kv_usage.append(s.kv.usage)
        interval = self.spec.timeseries_interval
        self._next_sample = (now // interval + 1) * interval

    def stats(self) -> dict:
        s = self.scheduler.stats
        kv = self.scheduler.kv
        return {
            "index": self.index, "role": self.role, "num_steps": s.num_steps,
            "busy_s": self.busy_s,
            "mean_batch_size": s.num_scheduled_requests / s.num_steps if s.num_steps else 0.0,
            "mean_tokens_per_step": s.num_scheduled_tokens / s.num_steps if s.num_steps else 0.0,
            "num_preemptions": s.num_preemptions,
            "num_preemptions_recompute": s.num_preemptions_recompute,
            "num_preemptions_swap": s.num_preemptions_swap,
            "num_admission_preemptions": s.num_admission_preemptions,
            "num_head_bypasses": s.num_head_bypasses,
            "kv_fragmentation": (1.0 - s.used_slots / s.allocated_slots
                                 if s.allocated_slots else 0.0),
            "num_kv_blocks": kv.num_blocks,
            "prefix_cache_queried_tokens": kv.prefix_stats.num_queried_tokens,
            "prefix_cache_hit_tokens": kv.prefix_stats.num_hit_tokens,
            "num_kv_received": self.num_kv_received, "num_kv_fallbacks": self.num_kv_fallbacks,
            "spec_proposed": self.runner.num_proposed, "spec_accepted": self.runner.num_accepted,
        }

    def timeseries(self) -> dict:
        return {"t_s": self.series_t.tolist(), "running": self.series_running.tolist(),
                "waiting": self.series_waiting.tolist(),
                "swapped": self.series_swapped.tolist(),
                "kv_usage": self.series_kv_usage.tolist()}

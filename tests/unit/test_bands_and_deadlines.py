"""The batch band (issue 46 item 3) and deadlines (issue 50 item 3) on the real Scheduler
with a fake runner and a fake clock: batch work after every interactive request under
every policy, preempted first, never in an interactive prefill's step, flat out alone;
the measured step-cost model; the `slo` policy's order by slack, best-effort service of
what can no longer make its deadline, and `slo_reject`'s refusal naming the deadline and
the predicted time."""

from __future__ import annotations

import random

import pytest

from treadle.config import SCHEDULING_POLICIES, CacheConfig, EngineConfig, SchedulerConfig
from treadle.core.fair_share import FairShareLedger
from treadle.core.outputs import ModelRunnerOutput
from treadle.core.policies import make_policy
from treadle.core.policies.slo import BEST_EFFORT, SLO_REFUSAL
from treadle.core.scheduler import Scheduler
from treadle.core.step_cost import StepCostModel
from treadle.request import Request, RequestStatus, check_scheduling
from treadle.sampling_params import SamplingParams

POLICIES = tuple(SCHEDULING_POLICIES)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_scheduler(policy="fcfs", max_tokens=64, max_seqs=4, num_blocks=256, block_size=4,
                   mode="recompute", num_swap_blocks=0, clock=None, **options) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                        preemption_mode=mode, scheduling_policy=policy,
                        **{"admission_lookahead_tokens": 0, "kv_watermark": 0.0, **options}),
        CacheConfig(block_size=block_size, enable_prefix_caching=True),
        num_kv_blocks=num_blocks, max_model_len=4096, num_swap_blocks=num_swap_blocks,
        clock=clock or FakeClock())


def make_request(rid, prompt_len, max_tokens, arrival=0.0, band="interactive", priority=0,
                 tenant=None, ttft=None, tpot=None):
    rng = random.Random(rid)
    return Request(rid, [rng.randrange(3, 1000) for _ in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2,
                   arrival_time=arrival, band=band, priority=priority, tenant=tenant,
                   slo_ttft_ms=ttft, slo_tpot_ms=tpot)


def fake_runner(output):
    return ModelRunnerOutput(sampled_token_ids={
        s.request_id: [7 + (s.num_computed_tokens + s.num_scheduled_tokens) % 11]
        for s in output.scheduled if s.sample})


def expected_tokens(r: Request) -> list[int]:
    return [7 + (r.num_prompt_tokens + k) % 11 for k in range(r.sampling_params.max_tokens)]


def step(sched, clock, seconds=1.0):
    out = sched.schedule()
    sched.update_from_output(out, fake_runner(out))
    sched.observe_step_time(out, seconds)
    clock.t += seconds
    return out


def replay(sched, clock, requests, seconds=1.0, on_step=None, max_steps=20_000):
    pending = sorted(requests, key=lambda r: r.arrival_time)
    steps = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0].arrival_time <= clock.t:
            sched.add_request(pending.pop(0))
        out = step(sched, clock, seconds)
        if on_step is not None:
            on_step(sched, out)
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def ids(out) -> set[str]:
    return {s.request_id for s in out.scheduled}


def _tokens_of(out, prefix):
    return sum(s.num_scheduled_tokens for s in out.scheduled if s.request_id.startswith(prefix))


# ----- the batch band ---------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_interactive_work_preempts_batch_work_at_once_under_every_policy(policy):
    """A batch request holds the only seat; an interactive one arrives: the next step runs
    the interactive one (the batch one preempted, even under fcfs and makespan, which
    never preempt otherwise, and even though it just started), and every interactive
    request starts before any other batch request."""
    clock = FakeClock()
    sched = make_scheduler(policy, max_seqs=1, clock=clock)
    batch = [make_request(f"b{i}", 8, 20, band="batch") for i in range(3)]
    for r in batch:
        sched.add_request(r)
    step(sched, clock)
    interactive = [make_request(f"i{i}", 8, 4, arrival=clock.t) for i in range(3)]
    for r in interactive:
        sched.add_request(r)
    out = step(sched, clock)
    assert ids(out) == {"i0"} and out.preempted_request_ids == ["b0"]
    started = []

    def watch(s, o):
        started.extend(rid for rid in ids(o) if rid not in started)

    replay(sched, clock, [], on_step=watch)
    assert started.index("i2") < started.index("b1")
    for r in batch + interactive:
        assert r.output_token_ids == expected_tokens(r)
    assert sched.kv.pool.num_free_blocks == 256


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_a_batch_request_is_the_first_memory_victim(policy):
    """KV runs out while batch and interactive requests grow: every memory victim is a
    batch request while one runs, and a batch request short of a block gives up its own
    before it takes an interactive request's."""
    clock = FakeClock()
    sched = make_scheduler(policy, max_seqs=8, num_blocks=40, clock=clock)
    requests = ([make_request(f"b{i}", 12, 60, band="batch") for i in range(3)]
                + [make_request(f"i{i}", 12, 60, arrival=0.5) for i in range(3)])
    for r in requests:
        sched.add_request(r)
    victims = []
    while sched.has_unfinished_requests():
        batch_running = any(r.band == "batch" for r in sched.running)
        out = step(sched, clock)
        for rid in out.preempted_request_ids:
            band = sched.requests[rid].band
            victims.append(band)
            assert band == "batch" or not batch_running, clock.t
    for r in requests:
        assert r.output_token_ids == expected_tokens(r)
    assert sched.kv.pool.num_free_blocks == 40


@pytest.mark.parametrize("policy", ["fcfs", "priority", "srpt", "slo"])
def test_a_step_that_prefills_an_interactive_request_carries_no_batch_work(policy):
    """Batch requests decode; an interactive prompt arrives: its step holds it alone
    (the batch decodes wait one step, their blocks kept), so its first token waits for
    its own prefill only; the step after, everything runs."""
    clock = FakeClock()
    sched = make_scheduler(policy, max_seqs=8, clock=clock)
    batch = [make_request(f"b{i}", 8, 30, band="batch") for i in range(4)]
    for r in batch:
        sched.add_request(r)
    for _ in range(3):
        step(sched, clock)
    urgent = make_request("i0", 20, 4, arrival=clock.t)
    sched.add_request(urgent)
    assert ids(step(sched, clock)) == {"i0"}
    assert ids(step(sched, clock)) == {"i0", "b0", "b1", "b2", "b3"}


@pytest.mark.parametrize("policy", POLICIES)
def test_batch_work_is_bounded_per_step_while_interactive_traffic_is_present(policy):
    """Batch requests decode on every seat; interactive requests come and go: while one
    is present, and for batch_yield_window_s after the last, each step carries at most
    batch_step_tokens batch tokens (short steps for the next interactive arrival); the
    interactive requests keep their tokens; after the window the batch fills every seat
    again; every output is right and every block freed."""
    clock = FakeClock()
    sched = make_scheduler(policy, max_tokens=256, max_seqs=12, clock=clock,
                           batch_step_tokens=3, batch_yield_window_s=5.0)
    batch = [make_request(f"b{i}", 8, 60, band="batch") for i in range(10)]
    for r in batch:
        sched.add_request(r)
    for _ in range(3):
        step(sched, clock)

    assert _tokens_of(step(sched, clock), "b") == 10  # alone: every seat
    interactive = [make_request(f"i{i}", 6, 5, arrival=clock.t) for i in range(2)]
    for r in interactive:
        sched.add_request(r)
    last_interactive = None
    while any(r.status is not RequestStatus.FINISHED_LENGTH for r in interactive):
        out = step(sched, clock)
        assert _tokens_of(out, "b") <= 3
        last_interactive = clock.t
    bounded = []
    while clock.t < last_interactive + 8:
        bounded.append((clock.t, _tokens_of(step(sched, clock), "b")))
    assert all(n <= 3 for t, n in bounded if t < last_interactive + 4)
    assert bounded[-1][1] == 10  # the window passed: every seat again
    replay(sched, clock, [])
    for r in batch + interactive:
        assert r.output_token_ids == expected_tokens(r)
    assert sched.kv.pool.num_free_blocks == 256


def test_the_bounds_by_default_are_what_a_steps_fixed_cost_buys():
    """batch_step_tokens and priority_step_tokens 0 (auto): a quarter (the batch band) and
    the whole (less urgent priority classes) of fixed_s / per_token_s of the measured step
    costs (10 ms a step and 0.5 ms a token: 5 and 20 tokens), within [1,
    max_num_batched_tokens]; batch requests yield while an interactive one is about and
    for the window after it (5 s by default), not once it has passed, and never to batch
    work alone."""
    from treadle.core.policy import yield_class
    from treadle.core.yield_share import YieldShare
    costs = StepCostModel()
    for tokens in (1, 50, 100, 200) * 50:
        costs.observe(tokens, 0.010 + 0.0005 * tokens)
    config = SchedulerConfig(max_num_batched_tokens=512)
    fcfs = make_policy(config, FairShareLedger())
    share = YieldShare(config, costs, lambda r, now: yield_class(r, fcfs, now))
    assert share.step_tokens() == {"band": 5, "class": 20}
    batch = make_request("b", 4, 4, band="batch")
    assert share.most_urgent_class(0.0) is None
    share.observe([make_request("i", 4, 4)], 10.0)
    for now, pool in ((10.5, "band"), (14.5, "band"), (15.5, None)):
        assert share.pool(batch, share.most_urgent_class(now), now) == pool, now
    share.observe([batch], 16.0)
    assert share.pool(batch, share.most_urgent_class(16.0), 16.0) is None  # alone


def test_less_urgent_priority_classes_yield_per_step_while_a_more_urgent_one_is_about():
    """Under `priority`, priority-1 requests decode on every seat; priority-0 requests come
    and go: while one is present, and for the window after the last, the priority-1
    requests take at most priority_step_tokens of each step together (the batch band's
    bound is not theirs); the urgent ones keep their tokens; after the window the lower
    class fills every seat again; outputs right, blocks freed."""
    clock = FakeClock()
    sched = make_scheduler("priority", max_tokens=256, max_seqs=12, clock=clock,
                           priority_step_tokens=4, batch_step_tokens=1,
                           batch_yield_window_s=5.0)
    low = [make_request(f"l{i}", 8, 60, priority=1) for i in range(10)]
    for r in low:
        sched.add_request(r)
    for _ in range(3):
        step(sched, clock)
    assert _tokens_of(step(sched, clock), "l") == 10  # alone: every seat
    urgent = [make_request(f"u{i}", 6, 5, arrival=clock.t, priority=0) for i in range(2)]
    for r in urgent:
        sched.add_request(r)
    while any(r.status is not RequestStatus.FINISHED_LENGTH for r in urgent):
        out = step(sched, clock)
        assert _tokens_of(out, "l") <= 4
        last_urgent = clock.t
    after = []
    while clock.t < last_urgent + 8:
        after.append((clock.t, _tokens_of(step(sched, clock), "l")))
    assert all(n <= 4 for t, n in after if t < last_urgent + 4)
    assert any(n == 4 for t, n in after if t < last_urgent + 4)  # not the batch bound
    assert after[-1][1] == 10  # the window passed: every seat again
    replay(sched, clock, [])
    for r in low + urgent:
        assert r.output_token_ids == expected_tokens(r)
    assert sched.kv.pool.num_free_blocks == 256


def test_priority_classes_are_strict_by_default_and_aging_lifts_a_class_out_of_yielding():
    """By default `priority` orders strictly (no aging): a priority-1 request that has
    waited a minute still yields to a fresh priority-0 one. With linear aging on
    (priority_aging_rate), a request aged half a level or more is of the class above
    and no longer yields to it; `priority_yield=False` turns yielding off."""
    from treadle.core.policy import yield_class

    def pool_after(wait, **options):
        config = SchedulerConfig(scheduling_policy="priority", **options)
        policy = make_policy(config, FairShareLedger())
        old = make_request("old", 4, 4, priority=1)
        fresh = make_request("fresh", 4, 4, arrival=wait, priority=0)
        policy.prepare_step([old, fresh], wait)
        return yield_class(old, policy, wait) > yield_class(fresh, policy, wait)

    assert SchedulerConfig().priority_aging == 0 and SchedulerConfig().priority_aging_rate == 0
    assert pool_after(60.0)
    assert pool_after(40.0, priority_aging_rate=0.01)  # 0.4 levels: still below
    assert not pool_after(60.0, priority_aging_rate=0.01)  # 0.6 levels: lifted
    assert not pool_after(60.0, priority_yield=False)


@pytest.mark.parametrize("policy", POLICIES)
def test_batch_work_alone_runs_as_fast_as_interactive_work(policy):
    """With nothing interactive to yield to, batch requests run flat out: the same steps
    and tokens as the same requests in the interactive band."""
    def run(band):
        clock = FakeClock()
        sched = make_scheduler(policy, max_seqs=4, num_blocks=64, clock=clock)
        requests = [make_request(f"r{i}", 5 + 3 * i, 12 + i, arrival=0.5 * i, band=band)
                    for i in range(10)]
        steps = replay(sched, clock, requests)
        assert all(r.output_token_ids == expected_tokens(r) for r in requests)
        return steps, sched.stats.num_scheduled_tokens

    assert run("batch") == run("interactive")


def test_band_and_deadlines_are_checked_naming_the_field():
    with pytest.raises(ValueError, match="band must be one of interactive, batch"):
        make_request("x", 4, 4, band="background")
    with pytest.raises(ValueError, match="slo_ttft_ms must be a positive"):
        check_scheduling("interactive", 0)
    with pytest.raises(ValueError, match="slo_tpot_ms must be a positive"):
        check_scheduling("batch", None, float("inf"))
    with pytest.raises(ValueError, match="slo_reject does not support|does not support "
                                         "slo_reject"):
        EngineConfig.from_options(scheduling_policy="fcfs", slo_reject=True)
    EngineConfig.from_options(scheduling_policy="slo", slo_reject=True)


# ----- the measured step costs ---------------------------------------------------------------

def test_the_step_cost_model_fits_the_measured_line_and_follows_a_slowdown():
    model = StepCostModel(prior_fixed_s=0.5, prior_per_token_s=0.01)
    rng = random.Random(0)
    for _ in range(200):
        tokens = rng.randint(1, 512)
        model.observe(tokens, 0.010 + 0.0002 * tokens)
    assert model.fixed_s == pytest.approx(0.010, rel=0.05)
    assert model.per_token_s == pytest.approx(0.0002, rel=0.05)
    for _ in range(300):  # the machine gets twice as slow (another program took a core)
        tokens = rng.randint(1, 512)
        model.observe(tokens, 2 * (0.010 + 0.0002 * tokens))
    assert model.step_seconds(256) == pytest.approx(2 * (0.010 + 0.0002 * 256), rel=0.05)
    # a 1000-token prompt in 256-token steps beside 6 decodes: 4 chunks of 250
    assert model.prefill_seconds(1000, 256, 6) == pytest.approx(
        4 * (model.fixed_s + 6 * model.per_token_s) + 1000 * model.per_token_s)
    model.observe(0, 1.0)  # an empty step teaches nothing
    model.observe(8, float("nan"))
    assert model.step_seconds(256) == pytest.approx(2 * (0.010 + 0.0002 * 256), rel=0.05)


# ----- the slo policy --------------------------------------------------------------------------

def test_slo_orders_by_slack_and_serves_requests_without_a_deadline_after():
    """One seat. The tightest TTFT deadline goes first (the later arrival here), then the
    looser one, then the request with no deadline; its urgency is best-effort."""
    clock = FakeClock()
    sched = make_scheduler("slo", max_seqs=1, clock=clock)
    loose = make_request("loose", 8, 2, arrival=0.0, ttft=60_000)
    none = make_request("none", 8, 2, arrival=0.0)
    tight = make_request("tight", 8, 2, arrival=0.0, ttft=10_000)
    started = []

    def watch(s, out):
        started.extend(rid for rid in ids(out) if rid not in started)

    replay(sched, clock, [loose, none, tight], on_step=watch)
    assert started == ["tight", "loose", "none"]
    assert sched.policy.urgency(none, 0.0) >= BEST_EFFORT


def test_slo_serves_a_request_that_can_no_longer_make_it_best_effort_after_the_others():
    """Overload: one seat, 1 s steps, every request wants 4 s of service and a first
    token within 6 s. A request that can no longer make it is served after the on-time
    ones (not dropped): every request ends with its tokens, and more meet their deadline
    than under fcfs, which serves them all late."""
    def run(policy):
        clock = FakeClock()
        sched = make_scheduler(policy, max_tokens=64, max_seqs=1, clock=clock)
        requests = [make_request(f"r{i}", 8, 4, arrival=2.0 * i, ttft=6_000)
                    for i in range(12)]
        replay(sched, clock, requests)
        for r in requests:
            assert r.output_token_ids == expected_tokens(r)
        assert sched.kv.pool.num_free_blocks == 256
        return sum(r.first_token_time - r.arrival_time <= 6.0 for r in requests), sched

    met_fcfs, _ = run("fcfs")
    met_slo, sched = run("slo")
    assert met_slo > met_fcfs and sched.policy.num_late > 0


def test_slo_reject_refuses_at_once_naming_the_deadline_and_the_predicted_time():
    """slo_reject: a waiting request whose first token is predicted past its deadline
    (from the measured step costs, 1 s a step here, and the seat it must wait for: the
    running request met its TTFT and finishes first) ends at once with an error naming
    slo_ttft_ms, its deadline and the predicted time, through take_ended_outputs; its
    blocks and queue place are freed, and the others are served."""
    clock = FakeClock()
    sched = make_scheduler("slo", max_tokens=8, max_seqs=1, clock=clock, slo_reject=True)
    for i in range(64):  # the engine has measured its steps: 1 s each, whatever their size
        sched.step_costs.observe(1 + i % 8, 1.0)
    first = make_request("first", 8, 6, ttft=5_000)
    sched.add_request(first)
    step(sched, clock)  # "first" has its first token (met) and holds the only seat 5 s more
    doomed = make_request("doomed", 8, 2, arrival=clock.t, ttft=2_500)
    sched.add_request(doomed)
    step(sched, clock)
    ended = sched.take_ended_outputs()
    assert [o.request_id for o in ended] == ["doomed"]
    error = ended[0].error
    assert error.startswith(SLO_REFUSAL) and "2500 ms" in error and "predicted at" in error
    assert doomed.status == RequestStatus.FINISHED_ERROR and "doomed" not in sched.requests
    replay(sched, clock, [])
    assert first.output_token_ids == expected_tokens(first)
    assert sched.kv.pool.num_free_blocks == 256 and not sched.fair_share.num_queued

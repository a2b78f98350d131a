"""The adaptive speculation policy's pure functions (core/spec_decode.py): the measured
cost model's interpolation, the acceptance estimate, the plan of proposed tokens per
request, and the controller the scheduler asks (core/spec_controller.py); and the
scheduler using them."""

from __future__ import annotations

import pytest

from treadle.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from treadle.core.outputs import ModelRunnerOutput
from treadle.core.scheduler import Scheduler
from treadle.core.spec_controller import SpecDecodeController
from treadle.core.spec_decode import (AcceptanceEstimate, ProposalCandidate, SpecCandidate,
                                      SpecCosts, _interp, expected_tokens, plan_proposals)
from treadle.request import Request
from treadle.sampling_params import SamplingParams


LIMITS = dict(max_model_len=4096, max_step_tokens=512)
"""A controller's request and step limits (its questions about candidates ignore them)."""


def costs_from(fn, rows=(1, 4, 16, 64), ks=(0, 1, 2, 4, 8), draft=None) -> SpecCosts:
    """A cost grid sampled from a function t(rows, tokens) (as the probe measures)."""
    return SpecCosts(tuple(rows), tuple(tuple(r * (1 + k) for k in ks) for r in rows),
                     tuple(tuple(fn(r, r * (1 + k)) for k in ks) for r in rows),
                     tuple(rows) if draft else (),
                     tuple(draft(r) for r in rows) if draft else ())


def memory_bound(rows, tokens):
    """Weights stream once per step (10 ms) until compute takes over at 64 tokens; each
    token's logits and sampling cost a little on top."""
    return max(0.010, tokens * 0.010 / 64) + 0.0001 * rows + 0.0002 * tokens


def compute_bound(rows, tokens):
    return 0.001 + 0.002 * tokens


def test_interp_is_linear_between_knots_and_extends_the_end_segments():
    xs, ys = [1, 3, 7], [1.0, 2.0, 4.0]
    assert _interp(xs, ys, 1) == 1.0 and _interp(xs, ys, 2) == 1.5
    assert _interp(xs, ys, 5) == 3.0 and _interp(xs, ys, 9) == 5.0
    assert _interp(xs, ys, -10) == 0.0  # never negative
    assert _interp([4], [2.5], 100) == 2.5


def test_step_time_reproduces_the_measured_grid_and_interpolates_rows():
    costs = costs_from(memory_bound)
    for r in (1, 4, 16, 64):
        for k in (0, 1, 2, 4, 8):
            assert costs.step_time(r, r * (1 + k)) == pytest.approx(memory_bound(r, r * (1 + k)))
    # 8 rows lie between the 4- and 16-row lines, at the same extra tokens.
    mid = costs.step_time(8, 8 + 3)
    assert costs.step_time(4, 4 + 3) <= mid <= costs.step_time(16, 16 + 3)


def test_spec_costs_reject_inconsistent_grids():
    with pytest.raises(ValueError):
        SpecCosts((1, 4), ((1, 2),), ((0.1, 0.2),))
    with pytest.raises(ValueError):
        SpecCosts((4, 1), ((4,), (1,)), ((0.1,), (0.1,)))
    with pytest.raises(ValueError):
        SpecCosts((1,), ((2, 1),), ((0.1, 0.2),))


def test_acceptance_estimate_follows_observations_and_forgets():
    e = AcceptanceEstimate()
    assert e.rate(0.5) == 0.5
    for _ in range(30):
        e.observe(4, 4)  # every proposal accepted
    assert e.rate(0.5) > 0.95
    for _ in range(60):
        e.observe(4, 0)  # every first proposal rejected
    assert e.rate(0.5) < 0.1
    for _ in range(200):
        e.idle()
    assert abs(e.rate(0.5) - 0.5) < 0.05  # back near the prior: it will be tried again


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_plan_speculates_deep_when_memory_bound_and_not_when_compute_bound():
    mem, comp = costs_from(memory_bound), costs_from(compute_bound)
    assert plan_proposals([0.8], [8], 1, 1, mem, False) == [8]
    assert plan_proposals([0.8] * 64, [8] * 64, 64, 64, comp, False) == [0] * 64
    # Compute-bound, only near-certain tokens pay: one token costs as much as a row's.
    assert plan_proposals([0.999] + [0.3] * 63, [4] * 64, 64, 64, comp, False)[0] > 0


def test_plan_gives_more_to_likelier_requests_and_nothing_to_hopeless_ones():
    mem = costs_from(memory_bound)
    k = plan_proposals([0.9, 0.6, 0.0], [8, 8, 8], 3, 3, mem, False)
    assert k[0] >= k[1] and k[2] == 0 and k[0] > 0


def test_plan_respects_each_request_and_the_step_budget():
    mem = costs_from(memory_bound)
    assert plan_proposals([0.95, 0.95], [2, 5], 2, 2, mem, False) == [2, 5]
    k = plan_proposals([0.95] * 4, [8] * 4, 4, 4, mem, False, max_step_tokens=10)
    assert sum(k) == 6


def test_plan_counts_the_draft_passes():
    """A draft pass that costs as much as a target step: a likely token still pays at
    one request, but drafting deep stops sooner than without the draft."""
    mem = costs_from(memory_bound)
    costly = costs_from(memory_bound, draft=lambda r: 0.010)
    free = plan_proposals([0.7], [8], 1, 1, mem, False)[0]
    drafted = plan_proposals([0.7], [8], 1, 1, costly, True)[0]
    assert drafted < free
    assert plan_proposals([0.2], [8], 1, 1, costly, True) == [0]


def test_plan_charges_each_request_its_own_first_token_cost():
    """A catch-up of 50 ms on a 10 ms step: not worth a few likely tokens; the same
    request without it speculates, and between two requests the cheaper goes first."""
    mem = costs_from(memory_bound)
    assert plan_proposals([0.9], [4], 1, 1, mem, False, first_costs=[0.050]) == [0]
    assert plan_proposals([0.9], [4], 1, 1, mem, False, first_costs=[0.0])[0] > 0
    # One token of room: the request without a catch-up gets it though its rate is lower.
    k = plan_proposals([0.9, 0.8], [4, 4], 2, 2, mem, False, max_step_tokens=3,
                       first_costs=[0.004, 0.0])
    assert k == [0, 1]


def test_plan_is_monotone_in_the_acceptance_rate():
    mem = costs_from(memory_bound)
    ks = [plan_proposals([a], [8], 1, 1, mem, False)[0] for a in (0.1, 0.3, 0.5, 0.7, 0.9)]
    assert ks == sorted(ks) and ks[-1] > ks[0]


def test_controller_without_adaptation_runs_every_proposal():
    c = SpecDecodeController(4, adaptive=False, prior=0.5, costs=None, writes_kv_ahead=True,
                             deterministic=False, **LIMITS)
    assert c.tokens_to_run([SpecCandidate("a", 3)], 1, 1, 512) == {"a": 3}
    assert c.tokens_to_propose([ProposalCandidate("a", 9, 30), ProposalCandidate("b", 9, 30)],
                               2, 2, 512) == {"a": 4, "b": 4}


def test_controller_counts_drafts_as_vllm_does():
    c = SpecDecodeController(4, adaptive=True, prior=0.5, costs=costs_from(memory_bound),
                             writes_kv_ahead=False, deterministic=True, **LIMITS)
    c.observe("a", 4, 2)
    c.observe("b", 3, 3)
    assert c.stats.num_drafts == 2 and c.stats.num_draft_tokens == 7
    assert c.stats.num_accepted_tokens == 5
    assert c.stats.accepted_per_position == [2, 2, 1, 0]
    assert c.stats.mean_accepted_length == pytest.approx(1 + 5 / 2)
    assert c.stats.acceptance_rate == pytest.approx(5 / 7)
    c.observe_unrun("c", 5, 5)  # shapes the estimate only
    assert c.stats.num_drafts == 2 and c.rate("c") > 0.5
    # ngram proposals cost nothing to make: always the most, cut when they run.
    assert c.tokens_to_propose([ProposalCandidate("a", 9, 30)], 1, 1, 512) == {"a": 4}


def test_a_new_request_starts_from_what_earlier_requests_showed():
    """The prior of a request's estimate is the engine's recent acceptance: a draft whose
    proposals every earlier request rejected is not tried on a new one, while a fresh
    engine (the configured prior, 0.8 here) would try it."""
    candidate = [ProposalCandidate("new", 40, 100)]
    fresh = draft_controller(0.0)
    assert fresh.rate("new") == pytest.approx(0.8)
    assert fresh.tokens_to_propose(candidate, 1, 1, 512)["new"] > 0
    c = draft_controller(0.0)
    for i in range(8):  # eight requests, each rejecting its one-token draft
        c.begin_step()
        c.observe(f"r{i}", 1, 0)
    assert c.rate("new") < 0.1
    assert c.tokens_to_propose(candidate, 1, 1, 512) == {"new": 0}
    # A request's own verifications still outweigh the engine's: it is judged by them.
    for _ in range(3):
        c.observe("good", 4, 4)
    assert c.rate("good") > 0.7


def test_the_engine_wide_estimate_drifts_back_to_the_prior_while_nobody_speculates():
    c = draft_controller(0.0)
    for i in range(8):
        c.begin_step()
        c.observe(f"r{i}", 1, 0)
    low = c.pooled_rate()
    c.begin_step()  # the step before observed: no drift
    assert c.pooled_rate() == pytest.approx(low)
    rejections = c.pooled.rejected
    for _ in range(350):  # steps without a verification: its counts halve
        c.begin_step()
    assert c.pooled.rejected == pytest.approx(rejections / 2, rel=0.02)
    middle = c.pooled_rate()
    assert low < middle < 0.8
    for _ in range(3000):
        c.begin_step()
    assert middle < c.pooled_rate() == pytest.approx(0.8, abs=0.02)
    assert c.tokens_to_propose([ProposalCandidate("new", 40, 100)], 1, 1, 512)["new"] > 0


def make_scheduler(costs, adaptive=True, method="ngram", max_tokens=64):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, adaptive=adaptive,
                             **({"model": "/nonexistent"} if method == "draft" else {}))
    return Scheduler(SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=8),
                     CacheConfig(block_size=4), num_kv_blocks=64, max_model_len=256,
                     speculative=spec, spec_costs=costs)


def start(sched, rid="r", prompt=8, max_tokens=40, speculative=True):
    r = Request(rid, list(range(3, 3 + prompt)),
                SamplingParams(max_tokens=max_tokens, ignore_eos=True, speculative=speculative))
    sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput({rid: [50]}, spec_token_ids={rid: [1] * 4}))
    return r


def test_scheduler_runs_the_plan_and_learns_from_rejections():
    # A token costs a tenth of a one-row step: worth it above 10% acceptance.
    sched = make_scheduler(costs_from(lambda rows, tokens: 0.009 + 0.001 * tokens))
    r = start(sched)
    out = sched.schedule()
    (s,) = out.scheduled
    assert len(s.spec_token_ids) > 0  # the prior says try
    assert s.num_proposals == 4
    for _ in range(12):  # every proposal rejected
        sched.update_from_output(out, ModelRunnerOutput({"r": [60]},
                                                        spec_token_ids={"r": [1] * 4}))
        out = sched.schedule()
    (s,) = out.scheduled
    assert s.spec_token_ids == []  # learned: not worth running
    assert sched.spec.stats.num_drafts > 0 and sched.spec.stats.num_accepted_tokens == 0
    assert r.num_computed_tokens == r.num_tokens - 1


def test_scheduler_respects_the_per_request_opt_out():
    sched = make_scheduler(costs_from(memory_bound), adaptive=False)
    start(sched, speculative=False)
    (s,) = sched.schedule().scheduled
    assert s.spec_token_ids == [] and s.num_proposals == 0


def test_model_proposers_get_slots_for_their_proposals():
    sched = make_scheduler(costs_from(memory_bound), adaptive=False, method="draft")
    r = start(sched, prompt=8)
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_proposals == 4
    # Its blocks cover this step's tokens (last + 4 proposed) and 4 more written ahead.
    assert sched.kv.num_allocated_slots("r") >= r.num_computed_tokens + 5 + 4


def draft_controller(per_token: float) -> SpecDecodeController:
    costs = costs_from(memory_bound, draft=lambda r: 0.001)
    costs = SpecCosts(costs.step_rows, costs.step_tokens, costs.step_seconds,
                      costs.draft_rows, costs.draft_seconds, catchup_seconds_per_token=per_token)
    return SpecDecodeController(4, adaptive=True, prior=0.8, costs=costs,
                                writes_kv_ahead=True, deterministic=False, **LIMITS)


def test_a_draft_catch_up_is_spread_over_the_remaining_output():
    """A 600-token prompt to catch up at 0.1 ms a token (60 ms): not for the last few
    tokens of a request, yes for a long output, and only once."""
    c = draft_controller(0.0001)
    short = c.tokens_to_propose([ProposalCandidate("a", 600, 3)], 1, 1, 512)
    assert short == {"a": 0}
    long = c.tokens_to_propose([ProposalCandidate("a", 600, 2000)], 1, 1, 512)
    assert long["a"] > 0
    c.proposing("a", 600)  # caught up: the next proposal pays no catch-up
    assert c.tokens_to_propose([ProposalCandidate("a", 602, 3)], 1, 1, 512)["a"] > 0
    c.draft_lost("a")  # preempted by recompute: a whole catch-up again
    assert c.tokens_to_propose([ProposalCandidate("a", 602, 3)], 1, 1, 512) == {"a": 0}
    # Without a catch-up cost (self reads the target's KV) the short request drafts.
    assert draft_controller(0.0).tokens_to_propose(
        [ProposalCandidate("a", 600, 3)], 1, 1, 512)["a"] > 0


def test_no_draft_runs_for_a_step_that_the_waiting_prefill_fills():
    """With a prompt waiting that fills the next step's budget, the decoding request
    gets no proposals (they could not run); once the prompt is in, it does."""
    costs = costs_from(lambda rows, tokens: 0.009 + 0.001 * tokens, draft=lambda r: 0.0005)
    sched = make_scheduler(costs, method="draft", max_tokens=64)
    start(sched, rid="r", prompt=8)
    sched.add_request(Request("long", list(range(3, 3 + 200)),
                              SamplingParams(max_tokens=4, ignore_eos=True)))
    out = sched.schedule()
    by_id = {s.request_id: s for s in out.scheduled}
    assert by_id["r"].num_proposals == 0  # the next step is the long prompt's too
    for _ in range(8):  # until the long prompt's last chunk is scheduled
        sched.update_from_output(out, ModelRunnerOutput({"r": [60]}))
        out = sched.schedule()
        by_id = {s.request_id: s for s in out.scheduled}
        if sched.requests["long"].num_computed_tokens + by_id["long"].num_scheduled_tokens >= 200:
            break
    assert by_id["r"].num_proposals > 0  # the step after it has room

"""`treadle bench fairness` (issue 50 item 5): the VTC paper's suites, its measures, and
the bound asserted on a small suite on the simulator: `fair` keeps two backlogged
tenants' weighted service within twice the largest request's cost, where fcfs does not."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.measure import fairness as fm
from treadle.sim import fairness as sim_fairness


def test_jain_index():
    assert fm.jain([5, 5, 5]) == pytest.approx(1.0)
    assert fm.jain([9, 0, 0]) == pytest.approx(1 / 3)
    assert fm.jain([1, 3]) == pytest.approx(16 / 20)


def test_max_backlogged_gap_counts_only_intervals_where_both_wait():
    log = fm.ServiceLog()
    # A gets 10 a step while both are backlogged (3 steps), then B alone waits and catches
    # up (its service then is not a gap: A was not backlogged), then both again.
    for t, served, backlog in [(1, {"A": 10}, {"A", "B"}), (2, {"A": 10}, {"A", "B"}),
                               (3, {"A": 10}, {"A", "B"}), (4, {"B": 50}, {"B"}),
                               (5, {"B": 4}, {"A", "B"}), (6, {"A": 4}, {"A", "B"})]:
        log.step(float(t), served, backlog)
    gap, where = fm.max_backlogged_gap(log, ["A", "B"], {})
    assert gap == 30 and where == {"tenants": ["A", "B"], "from_s": 0.0, "to_s": 3.0}
    gap, _ = fm.max_backlogged_gap(log, ["A", "B"], {"A": 2.0})  # A weighs 2: 15
    assert gap == 15


def test_the_suites_have_the_papers_shapes():
    on_off = fm.make_requests("on_off", fm.PAPER_CAPACITY_RPS)
    a = np.array([r.arrival for r in on_off if r.tenant == "A"])
    assert not np.any((a % 120 > 60) & (a % 120 < 119))  # A is off every other minute
    increase = fm.make_requests("increase", fm.PAPER_CAPACITY_RPS)
    b = [r.arrival for r in increase if r.tenant == "B"]
    assert sum(t < 300 for t in b) < sum(t >= 300 for t in b)  # B's rate rises
    short_long = fm.make_requests("poisson_short_long", fm.PAPER_CAPACITY_RPS)
    assert {r.prompt_len for r in short_long if r.tenant == "short"} == {64}
    # twice the capacity: the same requests in half the time
    fast = fm.make_requests("overload", 2 * fm.PAPER_CAPACITY_RPS)
    slow = fm.make_requests("overload", fm.PAPER_CAPACITY_RPS)
    assert len(fast) == len(slow) and fast[-1].arrival == pytest.approx(slow[-1].arrival / 2)


def test_the_rpm_limit_refuses_a_tenants_requests_past_its_minute():
    requests = [fm.FairRequest(i * 0.5, "A", 8, 8) for i in range(300)]
    admitted, refused = fm.rpm_admit(requests, 30)  # 150 s: three minutes' starts of 30
    assert len(admitted) == 90 and refused == 210
    for r in admitted:
        assert sum(r.arrival - 60 < o.arrival <= r.arrival for o in admitted) <= 30


def test_fair_stays_within_the_papers_bound_where_fcfs_does_not():
    """The overload suite (two tenants past their share, one at twice the other's rate),
    short (36 s of the paper's 360, its 256 + 256-token requests, rates for an engine of
    1.5 requests a second, the simulated one's capacity): with `fair` the
    largest gap in service between the two backlogged tenants stays within twice the
    largest request's cost (the VTC bound); under fcfs the heavier tenant takes twice the
    other's share and the gap grows with the run."""
    result = sim_fairness.run_suite("overload", policies=("fcfs", "fair"),
                                    duration_scale=0.1, capacity=1.5)
    fair, fcfs = result["runs"]["fair"][1], result["runs"]["fcfs"][1]
    assert fair["bound"] == 2 * (256 + 256)
    assert fair["within_bound"], fair
    assert not fcfs["within_bound"] and fcfs["max_backlogged_gap"] > 4 * fcfs["bound"]
    assert fair["jain_mean"] > 0.95 > fcfs["jain_mean"]

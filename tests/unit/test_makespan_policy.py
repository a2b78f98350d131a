"""The makespan policy: longest remaining output first, admissions paced so that the
short requests' decoding is spread over the longest one's steps. The pacing rule as a
pure function (paced_rows), and the scheduler under it with a fake runner:
who starts first, how many run, how many thin steps the run ends in, and that nothing of
the outputs or the memory depends on it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from treadle.config import SchedulerConfig
from treadle.core.policies.makespan import paced_rows
from treadle.core.policies.srpt import remaining_work
from treadle.core.policy import remaining_outputs
from tests.unit.test_scheduler_policies import (FakeClock, expected_tokens, make_request,
                                                make_scheduler, replay, step)


@given(st.lists(st.integers(0, 5000), max_size=80), st.integers(1, 64))
def test_paced_rows_finish_everything_within_the_longest_requests_steps(remaining, min_rows):
    cap = paced_rows(remaining, min_rows)
    longest = max(remaining, default=0)
    assert cap >= min_rows
    # cap rows a step for `longest` steps cover every remaining token ...
    assert cap * longest >= sum(remaining)
    # ... and one row fewer would not, unless the floor set the cap.
    if cap > min_rows:
        assert (cap - 1) * longest < sum(remaining)


def test_paced_rows_examples():
    # 4 requests of 1024 and 60 of 136: 4 + 60 * 136 / 1024 -> 12 rows, the floor is 16.
    assert paced_rows([1024] * 4 + [136] * 60, 16) == 16
    assert paced_rows([1024] * 4 + [136] * 60, 1) == math.ceil((4096 + 8160) / 1024)
    # Equal lengths: all of them at once, as fcfs would.
    assert paced_rows([100] * 50, 16) == 50
    assert paced_rows([], 16) == 16
    assert paced_rows([0, 0], 3) == 3


def test_remaining_outputs_follow_the_length_hint_then_max_tokens():
    r = make_request("a", 4, 50)
    assert remaining_outputs(r) == 50
    hinted = make_request("b", 4, 50, length_hint=20)
    assert remaining_outputs(hinted) == 20
    assert remaining_work(hinted) == 4 + 20


def test_makespan_min_rows_is_checked():
    with pytest.raises(ValueError, match="makespan_min_rows must be >= 1"):
        SchedulerConfig(makespan_min_rows=0)
    with pytest.raises(ValueError, match="makespan"):
        SchedulerConfig(scheduling_policy="longest")


def _batch(num_long=2, long_len=120, num_short=30, short_len=12):
    return ([make_request(f"short{i}", 6, short_len, arrival=0.0) for i in range(num_short)]
            + [make_request(f"long{i}", 6, long_len, arrival=0.0) for i in range(num_long)])


def _scheduler(policy_name, clock, requests):
    """Room for every request of `_batch` at once, a floor of 4 rows; the requests added."""
    sched = make_scheduler(policy_name, max_tokens=256, max_seqs=64, num_blocks=1024,
                           clock=clock, makespan_min_rows=4)
    for r in requests:
        sched.add_request(r)
    return sched


def _sampled_rows_per_step(policy_name, requests):
    clock = FakeClock()
    sched = _scheduler(policy_name, clock, requests)
    rows = []
    while sched.has_unfinished_requests():
        out = step(sched, clock)
        rows.append(sum(1 for x in out.scheduled if x.sample))
        assert len(rows) < 10_000
    return rows


def test_longest_requests_start_first_and_running_is_paced():
    clock = FakeClock()
    requests = _batch()
    sched = _scheduler("makespan", clock, requests)
    out = step(sched, clock)
    started = {s.request_id for s in out.scheduled}
    assert {"long0", "long1"} <= started
    while sched.has_unfinished_requests():
        cap = paced_rows((remaining_outputs(r) for r in sched.requests.values()), 4)
        before = {r.request_id for r in sched.running}
        step(sched, clock)
        admitted = {r.request_id for r in sched.running} - before
        # Admissions bring the running requests up to the cap, never past it.
        if admitted:
            assert len(sched.running) <= cap
    for r in requests:
        assert r.output_token_ids == expected_tokens(r)
    assert sched.kv.pool.num_free_blocks == 1024


def test_makespan_ends_in_fewer_thin_steps_than_fcfs():
    """The point of the policy: fcfs runs every request at once, the short ones end early
    and the two long ones decode alone for ~100 steps; makespan spreads the short ones
    over the long ones' steps. Same number of tokens, no more steps, far fewer steps
    below the floor of rows."""
    fcfs_rows = _sampled_rows_per_step("fcfs", _batch())
    paced_rows = _sampled_rows_per_step("makespan", _batch())
    assert sum(fcfs_rows) == sum(paced_rows) == 2 * 120 + 30 * 12
    assert len(paced_rows) <= len(fcfs_rows)
    thin = lambda rows: sum(1 for n in rows if n < 4)  # noqa: E731
    assert thin(fcfs_rows) >= 90
    assert thin(paced_rows) <= thin(fcfs_rows) // 4


def test_makespan_never_preempts_for_a_waiting_request():
    clock = FakeClock()
    sched = make_scheduler("makespan", max_seqs=1, clock=clock, makespan_min_rows=1,
                           admission_preemption_threshold=1.0)
    short = make_request("short", 4, 10)
    sched.add_request(short)
    step(sched, clock)
    sched.add_request(make_request("long", 4, 200))
    for _ in range(4):
        step(sched, clock)
        assert [r.request_id for r in sched.running] == ["short"]
    assert sched.stats.num_admission_preemptions == 0
    replay(sched, clock, [])
    assert short.output_token_ids == expected_tokens(short)

"""The scheduling policies (one class each, core/policies/) and their pure functions, and the
waiting queues that offer their order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treadle.config import SchedulerConfig, parse_tenant_weights
from treadle.core import policy
from treadle.core.fair_share import FairShareLedger, vtc_charge, vtc_lift
from treadle.core.policies import make_policy, policy_class
from treadle.core.policies.fair import next_fair
from treadle.core.policies.priority import priority_urgency
from treadle.core.policies.srpt import remaining_work, srpt_urgency
from treadle.core.request_queue import FCFSQueue, PolicyQueue
from treadle.request import Request
from treadle.sampling_params import SamplingParams


def req(rid, prompt=4, max_tokens=8, priority=0, arrival=0.0, tenant=None, hint=None,
        computed=0, outputs=0):
    r = Request(rid, [5] * prompt, SamplingParams(max_tokens=max_tokens), arrival_time=arrival,
                priority=priority, tenant=tenant, length_hint=hint)
    for _ in range(outputs):
        r.append_output_token(9)
    r.num_computed_tokens = computed
    return r


def ids(requests):
    return [r.request_id for r in requests]


def make(name, ledger=None, **knobs):
    """The policy `name` with the given knobs and no aging unless asked for."""
    knobs = {"priority_aging_rate": 0.0, "priority_aging": 0.0, "srpt_aging_rate": 0.0,
             **knobs}
    return make_policy(SchedulerConfig(scheduling_policy=name, **knobs),
                       ledger or FairShareLedger())


def admission_order(requests, now, p):
    return list(p.order(requests, now))


# ----- fcfs --------------------------------------------------------------------------------

def test_fcfs_orders_by_arrival():
    a, b, c = req("a", arrival=2.0), req("b", arrival=1.0), req("c", arrival=3.0)
    assert ids(admission_order([a, b, c], now=5.0, p=make("fcfs"))) == ["b", "a", "c"]


# ----- priority ------------------------------------------------------------------------------

def test_priority_lower_value_first_ties_by_arrival():
    params = make("priority", priority_aging_rate=0.0)
    rs = [req("low", priority=2, arrival=0.0), req("hi-late", priority=0, arrival=2.0),
          req("hi-early", priority=0, arrival=1.0), req("mid", priority=1, arrival=0.5)]
    assert ids(admission_order(rs, now=3.0, p=params)) == \
        ["hi-early", "hi-late", "mid", "low"]


def test_priority_aging_formula():
    r = req("r", priority=3, arrival=10.0)
    assert priority_urgency(r, now=14.0, aging_rate=0.5) == 3 - 0.5 * 4
    assert priority_urgency(r, now=9.0, aging_rate=0.5) == 3  # no negative waits


def test_aged_low_priority_request_overtakes_new_urgent_ones():
    """Priority 2 at t=0 with 0.5 levels/s: ahead of priority 0 arriving after t=4."""
    params = make("priority", priority_aging_rate=0.5)
    old = req("old", priority=2, arrival=0.0)
    before = req("before", priority=0, arrival=3.9)
    after = req("after", priority=0, arrival=4.1)
    assert ids(admission_order([old, before, after], now=10.0, p=params)) == \
        ["before", "old", "after"]


@given(st.lists(st.tuples(st.integers(0, 5), st.floats(0, 100)), min_size=2, max_size=12),
       st.floats(0, 2), st.floats(100, 200), st.floats(0, 500))
@settings(max_examples=100, deadline=None)
def test_priority_order_of_waiting_requests_does_not_change_with_time(items, rate, t1, dt):
    """Linear aging gives every waiting request a fixed place: priority + rate * arrival."""
    params = make("priority", priority_aging_rate=rate)
    rs = [req(f"r{i}", priority=p, arrival=a) for i, (p, a) in enumerate(items)]
    first = admission_order(rs, now=t1, p=params)
    later = admission_order(rs, now=t1 + dt, p=params)
    keys = [(r.priority + rate * r.arrival_time) for r in first]
    assert all(x <= y + 1e-6 for x, y in zip(keys, keys[1:]))
    later_keys = [(r.priority + rate * r.arrival_time) for r in later]
    assert sorted(keys) == pytest.approx(later_keys)


# ----- srpt ----------------------------------------------------------------------------------

def test_remaining_work():
    assert remaining_work(req("new", prompt=10, max_tokens=20)) == 30
    # half the prompt computed
    assert remaining_work(req("mid", prompt=10, max_tokens=20, computed=5)) == 25
    # decoding: 3 of 20 generated, all but the last token computed
    assert remaining_work(req("dec", prompt=10, max_tokens=20, outputs=3,
                                     computed=12)) == 1 + 17
    # preempted by recompute: everything is uncomputed again
    assert remaining_work(req("re", prompt=10, max_tokens=20, outputs=3)) == 13 + 17
    # a length hint replaces max_tokens, and never goes below zero
    assert remaining_work(req("hint", prompt=10, max_tokens=500, hint=8)) == 18
    assert remaining_work(req("over", prompt=10, max_tokens=500, hint=2, outputs=4,
                                     computed=13)) == 1


def test_srpt_shortest_first_then_aging():
    params = make("srpt", srpt_aging_rate=10.0)
    long = req("long", prompt=100, max_tokens=100, arrival=0.0)      # 200 tokens
    short = req("short", prompt=10, max_tokens=10, arrival=5.0)      # 20 tokens
    hinted = req("hinted", prompt=10, max_tokens=1000, hint=5, arrival=5.0)  # 15 tokens
    assert ids(admission_order([long, short, hinted], now=5.0, p=params)) == \
        ["hinted", "short", "long"]
    # long ages 10 tokens/s: 200 - 10*t vs a 20-token newcomer at t: long wins after t=18.
    newcomer = req("newcomer", prompt=10, max_tokens=10, arrival=18.5)
    assert ids(admission_order([newcomer, long], now=19.0, p=params)) == \
        ["long", "newcomer"]
    assert srpt_urgency(long, now=19.0, aging_rate=10.0) == 200 - 190


# ----- fair ----------------------------------------------------------------------------------

def test_vtc_charge_divides_by_weight():
    assert vtc_charge(10.0, 30, weight=3.0) == 20.0
    assert vtc_charge(0.0, 7, weight=1.0) == 7.0


def test_vtc_lift():
    # back into a queue where others wait: raised to the least-served waiting tenant
    assert vtc_lift(5.0, [40.0, 30.0], last_left_counter=None) == 30.0
    # never lowered
    assert vtc_lift(50.0, [40.0, 30.0], last_left_counter=None) == 50.0
    # nobody waiting: raised to the tenant that left last
    assert vtc_lift(5.0, [], last_left_counter=12.0) == 12.0
    assert vtc_lift(5.0, [], last_left_counter=None) == 5.0


def test_next_fair_picks_least_served_tenant_then_arrival():
    a1 = req("a1", tenant="a", arrival=0.0)
    b1 = req("b1", tenant="b", arrival=1.0)
    anon = req("anon", arrival=2.0)
    counters = {"a": 100.0, "b": 40.0, policy.DEFAULT_TENANT: 40.0}
    assert next_fair([a1, b1, anon], counters) is b1
    assert next_fair([a1, anon], counters) is anon
    assert next_fair([a1, b1], {}) is a1  # all unserved: arrival order


def test_fair_urgency_is_the_tenant_counter():
    ledger = FairShareLedger()
    ledger.counters["t"] = 12.5
    r = req("r", tenant="t")
    assert make("fair", ledger).urgency(r, 0.0) == 12.5
    assert make("fair").urgency(req("x"), 0.0) == 0.0
    assert policy.tenant_of(req("x")) == policy.DEFAULT_TENANT


def test_tenant_weights_parse_and_validate():
    assert parse_tenant_weights("a=1, b=3.5") == {"a": 1.0, "b": 3.5}
    assert parse_tenant_weights("") == {}
    for bad in ("a", "a=0", "a=-1", "=2", "a=x", "a=nan"):
        with pytest.raises(ValueError, match="tenant_weights"):
            parse_tenant_weights(bad)
    with pytest.raises(ValueError, match="tenant_weights"):
        SchedulerConfig(tenant_weights="a=0")


@pytest.mark.parametrize("kwargs, field", [
    (dict(scheduling_policy="lifo"), "scheduling_policy"),
    (dict(priority_aging_rate=-1), "priority_aging_rate"),
    (dict(srpt_aging_rate=-0.5), "srpt_aging_rate"),
    (dict(admission_preemption_threshold=0), "admission_preemption_threshold"),
    (dict(max_head_bypasses=-1), "max_head_bypasses"),
])
def test_scheduler_config_names_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_the_registry_rejects_an_unknown_policy():
    with pytest.raises(ValueError, match="scheduling policy"):
        policy_class("random")


# ----- preemption at admission, head-of-line bypass ----------------------------------------

def test_admission_victim_is_least_urgent_beyond_threshold():
    a, b, c = req("a", arrival=0.0), req("b", arrival=1.0), req("c", arrival=2.0)
    running = [(a, 3.0), (b, 5.0), (c, 1.5)]
    assert policy.choose_admission_victim(0.0, running, threshold=1.0) is b
    # b is protected (recently resumed or admitted by preemption): the next least urgent
    assert policy.choose_admission_victim(0.0, running, 1.0, protected={"b"}) is a
    # nobody is less urgent by the threshold
    assert policy.choose_admission_victim(0.0, running, threshold=6.0) is None
    assert policy.choose_admission_victim(0.0, [], threshold=1.0) is None


def test_admission_victim_ties_go_to_latest_arrival():
    a, b = req("a", arrival=0.0), req("b", arrival=1.0)
    assert policy.choose_admission_victim(0.0, [(a, 4.0), (b, 4.0)], 1.0) is b


def test_threshold_defaults_and_fcfs_never_preempts_at_admission():
    assert policy_class("priority").default_admission_threshold == 0.5
    assert policy_class("srpt").default_admission_threshold > 1.0
    assert not policy_class("fcfs").may_preempt_at_admission
    assert all(policy_class(p).may_preempt_at_admission for p in ("priority", "srpt", "fair"))


def test_may_bypass_bound():
    assert policy.may_bypass(0, 3) and policy.may_bypass(2, 3)
    assert not policy.may_bypass(3, 3)
    assert not policy.may_bypass(0, 0)  # strict order


def test_running_order_by_policy_key_keeps_decodes_first():
    prefill = req("p", prompt=30, priority=0)
    d_low = req("dl", prompt=4, priority=5, computed=3)
    d_high = req("dh", prompt=4, priority=1, computed=3)
    assert ids(policy.running_order([prefill, d_low, d_high], key=lambda r: r.priority)) == \
        ["dh", "dl", "p"]
    assert ids(policy.running_order([prefill, d_low, d_high])) == ["dl", "dh", "p"]


# ----- queues ----------------------------------------------------------------------------------

def test_fcfs_queue_order_with_preempted_at_front():
    q = FCFSQueue()
    a, b, c = req("a"), req("b"), req("c")
    q.push_back(a)
    q.push_back(b)
    q.push_front(c)
    assert ids(q.in_order()) == ["c", "a", "b"]
    q.remove(a)
    assert ids(q) == ["c", "b"] and len(q) == 2 and q.peek() is c and q.pop() is c


def test_policy_queue_orders_by_the_given_key():
    q = PolicyQueue()
    rs = [req("a", priority=2, arrival=0.0), req("b", priority=0, arrival=1.0),
          req("c", priority=1, arrival=2.0)]
    for r in rs:
        q.push_back(r)
    q.push_front(req("d", priority=3, arrival=3.0))  # the key decides, not the end
    params = make("priority")
    key = lambda r: params.order_key(r, 5.0)  # noqa: E731
    assert ids(q.in_order(key)) == ["b", "c", "a", "d"]
    q.remove(rs[1])
    assert ids(q.in_order(key)) == ["c", "a", "d"] and len(q) == 3 and rs[0] in q
    assert not PolicyQueue()


def test_make_queue():
    assert isinstance(make("fcfs").make_queue(), FCFSQueue)
    for name in ("priority", "srpt", "fair"):
        assert isinstance(make(name).make_queue(), PolicyQueue)

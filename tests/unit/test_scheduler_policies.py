"""Out-of-order scheduling with a fake runner and a fake clock: priority inversion, aging
bounds under adversarial arrivals, fair shares, preemption at admission and its
anti-thrash rule, head-of-line bypass, and outputs that never depend on the policy."""

from __future__ import annotations

import random
import sys
import time
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treadle.config import SCHEDULING_POLICIES, CacheConfig, SchedulerConfig
from treadle.core import policies
from treadle.core.outputs import ModelRunnerOutput
from treadle.core.scheduler import Scheduler
from treadle.request import Request, RequestStatus
from treadle.sampling_params import SamplingParams

POLICIES = tuple(SCHEDULING_POLICIES)
"""Every registered policy (a new one is checked by the tests over all of them)."""


class FakeClock:
    """One second per step: tests control time exactly."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_scheduler(policy="priority", max_tokens=64, max_seqs=4, num_blocks=256,
                   block_size=4, mode="recompute", num_swap_blocks=0, clock=None,
                   prefix_caching=False, **options) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                        preemption_mode=mode, scheduling_policy=policy,
                        **{"admission_lookahead_tokens": 0, "kv_watermark": 0.0, **options}),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_kv_blocks=num_blocks, max_model_len=4096, num_swap_blocks=num_swap_blocks,
        clock=clock or FakeClock())


def make_request(rid, prompt_len, max_tokens, priority=0, arrival=0.0, tenant=None,
                 length_hint=None):
    rng = random.Random(rid)
    prompt = [rng.randrange(3, 1000) for _ in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=2, arrival_time=arrival, priority=priority, tenant=tenant,
                   length_hint=length_hint)


def fake_runner(output):
    """The sampled token depends only on its position, as a real model's would depend
    only on the sequence: any schedule must give the same tokens."""
    return ModelRunnerOutput(sampled_token_ids={
        s.request_id: [7 + (s.num_computed_tokens + s.num_scheduled_tokens) % 11]
        for s in output.scheduled if s.sample})


def expected_tokens(r: Request) -> list[int]:
    return [7 + (r.num_prompt_tokens + k) % 11 for k in range(r.sampling_params.max_tokens)]


def step(sched, clock=None):
    out = sched.schedule()
    sched.update_from_output(out, fake_runner(out))
    if clock is not None:
        clock.t += 1.0
    return out


def replay(sched, clock, requests, max_steps=20_000, on_step=None):
    """Add each request when the clock reaches its arrival; step until all are done."""
    pending = sorted(requests, key=lambda r: r.arrival_time)
    steps = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0].arrival_time <= clock.t:
            sched.add_request(pending.pop(0))
        if on_step is not None:
            on_step(sched)
        step(sched, clock)
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


# ----- priority inversion ------------------------------------------------------------------

@pytest.mark.parametrize("mode, swap", [("recompute", 0), ("swap", 64)])
def test_priority_inversion_resolved_within_one_step_when_batch_is_full(mode, swap):
    clock = FakeClock()
    sched = make_scheduler("priority", max_seqs=4, mode=mode, num_swap_blocks=swap,
                           clock=clock)
    # One level apart, with the default aging and threshold: lows that have been in the
    # engine for 12 s are still displaced by a fresh high-priority request.
    lows = [make_request(f"low{i}", 8, 50, priority=1, arrival=0.0) for i in range(6)]
    for r in lows:
        sched.add_request(r)
    for _ in range(12):  # lows fill all 4 slots and decode
        step(sched, clock)
    assert sched.num_running == 4
    high = make_request("high", 8, 4, priority=0, arrival=clock.t)
    sched.add_request(high)
    out = step(sched, clock)
    assert "high" in {s.request_id for s in out.scheduled}
    assert len(out.preempted_request_ids) == 1
    victim = sched.requests[out.preempted_request_ids[0]]
    assert victim.priority == 1 and victim.request_id != "high"
    assert sched.stats.num_admission_preemptions == 1
    while not high.is_finished:
        step(sched, clock)
    assert high.output_token_ids == expected_tokens(high)
    replay(sched, clock, [])
    assert all(r.output_token_ids == expected_tokens(r) for r in lows)
    assert sched.kv.pool.num_free_blocks == 256


def test_priority_inversion_resolved_within_one_step_when_kv_is_full():
    clock = FakeClock()
    # 12 blocks of 4 tokens; three lows of 16 prompt tokens hold all of them.
    sched = make_scheduler("priority", max_seqs=8, num_blocks=12, clock=clock)
    lows = [make_request(f"low{i}", 15, 30, priority=3) for i in range(3)]
    for r in lows:
        sched.add_request(r)
    step(sched, clock)
    step(sched, clock)
    assert sched.kv.pool.num_free_blocks == 0 and sched.num_running == 3
    high = make_request("high", 10, 3, priority=0, arrival=clock.t)
    sched.add_request(high)
    out = step(sched, clock)
    assert "high" in {s.request_id for s in out.scheduled}
    assert out.preempted_request_ids  # a low lost its blocks, no low took the slot
    assert all(sched.requests[rid].priority == 3 for rid in out.preempted_request_ids)
    replay(sched, clock, [])
    assert all(r.output_token_ids == expected_tokens(r) for r in lows + [high])


def test_no_admission_preemption_below_threshold_or_under_fcfs():
    for policy, options in (("priority", dict(admission_preemption_threshold=2.0)),
                            ("fcfs", {}),
                            ("priority", dict(admission_preemption=False))):
        clock = FakeClock()
        sched = make_scheduler(policy, max_seqs=2, clock=clock, **options)
        for i in range(2):
            sched.add_request(make_request(f"low{i}", 4, 20, priority=1))
        step(sched, clock)
        sched.add_request(make_request("high", 4, 2, priority=0, arrival=clock.t))
        out = step(sched, clock)
        assert "high" not in {s.request_id for s in out.scheduled}, (policy, options)
        assert sched.stats.num_preemptions == 0


@pytest.mark.parametrize("wait_steps", [16, 0])
def test_an_urgent_request_waits_for_a_slot_that_frees_within_the_wait_steps(wait_steps):
    """The soak's finding: urgent arrivals preempted a running request 0.5 times per
    request while some running request ended every few steps anyway. A low with 5 tokens
    left frees its slot within admission_preemption_wait_steps: the high waits for it
    (no preemption) and starts once it ends; with 0 it preempts at once."""
    clock = FakeClock()
    sched = make_scheduler("priority", max_seqs=2, clock=clock,
                           admission_preemption_threshold=1.0,
                           admission_preemption_wait_steps=wait_steps)
    lows = [make_request("short", 4, 8, priority=5), make_request("long", 4, 60, priority=5)]
    for r in lows:
        sched.add_request(r)
    for _ in range(3):  # "short" has 5 tokens left, "long" 57
        step(sched, clock)
    high = make_request("high", 4, 3, priority=0, arrival=clock.t)
    sched.add_request(high)
    out = step(sched, clock)
    if wait_steps == 0:
        assert "high" in {s.request_id for s in out.scheduled}
        assert sched.stats.num_admission_preemptions == 1
    else:
        assert "high" not in {s.request_id for s in out.scheduled}
        while not lows[0].is_finished:
            step(sched, clock)
        out = step(sched, clock)
        assert "high" in {s.request_id for s in out.scheduled}
        assert sched.stats.num_preemptions == 0
    replay(sched, clock, [])
    assert all(r.output_token_ids == expected_tokens(r) for r in lows + [high])


def test_anti_thrash_two_requests_do_not_trade_places_every_step():
    """fair, one slot, two tenants: the counters cross every step, but a request admitted
    by preemption keeps its place for preemption_cooldown_steps."""
    clock = FakeClock()
    sched = make_scheduler("fair", max_seqs=1, clock=clock, preemption_cooldown_steps=6,
                           admission_preemption_threshold=1.0)
    a = make_request("a", 2, 60, tenant="x")
    b = make_request("b", 2, 60, tenant="y")
    preempt_steps = []
    sched.add_request(a)
    sched.add_request(b)
    n = 0
    while sched.has_unfinished_requests():
        out = step(sched, clock)
        if out.preempted_request_ids:
            preempt_steps.append(n)
        n += 1
    gaps = [y - x for x, y in zip(preempt_steps, preempt_steps[1:])]
    assert preempt_steps, "the fair policy should take turns"
    assert min(gaps) >= 6, preempt_steps
    assert a.output_token_ids == expected_tokens(a) and b.output_token_ids == expected_tokens(b)


def test_srpt_nearly_equal_requests_do_not_swap():
    clock = FakeClock()
    sched = make_scheduler("srpt", max_seqs=1, clock=clock, admission_preemption_threshold=8)
    sched.add_request(make_request("running", 4, 40))
    step(sched, clock)
    sched.add_request(make_request("almost", 4, 36, arrival=clock.t))  # 3 tokens shorter
    replay(sched, clock, [])
    assert sched.stats.num_preemptions == 0


# ----- head-of-line blocking -----------------------------------------------------------------

# Under makespan the smalls' hinted 40 outputs put them ahead of big (2): big is never
# at the head while they wait, so there is nothing to bypass.
@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "makespan"])
@pytest.mark.parametrize("max_bypasses", [0, 3])
def test_big_request_does_not_block_small_ones_but_is_passed_at_most_n_times(
        policy, max_bypasses):
    clock = FakeClock()
    # 10 blocks of 4 tokens. "hog" holds 6 blocks for a while; "big" needs 8.
    sched = make_scheduler(policy, max_tokens=64, max_seqs=8, num_blocks=10, clock=clock,
                           max_head_bypasses=max_bypasses, admission_preemption=False)
    hog = make_request("hog", 20, 4, arrival=0.0)
    sched.add_request(hog)
    step(sched, clock)
    big = make_request("big", 30, 2, arrival=1.0)
    # Small in KV, but (by their hint) more remaining work than big: behind it under srpt.
    smalls = [make_request(f"s{i}", 2, 1, arrival=1.0 + 0.01 * (i + 1), length_hint=40)
              for i in range(6)]
    admitted_order = []

    def watch(s):
        for r in [big] + smalls:
            if r.first_scheduled_time is not None and r.request_id not in admitted_order:
                admitted_order.append(r.request_id)

    replay(sched, clock, [big] + smalls, on_step=watch)
    watch(sched)
    num_before_big = admitted_order.index("big")
    assert num_before_big == max_bypasses, admitted_order
    assert sched.stats.num_head_bypasses == max_bypasses
    assert all(r.output_token_ids == expected_tokens(r) for r in [hog, big] + smalls)


# ----- aging bounds under adversarial arrivals -------------------------------------------

def aging_key(policy, r):
    """The request's urgency at arrival, in the unit the aging rate works in."""
    if policy == "priority":
        return r.priority
    return r.num_prompt_tokens + r.sampling_params.max_tokens


arrivals = st.lists(
    st.tuples(st.integers(0, 3),        # gap to the previous arrival, in steps
              st.integers(1, 8),        # prompt tokens
              st.integers(1, 8),        # max_tokens
              st.integers(0, 4)),       # priority
    min_size=10, max_size=60)


@pytest.mark.parametrize("policy, rate_option, rate", [
    ("priority", "priority_aging_rate", 0.5),
    ("srpt", "srpt_aging_rate", 2.0),
])
@given(items=arrivals, max_seqs=st.integers(1, 3), num_blocks=st.sampled_from([8, 64]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_request_completes_within_the_aging_bound(policy, rate_option, rate, items,
                                                        max_seqs, num_blocks):
    """A request with key K arriving at a outranks every request arriving after
    T = a + (K - K_min) / rate. After T, every step serves some request that arrived
    before T (or it), or one of at most max_head_bypasses requests that passed it; so its
    wait is at most (T - a) plus the work of those requests, one token per step."""
    clock = FakeClock()
    sched = make_scheduler(policy, max_tokens=16, max_seqs=max_seqs, num_blocks=num_blocks,
                           mode="swap", num_swap_blocks=256, clock=clock,
                           preemption_cooldown_steps=2, admission_preemption_threshold=1.0,
                           max_head_bypasses=2, **{rate_option: rate})
    requests, t = [], 0
    for i, (gap, prompt, max_tokens, priority) in enumerate(items):
        t += gap
        requests.append(make_request(f"r{i}", prompt, max_tokens, priority, float(t)))
    replay(sched, clock, requests)
    key_min = min(aging_key(policy, r) for r in requests)
    longest_job = max(r.num_prompt_tokens + r.sampling_params.max_tokens for r in requests)
    for r in requests:
        assert r.output_token_ids == expected_tokens(r)
        horizon = r.arrival_time + (aging_key(policy, r) - key_min) / rate
        ahead = sum(o.num_prompt_tokens + o.sampling_params.max_tokens for o in requests
                    if o is not r and o.arrival_time <= horizon)
        bound = (horizon - r.arrival_time) + ahead + r.num_prompt_tokens + 2 * longest_job + 1
        wait = r.first_token_time - r.arrival_time
        assert wait <= bound, (r.request_id, wait, bound)
    assert sched.kv.pool.num_free_blocks == num_blocks


def test_without_aging_a_low_priority_request_starves_behind_a_stream():
    """The adversary of the test above, made deterministic: a stream of urgent requests
    that keeps both slots busy. Without aging the low one waits for the whole stream;
    with 0.5 levels/s it starts after about 2 levels / 0.5 = 4 s plus the work ahead."""
    def low_wait(rate):
        clock = FakeClock()
        sched = make_scheduler("priority", max_seqs=2, clock=clock, priority_aging_rate=rate,
                               priority_aging=0.0)  # the linear aging alone
        low = make_request("low", 4, 4, priority=2, arrival=9.0)
        stream = [make_request(f"h{i}", 4, 6, priority=0, arrival=float(i * 2))
                  for i in range(150)]
        replay(sched, clock, [low] + stream)
        return low.first_token_time - low.arrival_time

    assert low_wait(0.0) > 250
    assert low_wait(0.5) < 30


# ----- fair share ------------------------------------------------------------------------------

@pytest.mark.parametrize("weights, share_b", [("", 0.5), ("a=1,b=3", 0.75), ("a=3,b=1", 0.25)])
def test_two_tenants_at_10_to_1_load_get_their_weighted_shares(weights, share_b):
    clock = FakeClock()
    sched = make_scheduler("fair", max_tokens=32, max_seqs=4, num_blocks=512, clock=clock,
                           tenant_weights=weights)
    rng = random.Random(0)
    requests = []
    for i in range(800):  # tenant a offers ten times what tenant b offers
        tenant = "b" if i % 11 == 0 else "a"
        requests.append(make_request(f"{tenant}{i}", rng.randint(8, 24), rng.randint(8, 24),
                                     arrival=float(i // 8), tenant=tenant))
    served = {"a": 0, "b": 0}
    by_id = {r.request_id: r for r in requests}

    pending = sorted(requests, key=lambda r: r.arrival_time)
    while pending or sched.has_unfinished_requests():
        while pending and pending[0].arrival_time <= clock.t:
            sched.add_request(pending.pop(0))
        waiting_tenants = {r.tenant for r in list(sched.waiting) + list(sched.swapped)}
        out = step(sched, clock)
        if waiting_tenants >= {"a", "b"}:  # both backlogged
            for s in out.scheduled:
                served[by_id[s.request_id].tenant] += s.num_scheduled_tokens
        elif not any(r.tenant == "b" for r in pending):
            break  # b will not be backlogged again
    total = served["a"] + served["b"]
    assert total > 2500, served  # a long window with both tenants backlogged
    assert served["b"] / total == pytest.approx(share_b, rel=0.10), served


def test_tenant_weight_can_be_set_at_run_time():
    sched = make_scheduler("fair")
    sched.set_tenant_weight("gold", 4)
    assert sched.tenant_weights["gold"] == 4.0
    with pytest.raises(ValueError, match="weight"):
        sched.set_tenant_weight("x", 0)


def test_returning_tenant_banks_no_credit():
    """A tenant idle while another was served starts from the others' level (VTC lift)."""
    clock = FakeClock()
    sched = make_scheduler("fair", max_seqs=2, clock=clock)
    sched.add_request(make_request("a0", 8, 40, tenant="a"))
    sched.add_request(make_request("a1", 8, 40, tenant="a"))
    sched.add_request(make_request("a2", 8, 40, tenant="a"))
    for _ in range(10):
        step(sched, clock)
    sched.add_request(make_request("b0", 8, 4, tenant="b", arrival=clock.t))
    assert sched.tenant_counters["b"] == pytest.approx(sched.tenant_counters["a"])


# ----- order of completion and outputs ------------------------------------------------------

def test_srpt_finishes_out_of_arrival_order_with_tokens_in_order():
    clock = FakeClock()
    sched = make_scheduler("srpt", max_seqs=1, clock=clock, admission_preemption_threshold=4)
    long = make_request("long", 8, 60, arrival=0.0)
    shorts = [make_request(f"short{i}", 4, 3, arrival=1.0 + i) for i in range(3)]
    finished = []
    pending = [long] + shorts
    while pending or sched.has_unfinished_requests():
        while pending and pending[0].arrival_time <= clock.t:
            sched.add_request(pending.pop(0))
        out = sched.schedule()
        for o in sched.update_from_output(out, fake_runner(out)):
            if o.finished:
                finished.append(o.request_id)
        clock.t += 1
    assert finished[-1] == "long" and finished.index("short0") < finished.index("long")
    for r in [long] + shorts:
        assert r.output_token_ids == expected_tokens(r)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode, swap", [("recompute", 0), ("swap", 24)])
def test_tokens_never_depend_on_the_policy(policy, mode, swap):
    """Random arrivals, priorities, tenants and hints on a tight cache: every request gets
    the tokens of its own sequence, and every block comes back."""
    for seed in range(25):
        rng = random.Random(seed)
        clock = FakeClock()
        num_blocks = rng.choice([8, 12, 40])
        sched = make_scheduler(policy, max_tokens=rng.choice([8, 16, 32]),
                               max_seqs=rng.choice([1, 2, 4]), num_blocks=num_blocks,
                               mode=mode, num_swap_blocks=swap, clock=clock,
                               prefix_caching=bool(seed % 2),
                               max_head_bypasses=rng.choice([0, 2, 16]),
                               admission_preemption_threshold=rng.choice([None, 1.0]),
                               tenant_weights="a=1,b=3")
        requests = [make_request(f"s{seed}r{i}", rng.randint(1, 12), rng.randint(1, 12),
                                 priority=rng.randint(0, 3), arrival=rng.uniform(0, 30),
                                 tenant=rng.choice(["a", "b", None]),
                                 length_hint=rng.choice([None, 3]))
                    for i in range(25)]

        def check(s):
            assert len(s.running) <= s.config.max_num_seqs

        replay(sched, clock, requests, on_step=check)
        for r in requests:
            assert r.status == RequestStatus.FINISHED_LENGTH
            assert r.output_token_ids == expected_tokens(r), (seed, r.request_id)
        assert sched.kv.pool.num_free_blocks == num_blocks
        sched.kv.pool.check_invariants()
        if sched.kv.swap_pool is not None:
            assert sched.kv.swap_pool.num_free_blocks == swap


@pytest.mark.parametrize("policy", POLICIES)
def test_abort_anywhere_under_every_policy(policy):
    clock = FakeClock()
    sched = make_scheduler(policy, max_seqs=2, num_blocks=8, mode="swap", num_swap_blocks=16,
                           clock=clock, admission_preemption_threshold=1.0)
    rs = [make_request(f"r{i}", 6, 20, priority=3 - i, tenant="ab"[i % 2], arrival=float(i))
          for i in range(4)]
    for r in rs:
        sched.add_request(r)
        step(sched, clock)
    for r in rs:
        sched.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.num_free_blocks == 8 and sched.kv.swap_pool.num_free_blocks == 16
    assert not sched.fair_share.num_queued


# ----- the replay driver of the measurements --------------------------------------------------

class FakeEngine:
    """EngineCore's surface for treadle.bench.scheduling.replay, over a real Scheduler."""

    def __init__(self, policy):
        self.scheduler = make_scheduler(policy, max_seqs=2, clock=time.monotonic)

    def add_request(self, request):
        self.scheduler.add_request(request)

    def has_unfinished_requests(self):
        return self.scheduler.has_unfinished_requests()

    def step(self):
        out = self.scheduler.schedule()
        return self.scheduler.update_from_output(out, fake_runner(out))

    def stats(self):
        return {"num_steps": self.scheduler.stats.num_steps}


def test_replay_measures_every_request_and_priority_reorders():
    from treadle.bench.scheduling import ReplayRequest, mixed_priority_workload, replay, summarize

    workload = mixed_priority_workload(duration_s=0.3, background_rate=40, high_rate=10,
                                       background_prompt=(4, 8), background_output=(20, 30),
                                       high_prompt=(2, 4), high_output=(2, 3), vocab_size=500)
    assert workload == mixed_priority_workload(duration_s=0.3, background_rate=40, high_rate=10,
                                               background_prompt=(4, 8),
                                               background_output=(20, 30), high_prompt=(2, 4),
                                               high_output=(2, 3), vocab_size=500)
    labels = {r.label for r in workload}
    assert labels == {"high", "background"}
    result = replay(FakeEngine("priority"), workload)
    assert all(t.e2e is not None and t.ttft <= t.e2e for t in result.timings)
    assert [t.num_output_tokens for t in sorted(result.timings, key=lambda t: int(t.request_id))] \
        == [r.max_tokens for r in workload]
    summary = summarize(result, ["high", "background"])
    assert summary["high"]["num_requests"] + summary["background"]["num_requests"] == len(workload)
    assert summary["total_tokens_per_s"] > 0
    # an idle gap: the driver sleeps until the next arrival, and TTFT counts from arrival
    late = [ReplayRequest([5, 6], 2, 0.0), ReplayRequest([5, 6], 2, 0.2)]
    result = replay(FakeEngine("fcfs"), late)
    assert result.wall_s >= 0.2 and all(t.ttft < 0.1 for t in result.timings)


# ----- urgent prefill isolation ------------------------------------------------------------

@pytest.mark.parametrize("isolate", [True, False])
def test_urgent_prefill_step_defers_background_chunks(isolate):
    clock = FakeClock()
    # finish_prompts_first and priority_yield off: this test is about isolation alone
    # (with the first, the long chunk would wait behind the urgent prompt either way; with
    # the second, it would shrink to the yielding classes' bound).
    sched = make_scheduler("priority", max_tokens=64, max_seqs=8, clock=clock,
                           isolate_urgent_prefill=isolate, finish_prompts_first=False,
                           priority_yield=False)
    # Two lows decode; a third has a long prompt that is being prefilled in chunks.
    lows = [make_request(f"low{i}", 8, 40, priority=1) for i in range(2)]
    long_low = make_request("long", 400, 4, priority=1, arrival=0.1)
    for r in lows + [long_low]:
        sched.add_request(r)
    for _ in range(3):
        step(sched, clock)
    assert long_low.num_computed_tokens < long_low.num_prompt_tokens
    high = make_request("high", 20, 4, priority=0, arrival=clock.t)
    sched.add_request(high)
    out = step(sched, clock)
    tokens = {s.request_id: s.num_scheduled_tokens for s in out.scheduled}
    assert tokens["high"] == 20
    if isolate:
        # The urgent step is the urgent prompt alone...
        assert tokens == {"high": 20}
        out = step(sched, clock)
        # ...and the background decodes and chunk run in the next one, with its decode.
        tokens = {s.request_id: s.num_scheduled_tokens for s in out.scheduled}
        assert tokens == {"high": 1, "low0": 1, "low1": 1, "long": 64 - 3}
    else:
        assert tokens == {"high": 20, "low0": 1, "low1": 1, "long": 64 - 22}
    replay(sched, clock, [])
    assert all(r.output_token_ids == expected_tokens(r) for r in lows + [long_low, high])


def test_same_class_prefills_share_a_step_whatever_their_age():
    clock = FakeClock()
    sched = make_scheduler("priority", max_tokens=64, max_seqs=8, clock=clock,
                           priority_aging_rate=1.0)
    old = make_request("old", 40, 2, priority=1, arrival=0.0)
    sched.add_request(old)
    clock.t = 30.0  # 30 levels of aging apart, same class: no isolation
    young = make_request("young", 10, 2, priority=1, arrival=clock.t)
    sched.add_request(young)
    out = step(sched, clock)
    assert {s.request_id for s in out.scheduled} == {"old", "young"}


def test_a_new_policy_is_one_module_and_one_registry_line(monkeypatch):
    """Last come, first served, added as a new policy is: a module of core/policies/
    whose POLICY is a SchedulingPolicy subclass, and its line in the registry
    (config.SCHEDULING_POLICIES). The config accepts its name and the scheduler runs it,
    most urgent (latest) first."""

    class LastComeFirstServed(policies.SchedulingPolicy):
        def urgency(self, request, now):
            return -request.arrival_time

    module = types.ModuleType("treadle.core.policies.lcfs")
    module.POLICY = LastComeFirstServed
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(SCHEDULING_POLICIES, "lcfs", "latest arrival first")
    sched = make_scheduler("lcfs", max_tokens=8, max_seqs=1)
    assert isinstance(sched.policy, LastComeFirstServed) and sched.policy.name == "lcfs"
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 4, 2, arrival=float(i)))
    order = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        order += [s.request_id for s in out.scheduled if s.request_id not in order]
        sched.update_from_output(out, fake_runner(out))
    assert order == ["r2", "r1", "r0"]

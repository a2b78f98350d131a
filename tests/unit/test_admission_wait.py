"""Overload that says so, early (issue 50, item 4), as pure bookkeeping with time passed
in: the wait for a slot predicted from the work already admitted (server/wait_model.py),
the queue-delay bound with its Retry-After, 503 for a saturated server and 429 for a
tenant over its own limits, each with its reason, and sizes estimated before
tokenization then settled."""

from __future__ import annotations

import math

import pytest

from treadle.server.admission import (AdmissionControl, AdmissionLimits, NeverAdmissible,
                                      Overloaded, conversation_tokens, estimate_tokens,
                                      prompt_tokens)
from treadle.server.wait_model import ServiceModel, Slotted, start_in_steps

STEP_S = 0.01


def control(delay: float = 10.0, priority_ordered: bool = False, aging: float = 0.0,
            slots: int = 2, **limits) -> AdmissionControl:
    options = dict(max_waiting_requests=10_000, max_waiting_tokens=10**9,
                   tenant_max_concurrent_requests=10_000, tenant_tokens_per_minute=0,
                   max_queue_delay_s=delay, priority_ordered=priority_ordered,
                   aging_bound=aging, max_num_seqs=slots, step_token_budget=64,
                   num_kv_tokens=10**6)
    options.update(limits)
    return AdmissionControl(AdmissionLimits(**options))


def run(c: AdmissionControl, ticket, tokens: int, start: float) -> float:
    """The request starts at `start` and streams `tokens` tokens, one per STEP_S."""
    for k in range(1, tokens + 1):
        c.progressed(ticket, k, start + (k - 1) * STEP_S)
    return start + (tokens - 1) * STEP_S


def test_slots_free_in_the_order_their_work_ends():
    # running requests end after 5 and 10 steps; two waiting requests of 3 and 4 steps
    # take the slot freed at 5 (3 steps: free at 8), then that one (4 steps: free at 12);
    # the next request gets the slot freed at 10
    assert start_in_steps([5, 10], [3, 4], 2) == 10
    assert start_in_steps([5], [], 2) == 0  # a free slot: no wait
    assert start_in_steps([5, 7, 9], [], 2) == 5  # more running than slots: all hold one


def test_the_wait_is_the_admitted_work_ahead_over_the_slots_at_the_measured_step_time():
    c = control(slots=2)
    running = [c.admit("t", 10, 100, 0.0) for _ in range(2)]
    now = max(run(c, t, 10, 0.0) for t in running)  # 10 tokens each at STEP_S a token
    assert c.service.step_seconds(now) == pytest.approx(STEP_S)
    for _ in range(3):  # waiting, each 1 chunk of prompt + 100 tokens: 101 steps
        c.admit("t", 10, 100, now)
    # slots free after 90 steps (both); the 3 waiting take them at 90, 90, 191: the next
    # slot frees at 191 steps
    assert c.predicted_wait(0, now) == pytest.approx(191 * STEP_S)


def test_the_queue_bound_in_requests_follows_from_the_slots_and_the_cost_per_token():
    c = control(delay=10.0, slots=2)
    assert c.queue_bound(0.0) is None  # nothing measured yet
    running = [c.admit("t", 10, 100, 0.0) for _ in range(2)]
    now = max(run(c, t, 10, 0.0) for t in running)
    # 101 steps a request (1 chunk + 100 tokens) at 10 ms: 1.01 s a turn, 2 slots, 10 s
    bound, slots, step_s = c.queue_bound(now)
    assert (bound, slots) == (19, 2) and step_s == pytest.approx(STEP_S)


def test_the_issue_soak_deep_overload_is_bounded_without_any_start_rate():
    """The issue's soak: few requests start per minute (long outputs), and the first
    prediction (requests ahead over the starts of the last minute) had no rate to go on,
    so it admitted everything and 104 of 201 accepted requests hit the client's 60 s
    timeout. The admitted work bounds it from the second token on."""
    c = control(delay=10.0, slots=2)
    running = [c.admit("t", 100, 2000, 0.0) for _ in range(2)]
    now = max(run(c, t, 2, 0.0) for t in running)
    admitted = 0
    with pytest.raises(Overloaded) as refused:
        for _ in range(100):
            c.admit("t", 100, 2000, now)
            admitted += 1
    # prior output 256 tokens each: the running pair frees its slots after 254 steps,
    # a queued request holds one for 2 + 256: 2 queued wait 2.54 s, 4 wait 5.12 s ...
    assert admitted == 6
    assert refused.value.status == 503 and refused.value.reason == "queue_delay"
    wait = c.predicted_wait(0, now)
    assert 10.0 < wait < 12.0
    assert refused.value.retry_after_s == math.ceil(wait - 10.0 + 1.0)


def test_the_share_of_max_tokens_used_replaces_the_prior_once_requests_finish():
    model = ServiceModel(max_num_seqs=4, step_token_budget=64, num_kv_tokens=10**6)
    assert model.expected_output(1000, model.output_share()) == 256  # the prior
    assert model.expected_output(100, model.output_share()) == 100
    for _ in range(8):
        model.note_finished(generated=50, max_tokens=1000)  # chat: stops early
    assert model.output_share() == pytest.approx(0.05)
    assert model.expected_output(1000, model.output_share()) == pytest.approx(50)


def test_slots_are_what_ran_while_others_waited_else_max_num_seqs_within_the_kv_cache():
    model = ServiceModel(max_num_seqs=128, step_token_budget=64, num_kv_tokens=1000)
    admitted = [Slotted(100, 100)] * 4  # 150 tokens each halfway: the KV cache holds 6
    assert model.num_slots(admitted, 0) == 6
    model.note_saturated(3, now=0.0)
    assert model.num_slots(admitted, 0) == 3
    assert model.num_slots(admitted, 7) == 7  # never fewer than are running


def test_the_slots_are_learned_only_while_a_request_waits_in_the_engine_itself():
    """A start while another request is still being tokenized (reserved, not handed to the
    engine) says nothing of the engine's slots: once it did (the isolation tests' hostile
    grammar, compiling while a stream started), one running stream taught the server a
    single slot and it refused the next request with a 45 s predicted wait."""
    c = control(slots=128)
    running = c.admit("t", 10, 300, 0.0)
    c.reserve("t", 10, 20, 0.0)  # being tokenized
    run(c, running, 3, 1.0)
    assert not c.service._concurrency
    handed = c.admit("t", 10, 20, 1.1)  # in the engine, and still not started 3 steps on
    assert handed.settled_at == 1.1
    other = c.admit("t", 10, 20, 1.1)
    c.progressed(other, 1, 1.2)
    assert list(c.service._concurrency) == [(1.2, 2)]


def test_a_request_whose_last_output_came_holds_no_slot_while_its_stream_is_sent():
    """With one slot, the previous request's stream still being sent when the next one
    started counted two running: the server learned two slots and admitted twice what
    waits 10 s (the deep-overload soak's accepted requests then waited up to 35 s)."""
    c = control(slots=1)
    first = c.admit("t", 10, 5, 0.0)
    run(c, first, 5, 0.0)
    c.progressed(first, 5, 0.05, ended=True)  # its last output; the client still reads
    assert c.num_running == 0
    second = c.admit("t", 10, 5, 0.06)
    waiting = c.admit("t", 10, 5, 0.06)  # in the engine, waiting for the one slot
    c.progressed(second, 1, 0.2)
    assert list(c.service._concurrency) == [(0.2, 1)]
    assert not waiting.started


def test_the_engines_own_timing_of_finished_requests_wins_over_a_slow_readers_gaps():
    model = ServiceModel(max_num_seqs=4, step_token_budget=64, num_kv_tokens=10**6)
    for _ in range(10):
        model.note_gap(0.2, 1)  # a client that reads slowly: the server passes tokens late
    assert model.step_seconds(0.0) == pytest.approx(0.2)
    model.note_finished(100, 100, seconds_per_token=0.01)  # first token to finish, engine
    assert model.step_seconds(1.0) == pytest.approx(0.01)


def test_a_preemption_gap_does_not_count_as_a_step():
    model = ServiceModel(max_num_seqs=4, step_token_budget=64, num_kv_tokens=10**6)
    for _ in range(20):
        model.note_gap(0.01, 1)
    model.note_gap(5.0, 1)  # waited out a preemption
    model.note_gap(0.04, 2)  # two tokens in one step (speculation): 0.02 a token
    assert model.step_seconds(0.0) == pytest.approx((20 * 0.01 + 0.02) / 21)


def test_under_the_priority_policy_only_the_as_urgent_wait_ahead():
    c = control(delay=3.0, priority_ordered=True, slots=1)
    [first] = [c.admit("t", 10, 50, 0.0, priority=0)]
    now = run(c, first, 2, 0.0)
    background = 0
    with pytest.raises(Overloaded):
        for _ in range(50):  # the background piles up until its wait passes 3 s
            c.admit("t", 10, 50, now, priority=5)
            background += 1
    assert background >= 1
    urgent = c.admit("t", 10, 50, now, priority=-5)  # nobody ahead of it
    assert urgent.priority == -5
    assert c.predicted_wait(-5, now) < c.predicted_wait(5, now)


def test_more_urgent_arrivals_that_overtake_stretch_the_wait_and_can_take_every_slot():
    """Under the priority policy the more urgent arrivals of the last minute take a share
    rho of the slots; a waiting request of lower priority waits W / (1 - rho), and when
    they take all of it, for as long as they do (refused, Retry-After 60)."""
    def urgent_load(num_urgent: int) -> AdmissionControl:
        c = control(delay=1000.0, priority_ordered=True, slots=1)
        for k in range(num_urgent):  # each holds the slot 1 + 50 steps = 0.51 s
            ticket = c.admit("t", 10, 50, k * 1.0, priority=-5)
            c.progressed(ticket, 1, k * 1.0 + 0.5)
            c.progressed(ticket, 2, k * 1.0 + 0.5 + STEP_S)
            c.release(ticket)
        return c

    now = 60.0
    calm, busy = control(delay=1000.0, priority_ordered=True, slots=1), urgent_load(30)
    for c in (calm, busy):
        t = c.admit("t", 10, 50, now - 1, priority=5)
        c.progressed(t, 1, now - 0.5)
        c.progressed(t, 2, now - 0.5 + STEP_S)
    calm.service.note_gap(STEP_S, 1)
    rho = busy.overtaking_share(5, now, 1, STEP_S)
    assert rho == pytest.approx(29 * 51 * STEP_S / 59.0)  # the 29 of the last minute
    assert busy.overtaking_share(-5, now, 1, STEP_S) == 0.0
    assert busy.predicted_wait(5, now) == pytest.approx(busy.predicted_wait(-5, now)
                                                       / (1 - rho))
    flooded = control(delay=10.0, priority_ordered=True, slots=1)
    for k in range(60):  # a 51-step request every 0.25 s: twice what one slot serves
        ticket = flooded.admit("t", 10, 50, k * 0.25, priority=-5)
        flooded.progressed(ticket, 1, k * 0.25)
        flooded.progressed(ticket, 2, k * 0.25 + STEP_S)
        flooded.release(ticket)
    assert flooded.predicted_wait(5, 15.0) == math.inf
    with pytest.raises(Overloaded,
                       match="as long as more urgent requests take every slot") as info:
        flooded.admit("t", 10, 10, 15.0, priority=5)
    assert info.value.retry_after_s == 60


def test_aging_caps_the_predicted_wait_of_the_least_urgent_class():
    """A request that has waited priority_aging mean waits outranks every class, so the
    overtaking stops there: the wait is at most the wait behind every waiting request
    plus aging_bound x the last minute's mean wait (the soak shed two thirds of its
    priority +5 requests with predicted waits of 55 s while those admitted started within
    6 s)."""
    def with_aging(aging: float) -> AdmissionControl:
        c = control(delay=0.0, priority_ordered=True, aging=aging, slots=1)
        for k in range(60):  # urgent traffic beyond what the slot serves; each waited 1 s
            ticket = c.admit("t", 10, 50, k * 0.25, priority=-5)
            c.progressed(ticket, 1, k * 0.25 + 1.0)
            c.progressed(ticket, 2, k * 0.25 + 1.0 + STEP_S)
            c.release(ticket)
        c.admit("t", 10, 50, 15.0, priority=5)
        return c

    now = 16.0
    plain, aged = with_aging(0.0), with_aging(4.0)
    assert plain.predicted_wait(5, now) == math.inf
    assert aged.mean_wait(now) == pytest.approx(1.0)
    behind_all = aged.service.predict_wait([], [t.slotted() for t in aged._tickets.values()],
                                           now, 1)
    assert aged.predicted_wait(5, now) == pytest.approx(behind_all + 4.0)


def test_saturation_is_a_503_and_a_tenant_over_its_limits_a_429_each_with_its_reason():
    full = control(max_waiting_requests=2)
    full.reserve("a", 10, 10, 0.0)
    full.reserve("a", 10, 10, 0.0)
    with pytest.raises(Overloaded) as queue:
        full.reserve("b", 10, 10, 0.0)  # another tenant: the server itself is full
    assert (queue.value.status, queue.value.reason) == (503, "queue_requests")
    with pytest.raises(Overloaded) as queued_tokens:
        control(max_waiting_tokens=15).reserve("a", 20, 1, 0.0)
    assert (queued_tokens.value.status, queued_tokens.value.reason) == (503, "queue_tokens")
    busy = control(tenant_max_concurrent_requests=1)
    busy.reserve("a", 10, 10, 0.0)
    with pytest.raises(Overloaded) as concurrency:
        busy.reserve("a", 10, 10, 0.0)
    assert (concurrency.value.status, concurrency.value.reason) == (429, "tenant_concurrency")
    busy.reserve("b", 10, 10, 0.0)  # another tenant is not held back
    quota = control(tenant_tokens_per_minute=100)
    quota.release(quota.reserve("b", 50, 40, 0.0))
    with pytest.raises(Overloaded) as tokens:
        quota.reserve("b", 10, 10, 30.0)
    assert (tokens.value.status, tokens.value.reason) == (429, "tenant_tokens")
    assert tokens.value.retry_after_s == 30  # when the t=0 charge leaves the window


def test_sizes_are_estimated_before_tokenization_and_settled_after():
    assert estimate_tokens("abcd" * 10) == 10 and estimate_tokens("") == 1
    assert prompt_tokens([1, 2, 3]) == 3 and prompt_tokens("abcdefgh") == 2
    assert conversation_tokens(["abcd", "abcdabcd"]) == 1 + 4 + 2 + 4
    c = control(tenant_tokens_per_minute=1000)
    ticket = c.reserve("a", prompt_tokens("x" * 400), 50, 0.0)
    assert c.num_waiting_tokens == 100
    c.settle(ticket, 130, 50)  # the tokenizer's count
    assert c.num_waiting_tokens == 130 and ticket.window_entry == [0.0, 180]
    with pytest.raises(NeverAdmissible, match="tenant_tokens_per_minute"):
        c.settle(c.reserve("a", 10, 10, 0.0), 990, 20)  # can never pass: a 400


def test_until_the_step_time_is_measured_only_the_caps_bound_the_queue():
    c = control(delay=0.1, max_waiting_requests=60)
    for _ in range(50):
        c.admit("t", 10, 10, 0.0)  # nothing has streamed: nothing to predict with
    assert c.predicted_wait(0, 0.0) is None

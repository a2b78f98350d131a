"""Policy functions as pure functions: victim loss, cooldown, preemption mode, running order."""

from __future__ import annotations

import pytest

from treadle.core import policy
from treadle.core.policy import PreemptionCosts, PreemptionMode, VictimWeights
from treadle.request import Request
from treadle.sampling_params import SamplingParams


def req(rid, computed=0, priority=0, arrival=0.0, resumed_step=None, uncomputed=1):
    r = Request(rid, [1] * (computed + uncomputed), SamplingParams(), arrival_time=arrival,
                priority=priority)
    r.num_computed_tokens = computed
    r.resumed_step = resumed_step
    return r


W = VictimWeights(priority_weight=1000.0, wait_weight=100.0)


def test_victim_loss_formula():
    r = req("a", computed=300, priority=2, arrival=10.0)
    assert policy.victim_loss(r, now=12.5, weights=W) == 300 - 2000 + 250


def test_least_work_is_preempted_first():
    a, b = req("a", computed=500, arrival=1.0), req("b", computed=40, arrival=1.0)
    assert policy.choose_victim([a, b], now=1.0, step=0, weights=W) is b


def test_less_urgent_priority_is_preempted_first_despite_more_work():
    urgent = req("urgent", computed=10, priority=0)
    background = req("bg", computed=900, priority=1)
    assert policy.choose_victim([urgent, background], now=0.0, step=0, weights=W) is background


def test_long_waiting_request_is_protected():
    old = req("old", computed=100, arrival=0.0)
    new = req("new", computed=300, arrival=9.0)
    # old: 100 + 100*10 = 1100; new: 300 + 100*1 = 400
    assert policy.choose_victim([old, new], now=10.0, step=0, weights=W) is new


def test_ties_go_to_the_latest_arrival():
    a = req("a", computed=50, arrival=1.0)
    later = req("later", computed=50, arrival=2.0)
    assert policy.choose_victim([a, later], now=2.0, step=0,
                                weights=VictimWeights(0, 0)) is later


def test_recently_resumed_request_is_spared_unless_alone():
    fresh = req("fresh", computed=1, resumed_step=98)
    settled = req("settled", computed=800, resumed_step=10)
    assert policy.choose_victim([fresh, settled], now=0, step=100, weights=W,
                                cooldown_steps=8) is settled
    assert policy.choose_victim([fresh], now=0, step=100, weights=W, cooldown_steps=8) is fresh
    assert policy.choose_victim([fresh, settled], now=0, step=100, weights=W,
                                cooldown_steps=0) is fresh


def test_choose_victim_needs_candidates():
    with pytest.raises(ValueError):
        policy.choose_victim([], now=0, step=0)


COSTS = PreemptionCosts(flops_per_token=2 * 135e6, compute_flops_per_s=300e9,
                        kv_bytes_per_token=23040, copy_bytes_per_s=10e9)


def test_cost_model_arithmetic():
    assert COSTS.recompute_seconds(1000) == pytest.approx(1000 * 2 * 135e6 / 300e9)
    assert COSTS.swap_seconds(1000) == pytest.approx(2 * 1000 * 23040 / 10e9)


@pytest.mark.parametrize("configured, room, expected", [
    ("recompute", True, PreemptionMode.RECOMPUTE),
    ("swap", True, PreemptionMode.SWAP),
    ("swap", False, PreemptionMode.RECOMPUTE),
    ("auto", False, PreemptionMode.RECOMPUTE),
])
def test_fixed_modes_and_fallback(configured, room, expected):
    assert policy.choose_preemption_mode(configured, 100, 112, room, COSTS) == expected


def test_auto_picks_the_cheaper():
    # Swapping a token costs 4.6 us out + in; recomputing it costs 0.9 ms: swap wins.
    assert policy.choose_preemption_mode("auto", 500, 512, True, COSTS) == PreemptionMode.SWAP
    slow_copy = PreemptionCosts(2 * 135e6, 300e9, 23040, copy_bytes_per_s=1e6)
    assert policy.choose_preemption_mode("auto", 500, 512, True, slow_copy) == \
        PreemptionMode.RECOMPUTE


def test_running_order_puts_decodes_first():
    prefill = req("p", computed=0, uncomputed=30)
    decode1, decode2 = req("d1", computed=5), req("d2", computed=9)
    assert policy.running_order([prefill, decode1, decode2]) == [decode1, decode2, prefill]

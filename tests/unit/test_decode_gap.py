"""The bound on prompt tokens in a step that carries decodes (core/decode_gap.py) on the
real Scheduler with a fake runner and a fake clock: a streamed answer's gap between
tokens is its step's length, so a step with decodes runs a short prompt chunk, and a step
without decodes keeps the whole budget; the auto value from the measured step costs;
outputs and blocks are unchanged."""

from __future__ import annotations

import pytest

from tests.unit.test_bands_and_deadlines import (POLICIES, FakeClock, expected_tokens,
                                                 make_request, make_scheduler, replay, step)
from treadle.config import SchedulerConfig
from treadle.core.decode_gap import decode_step_prefill_tokens
from treadle.core.step_cost import StepCostModel


def _prompt_tokens(out) -> int:
    return sum(s.num_scheduled_tokens for s in out.scheduled if not s.is_decoding)


def _decodes(out) -> int:
    return sum(1 for s in out.scheduled if s.is_decoding)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_step_with_decodes_runs_a_short_prompt_chunk_and_one_without_the_whole_budget(policy):
    """Under every policy: a long prompt alone runs in budget-sized chunks; once requests
    decode, every step that carries a decode runs at most decode_step_prefill_tokens
    prompt tokens (the second long prompt among them); outputs right, blocks freed."""
    clock = FakeClock()
    sched = make_scheduler(policy, max_tokens=128, max_seqs=8, clock=clock,
                           decode_step_prefill_tokens=16)
    first = make_request("long0", 300, 6)
    sched.add_request(first)
    assert _prompt_tokens(step(sched, clock)) == 128  # no decode yet: the whole budget
    steps = []
    others = ([make_request(f"d{i}", 4, 40, arrival=clock.t) for i in range(3)]
              + [make_request("long1", 300, 6, arrival=clock.t + 3)])
    replay(sched, clock, others, on_step=lambda s, out: steps.append(out))
    mixed = [out for out in steps if _decodes(out) and _prompt_tokens(out)]
    assert mixed and all(_prompt_tokens(out) <= 16 for out in mixed)
    alone = [out for out in steps if not _decodes(out) and _prompt_tokens(out)]
    assert all(_prompt_tokens(out) <= 128 for out in alone)
    for r in [first] + others:
        assert r.output_token_ids == expected_tokens(r)
    assert sched.kv.pool.num_free_blocks == 256


def test_off_and_without_chunking_the_whole_budget_runs_beside_decodes():
    """-1 turns the bound off, and without chunked prefill it never applies (a whole
    prompt that could not run beside decodes would never start)."""
    def prompt_beside_decodes(**options):
        clock = FakeClock()
        sched = make_scheduler("fcfs", max_tokens=128, max_seqs=8, clock=clock, **options)
        sched.add_request(make_request("d", 4, 40))
        step(sched, clock)
        sched.add_request(make_request("long", 100, 4, arrival=clock.t))
        out = step(sched, clock)
        assert _decodes(out) == 1
        return _prompt_tokens(out)

    assert prompt_beside_decodes(decode_step_prefill_tokens=16) == 16
    assert prompt_beside_decodes(decode_step_prefill_tokens=-1) == 100
    assert prompt_beside_decodes(decode_step_prefill_tokens=16,
                                 enable_chunked_prefill=False) == 100


def test_the_auto_bound_is_what_six_fixed_costs_buy():
    """0 (auto): 6 x fixed_s / per_token_s of the measured line (10 ms a step and 0.5 ms
    a token: 120 tokens), within [1, max_num_batched_tokens]; no bound when a token costs
    nothing measurable; -1 (the default) off; a configured number kept under the budget."""
    costs = StepCostModel()
    for tokens in (1, 50, 100, 200) * 50:
        costs.observe(tokens, 0.010 + 0.0005 * tokens)
    def auto(**options):
        return decode_step_prefill_tokens(SchedulerConfig(decode_step_prefill_tokens=0,
                                                          **options), costs)

    assert auto(max_num_batched_tokens=512) == 120
    assert auto(max_num_batched_tokens=32) == 32
    assert decode_step_prefill_tokens(SchedulerConfig(), costs) is None  # off by default
    assert decode_step_prefill_tokens(
        SchedulerConfig(max_num_batched_tokens=64, decode_step_prefill_tokens=100), costs) == 64
    flat = StepCostModel()
    for tokens in (1, 50, 100, 200) * 50:
        flat.observe(tokens, 0.010)
    assert decode_step_prefill_tokens(SchedulerConfig(decode_step_prefill_tokens=0),
                                      flat) in (None, 512)  # the whole budget

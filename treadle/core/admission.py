"""Admission planning: whether a waiting or swapped-out request fits the step now, and which
running requests to preempt so that a more urgent one does.

Owns the questions the scheduler asks before it admits a request: `fit` (is there a
request slot, budget and KV memory for it in this step, and with how many tokens — the
memory with headroom: a watermark plus the growth the running requests and this one can
be expected to need soon, `kv_growth`, so that admitting it rarely forces preempting
another; and within its tenant's share of the cache when tenants compete,
`tenant_share_blocks`) and `plan_admission_victims` (the least urgent running requests
whose memory and budget would make it fit, under `policy.choose_admission_victim`). Block arithmetic is the KV
manager's (`KVCacheManager.num_new_blocks_needed`, `num_held_blocks`,
`num_swapped_blocks`); this module only adds up what it answers. It changes no state:
the scheduler carries out the plan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Container, Mapping, Sequence

from treadle.core import policy
from treadle.core.kv.block_pool import KVBlock
from treadle.core.kv.manager import KVCacheManager
from treadle.request import Request


class Admission(enum.Enum):
    ADMITTED = "admitted"
    FULL = "full"
    """No request slot or no token left in this step: nothing behind can be admitted."""
    NO_FIT = "no_fit"
    """Too large for the free KV memory (or the budget, unchunked): smaller ones may fit."""
    DEFERRED = "deferred"
    """Held back by `finish_prompts_first` (see `Scheduler._holds_back`): it starts next
    step, and nothing behind it starts now."""


@dataclass
class StepRoom:
    """What is left of the step for admissions."""

    budget: int
    """Tokens left in the step's budget."""
    num_running: int
    max_num_seqs: int
    kv_reserve: int = 0
    """Free blocks an admission must leave (watermark + expected growth of the running
    requests); 0 with nothing running, so that something always runs."""
    lookahead_tokens: int = 0
    """Tokens of its own growth an admitted request must also find room for."""
    tenant_room: int | None = None
    """Blocks the request's tenant may still take (its share, when tenants compete)."""

    @property
    def full(self) -> bool:
        return self.num_running >= self.max_num_seqs or self.budget == 0


def fit(kv: KVCacheManager, request: Request, swapped: bool, num_hit_tokens: int,
        computed_blocks: list[KVBlock], room: StepRoom, may_chunk: bool,
        holds_back: Callable[[bool], bool]) -> tuple[Admission, int]:
    """Whether the request fits in this step now, and with how many tokens.

    `holds_back(partial)` is the scheduler's finish_prompts_first rule for this request
    (`partial`: its tokens would not all fit the budget)."""
    if room.full:
        return Admission.FULL, 0
    if swapped:
        blocks = kv.num_swapped_blocks(request.request_id)
        growth = kv_growth(kv, request, blocks * kv.block_size, room.lookahead_tokens)
        if (blocks + growth + room.kv_reserve > kv.pool.num_free_blocks
                or (room.tenant_room is not None and blocks > room.tenant_room)):
            return Admission.NO_FIT, 0
        return Admission.ADMITTED, 0
    num_tokens = request.num_uncomputed_tokens - num_hit_tokens
    if num_tokens > room.budget and not may_chunk:
        return Admission.NO_FIT, 0
    if holds_back(num_tokens > room.budget):
        return Admission.DEFERRED, 0
    num_tokens = min(num_tokens, room.budget)
    if kv.eviction is not None:  # its steps are capped (core/kv_eviction.py)
        num_tokens = min(num_tokens, kv.eviction.max_step_tokens)
    if not kv.can_allocate(request, num_tokens, computed_blocks):
        return Admission.NO_FIT, 0
    if kv.eviction is not None and not _budget_fits(kv, request, computed_blocks, room):
        return Admission.NO_FIT, 0
    if room.kv_reserve or room.lookahead_tokens or room.tenant_room is not None:
        needed = kv.num_new_blocks_needed(request, num_hit_tokens, num_tokens)
        slots = (request.num_computed_tokens + num_hit_tokens + num_tokens)
        growth = kv_growth(kv, request, kv.num_blocks_for(slots) * kv.block_size,
                           room.lookahead_tokens)
        if room.kv_reserve and needed + growth + room.kv_reserve > kv.pool.num_free_blocks:
            return Admission.NO_FIT, 0
        if room.tenant_room is not None and needed > room.tenant_room:
            return Admission.NO_FIT, 0
    return Admission.ADMITTED, num_tokens


def _budget_fits(kv: KVCacheManager, request: Request, computed_blocks: list[KVBlock],
                 room: StepRoom) -> bool:
    """With eviction a request's steps are small (core/kv_eviction.py), yet it soon holds
    its whole budget: admit it only when that fits, or two such requests would take
    turns preempting each other a chunk at a time."""
    remaining = max(0, request.sampling_params.max_tokens - request.num_output_tokens)
    tokens = min(request.num_tokens + remaining, kv.eviction.budget_tokens)
    needed = (kv.num_blocks_for(tokens) - len(computed_blocks)
              + kv.pool.num_reusable_from_free(computed_blocks))
    return needed + room.kv_reserve <= kv.pool.num_free_blocks


def kv_growth(kv: KVCacheManager, request: Request, num_slots: int, lookahead: int) -> int:
    """Blocks beyond `num_slots` held token slots that the request can be expected to
    need soon: its tokens so far plus what it may still generate, at most `lookahead`
    tokens past what it holds (max_tokens is an upper bound, so the horizon is too)."""
    if lookahead <= 0:
        return 0
    remaining = max(0, request.sampling_params.max_tokens - request.num_output_tokens)
    future = min(request.num_tokens + remaining, num_slots + lookahead)
    if kv.eviction is not None:  # it never holds more than its budget
        future = min(future, max(kv.eviction.budget_tokens, num_slots))
    return max(0, kv.num_blocks_for(future) - num_slots // kv.block_size)


def tenant_share_blocks(num_blocks: int, weight: float, active_weights: float) -> int:
    """A tenant's share of the cache's blocks while the tenants of `active_weights`
    (their summed weights, its own included) compete for it."""
    return int(num_blocks * weight / active_weights)


def plan_admission_victims(kv: KVCacheManager, request: Request, swapped: bool,
                           num_hit_tokens: int, candidate_urgency: float,
                           running: Sequence[tuple[Request, float]], threshold: float,
                           protected: Container[str], room: StepRoom,
                           scheduled_tokens: Mapping[str, int],
                           may_chunk: bool) -> list[Request]:
    """Running requests to preempt so that `request` fits, least urgent first; empty when
    the eligible ones (policy.choose_admission_victim) would not make room.

    `running` pairs each running request with its urgency; `scheduled_tokens` holds the
    tokens already scheduled for them this step (a victim gives them back)."""
    running = list(running)
    num_seqs = room.num_running
    budget = room.budget
    free_blocks = kv.pool.num_free_blocks
    need_tokens = 0 if swapped else request.num_uncomputed_tokens - num_hit_tokens
    victims: list[Request] = []
    while True:
        victim = policy.choose_admission_victim(candidate_urgency, running, threshold,
                                                protected)
        if victim is None:
            return []
        running = [(r, u) for r, u in running if r is not victim]
        victims.append(victim)
        num_seqs -= 1
        budget += scheduled_tokens.get(victim.request_id, 0)
        free_blocks += kv.num_held_blocks(victim.request_id)
        if num_seqs >= room.max_num_seqs or budget == 0:
            continue
        if swapped:
            if kv.num_swapped_blocks(request.request_id) <= free_blocks:
                return victims
            continue
        tokens = need_tokens
        if tokens > budget:
            if not may_chunk:
                continue
            tokens = budget
        if kv.eviction is not None:
            tokens = min(tokens, kv.eviction.max_step_tokens)
        if kv.num_new_blocks_needed(request, num_hit_tokens, tokens) <= free_blocks:
            return victims

"""The scheduler's speculative-decoding controller: how many proposed tokens each request
runs in a step, and how many its proposer prepares for the next one.

Owns speculation's state in the engine core: each request's acceptance estimate and the
engine's pooled one, what each request's draft has caught up on, the deterministic
proposals a step did not run (scored against the model's token when it returns), and
the counters that metrics, traces and benchmarks read. The scheduler asks it three
things: which proposed tokens each decode runs this step (`plan_verification`, then
`num_to_verify` per request), which requests the proposer drafts for after it
(`proposals_wanted`), and to learn from each verified step (`observe_step`). The
numbers behind the answers are core/spec_decode.py's (cost model, acceptance model,
`plan_proposals`). It never allocates KV or changes a request.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from treadle.core.spec_decode import (POOL_FORGET, POOL_IDLE_FORGET, AcceptanceEstimate,
                                      ProposalCandidate, SpecCandidate, SpecCosts,
                                      SpecDecodeStats, expected_tokens, plan_proposals)
from treadle.request import Request


def pending_prefill_tokens(room: int, running: Iterable[Request],
                           queued: Iterable[Iterable[Request]],
                           scheduled: Mapping[str, int]) -> int:
    """Prompt tokens (and tokens to recompute) left to prefill once the `scheduled` tokens
    are in, up to `room`: of the `running` requests mid-prompt, and of the `queued`
    groups (swapped-out, waiting)."""
    total = 0
    for r in running:
        if r.is_decoding:
            continue
        total += max(r.num_uncomputed_tokens - scheduled.get(r.request_id, 0), 0)
        if total >= room:
            return max(room, 0)
    for group in queued:
        for r in group:
            total += max(r.num_uncomputed_tokens - scheduled.get(r.request_id, 0), 0)
            if total >= room:
                return max(room, 0)
    return total


class SpecDecodeController:
    """The scheduler's speculative-decoding state: per-request estimates and counters,
    and the two questions it answers each step."""

    def __init__(self, max_tokens: int, adaptive: bool, prior: float,
                 costs: SpecCosts | None, writes_kv_ahead: bool,
                 deterministic: bool, *, max_model_len: int, max_step_tokens: int) -> None:
        """`writes_kv_ahead`: the proposer runs a model (draft, self) whose forward passes
        cost time and write KV past the computed tokens; `deterministic`: it proposes
        without sampling (ngram), so a proposal that was not run is still scored against
        the model's token (an observation for free). `max_model_len` and
        `max_step_tokens` (the step's token budget) bound what a request and a step run."""
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.max_step_tokens = max_step_tokens
        self.adaptive = adaptive and costs is not None
        self.prior = prior
        self.costs = costs
        self.writes_kv_ahead = writes_kv_ahead
        self.deterministic = deterministic
        self.estimates: dict[str, AcceptanceEstimate] = {}
        self.pooled = AcceptanceEstimate()
        """Every request's observations: the prior of each request's estimate."""
        self._observed_in_step = False
        self._draft_seen: dict[str, int] = {}
        """Tokens of each request the draft has caught up on (its last proposal)."""
        self._unrun: dict[str, tuple[int, int]] = {}
        """Deterministic proposals a step did not run: (their first token, the request's
        num_tokens then), scored against the model's token when that step returns."""
        self.stats = SpecDecodeStats()
        self.last_step = SpecDecodeStats()
        """The counters of the last verified step alone (for the trace)."""

    def pooled_rate(self) -> float:
        """The engine's recent acceptance over all requests, `prior` before any."""
        return self.pooled.rate(self.prior)

    def rate(self, request_id: str) -> float:
        prior = self.pooled_rate()
        estimate = self.estimates.get(request_id)
        return prior if estimate is None else estimate.rate(prior)

    def tokens_to_run(self, candidates: list[SpecCandidate], num_rows: int,
                      base_tokens: int, max_step_tokens: int) -> dict[str, int]:
        """How many of their proposed tokens the candidates run this step (the proposals
        are made: only the target's verification costs)."""
        if not self.adaptive:
            return {c.request_id: c.max_tokens for c in candidates}
        ks = plan_proposals([self.rate(c.request_id) for c in candidates],
                            [c.max_tokens for c in candidates], num_rows, base_tokens,
                            self.costs, draft_cost=False, max_step_tokens=max_step_tokens)
        return {c.request_id: kk for c, kk in zip(candidates, ks)}

    def tokens_to_propose(self, candidates: list[ProposalCandidate], num_rows: int,
                          base_tokens: int, max_step_tokens: int) -> dict[str, int]:
        """How many tokens the proposer prepares after this step for each request's next
        one, for a next step of `num_rows` rows and `base_tokens` tokens without
        speculation. A proposer without a model always prepares the most (its lookup
        costs next to nothing; the cut comes when they run); one with a model, what the
        plan with the draft's own passes counted gives, a draft that must first catch up
        on a request's tokens paying for that too: the catch-up's seconds spread over
        the verifications the request's remaining output is expected to take."""
        if not self.adaptive or not self.writes_kv_ahead:
            return {c.request_id: self.max_tokens for c in candidates}
        rates = [self.rate(c.request_id) for c in candidates]
        first_costs = None
        per_token = self.costs.catchup_seconds_per_token
        if per_token > 0.0:
            first_costs = []
            for c, rate in zip(candidates, rates):
                unseen = max(c.num_tokens - self._draft_seen.get(c.request_id, 0), 0)
                verifications = max(c.remaining / expected_tokens(rate, self.max_tokens), 1.0)
                first_costs.append(per_token * unseen / verifications)
        ks = plan_proposals(rates, [self.max_tokens] * len(candidates), num_rows, base_tokens,
                            self.costs, draft_cost=True, max_step_tokens=max_step_tokens,
                            first_costs=first_costs)
        return {c.request_id: kk for c, kk in zip(candidates, ks)}

    def proposing(self, request_id: str, num_tokens: int) -> None:
        """The proposer drafts for the request after this step: its draft will have
        caught up on its `num_tokens` tokens."""
        self._draft_seen[request_id] = num_tokens

    def draft_lost(self, request_id: str) -> None:
        """The request's KV is gone (preempted by recompute): so is its draft's."""
        self._draft_seen.pop(request_id, None)

    def begin_step(self) -> None:
        if not self._observed_in_step:
            self.pooled.idle(POOL_IDLE_FORGET)
        self._observed_in_step = False
        self.last_step = SpecDecodeStats()

    def observe(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verification: `num_proposed` tokens ran, the first `num_accepted` were kept."""
        if num_proposed <= 0:
            return
        self._learn(request_id, num_proposed, num_accepted)
        for stats in (self.stats, self.last_step):
            stats.num_drafts += 1
            stats.num_draft_tokens += num_proposed
            stats.num_accepted_tokens += num_accepted
            per_position = stats.accepted_per_position
            if len(per_position) < num_proposed:
                per_position.extend([0] * (num_proposed - len(per_position)))
            for j in range(num_accepted):
                per_position[j] += 1

    def observe_unrun(self, request_id: str, proposed_token: int, model_token: int) -> None:
        """A deterministic proposal that was not run, scored against the token the model
        chose (exactly what verification would have accepted, see worker/spec/rejection.py);
        counts for the estimate, not in the counters."""
        self._learn(request_id, 1, int(proposed_token == model_token))

    def _learn(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """One observation, for the request's estimate and the engine's."""
        self.estimates.setdefault(request_id, AcceptanceEstimate()).observe(
            num_proposed, num_accepted)
        self.pooled.observe(num_proposed, num_accepted, POOL_FORGET)
        self._observed_in_step = True

    def idle(self, request_id: str) -> None:
        estimate = self.estimates.get(request_id)
        if estimate is not None:
            estimate.idle()

    def forget(self, request_id: str) -> None:
        """The request ended."""
        self.estimates.pop(request_id, None)
        self._draft_seen.pop(request_id, None)
        self._unrun.pop(request_id, None)

    # ----- the scheduler's questions, about requests ---------------------------------------

    @staticmethod
    def speculates(request: Request) -> bool:
        """Whether the request runs proposed tokens at all (its sampling parameters: not
        when it opts out, nor with XTC)."""
        return request.sampling_params.allows_speculation

    def spec_room(self, request: Request, num_after: int) -> int:
        """Proposed tokens that may still become output once `num_after` more tokens
        are in: at most max_tokens - 1 more (one token is always the model's) and within
        the context."""
        return min(self.max_model_len - request.num_tokens - num_after + 1,
                   request.sampling_params.max_tokens - request.num_output_tokens - num_after)

    def plan_verification(self, running: Sequence[Request],
                          queued: Iterable[Iterable[Request]]) -> dict[str, int]:
        """The proposed tokens each decoding request of `running` (those the step may
        touch) runs this step, for a step like this one: its decodes, plus the prefill
        tokens waiting for it (mid-prompt running requests, the `queued` groups)."""
        decodes = [r for r in running if r.is_decoding]
        candidates = []
        for r in decodes:
            if r.spec_token_ids and self.speculates(r):
                room = min(len(r.spec_token_ids), self.spec_room(r, 0) - 1)
                if room > 0:
                    candidates.append(SpecCandidate(r.request_id, room))
        if not candidates:
            return {}
        budget = self.max_step_tokens
        base = len(decodes) + pending_prefill_tokens(budget - len(decodes), running, queued, {})
        return self.tokens_to_run(candidates, len(decodes), min(base, budget), budget)

    def num_to_verify(self, request: Request, room: int, plan: Mapping[str, int]) -> int:
        """Of `room` proposed tokens the step could run for the request, how many it
        does: what `plan` (plan_verification's) gives it. A deterministic proposal it
        does not run is remembered, to be scored against the model's token."""
        room = min(room, plan.get(request.request_id, 0))
        if room <= 0 and self.deterministic:
            self._unrun[request.request_id] = (request.spec_token_ids[0], request.num_tokens)
        return room

    def proposals_wanted(self, running: Sequence[Request], scheduled: Mapping[str, int],
                         queued: Iterable[Iterable[Request]]) -> list[tuple[Request, int]]:
        """Tokens to propose after this step per sampled request (those of `running`
        whose `scheduled` tokens reach their last token), planned for the step that
        verifies them: this step's sampled requests as its decode rows and the prompt
        tokens still to prefill then (a step the prefill will fill runs no proposals, so
        none is made for it). Only requests with some, in `running`'s order; the caller
        confirms each with `proposing` (with a proposer that writes KV ahead, once it has
        their slots)."""
        sampled = []
        for request in running:
            n = scheduled.get(request.request_id)
            if (n is not None and request.num_computed_tokens + n >= request.num_tokens
                    and self.speculates(request)):
                sampled.append(request)
        if not sampled:
            return []
        budget = self.max_step_tokens
        # Decode rows of the next step: the sampled requests and those this one left out.
        rows = len(sampled) + sum(1 for r in running if r.is_decoding
                                  and r.request_id not in scheduled)
        base = rows + pending_prefill_tokens(budget - rows, running, queued, scheduled)
        candidates = [ProposalCandidate(r.request_id, r.num_tokens + 1,
                                        r.sampling_params.max_tokens - r.num_output_tokens - 1)
                      for r in sampled]
        wanted = self.tokens_to_propose(candidates, rows, min(base, budget), budget)
        out = []
        for request in sampled:
            k = min(wanted.get(request.request_id, 0), max(self.spec_room(request, 1), 0))
            if k > 0:
                out.append((request, k))
        return out

    def observe_step(self, request: Request, spec_token_ids: list[int],
                     tokens: list[int]) -> None:
        """Acceptance of what the request's step verified (`spec_token_ids`, of which
        `tokens` kept all but the last), or of a deterministic proposal the plan did not
        run, scored against the model's token. Called before the tokens are appended."""
        rid = request.request_id
        unrun = self._unrun.pop(rid, None)
        if spec_token_ids:
            self.observe(rid, len(spec_token_ids), len(tokens) - 1)
        elif unrun is not None and unrun[1] == request.num_tokens:
            self.observe_unrun(rid, unrun[0], tokens[0])
        else:
            self.idle(rid)

"""Verification of proposed tokens by exact rejection sampling (Leviathan et al. 2023;
Chen et al. 2023), so that the tokens kept follow the target's distribution exactly.

For a request with proposals x_1..x_k, the target's distribution p_j at each position is
the sampler's full processed distribution (logit bias, min_tokens, penalties — which at
position j count the proposals before it as generated tokens — temperature, top-k, top-p,
min-p: `Sampler.probs`), and q_j is what the proposer drew x_j from. x_j is accepted with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token is drawn from
norm(max(0, p_j - q_j)) and the rest are dropped; if all are accepted, one more token is
drawn from p_{k+1}. Each kept token is then distributed as p (the cited theorem).

With a deterministic proposer (ngram, or a draft's greedy choice for a greedy request)
q_j is one-hot at x_j: acceptance has probability p_j(x_j) and the residual is p_j
without x_j, renormalized. The runner then samples every position with the sampler
itself, each from its own uniform number u_j, and keeps x_j while the sampled token
equals it: token = F_j^-1(u_j) equals x_j with probability p_j(x_j), and otherwise is
distributed as p_j restricted to the other tokens — the same rejection sampling, coupled
to the uniforms of sampling without speculation. A seeded request therefore gives the
tokens it gives without speculation (its generator is put back to where it would be
after the tokens kept: `Sampler.rewind`), and greedy rows are exactly the argmax.
Logprobs are always the target's, from its raw logits at each kept position.

This module decides nothing about how many tokens are proposed; it never touches the KV
cache (the scheduler rolls back rejected tokens' slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from treadle.core.outputs import TokenLogprobs
from treadle.sampling_params import SamplingParams
from treadle.worker.sampler import Sampler, logprob_entries


@dataclass
class SampleRow:
    """One sampling position (one row of logits)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    """Generated tokens before this position: the request's, then its proposals before it."""
    position: int
    """Index among the request's sampling positions (0: right after its last token)."""
    proposals: list[int]
    """The request's proposed tokens verified this step (the same list on each of its rows)."""


def _kept_draws(rows: list[SampleRow], token_ids: Sequence[int],
                entries: Sequence[TokenLogprobs | None]):
    """Per request, in first-row order: (its id, its (token, logprobs) drawn at each of its
    rows, those it keeps): the draws while they equal its proposals, and the first that
    does not (or the one after the last proposal)."""
    by_request: dict[str, list[tuple[int, TokenLogprobs | None]]] = {}
    for r, token, entry in zip(rows, token_ids, entries):
        by_request.setdefault(r.request_id, []).append((token, entry))
    proposals = {r.request_id: r.proposals for r in rows if r.position == 0}
    for rid, drawn in by_request.items():
        spec = proposals[rid]
        kept = []
        for j, (token, entry) in enumerate(drawn):
            kept.append((token, entry))
            if j == len(spec) or token != spec[j]:
                break
        yield rid, drawn, kept


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of non-negative weights [rows, vocab], the first index whose cumulative
    weight exceeds u * total, never a zero-weight one."""
    cdf = probs.double().cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True)
    pick = pick.squeeze(1).clamp_(max=probs.shape[1] - 1)
    bad = (probs.gather(1, pick.unsqueeze(1)).squeeze(1) <= 0).nonzero().flatten()
    for r in bad.tolist():  # u * total rounded to the total: the last token with weight
        pick[r] = int((probs[r] > 0).nonzero().max())
    return pick


def masks_of(masks, rows: list[int]):
    """The StepMasks of the logits rows `rows` (in that order), renumbered from 0; None
    when none of them is masked."""
    if masks is None:
        return None
    position = {r: n for n, r in enumerate(rows)}
    kept = [(k, position[r]) for k, r in enumerate(masks.rows) if r in position]
    if not kept:
        return None
    return type(masks)(masks.bitmask[[k for k, _ in kept]], [n for _, n in kept])


class RejectionSampler:
    """Samples every sampling position of a step and verifies the proposals."""

    def __init__(self, sampler: Sampler, eos_token_id: int | None) -> None:
        self.sampler = sampler
        self.eos_token_id = eos_token_id

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 draft_probs: Callable[[str], torch.Tensor | None], masks=None
                 ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
        """logits [rows, vocab] float32 (overwritten), one row per SampleRow, a request's
        rows in position order. `draft_probs(request_id)`: the proposer's q rows of a
        request's proposals, or None when they were deterministic. `masks`
        (worker.grammar.StepMasks): the allowed tokens of structured-output rows, part of
        the target's distribution p (a proposal the grammar forbids has p = 0 and is
        always rejected). Returns per request its kept tokens (accepted proposals, then
        one drawn from the target) and, when asked for, their logprobs."""
        stochastic: dict[str, torch.Tensor] = {}
        for row in rows:
            if row.position == 0 and row.proposals and not row.params.is_greedy:
                q = draft_probs(row.request_id)
                if q is not None:
                    stochastic[row.request_id] = q[:len(row.proposals)]
        one_hot = [i for i, r in enumerate(rows) if r.request_id not in stochastic]
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if one_hot:
            whole = len(one_hot) == len(rows)
            sub = logits if whole else logits[one_hot]
            self._coupled(sub, [rows[i] for i in one_hot], tokens, logprobs,
                          masks if whole else masks_of(masks, one_hot))
        if stochastic:
            idx = [i for i, r in enumerate(rows) if r.request_id in stochastic]
            self._leviathan(logits[idx], [rows[i] for i in idx], stochastic, tokens, logprobs,
                            masks_of(masks, idx))
        return tokens, logprobs

    def _coupled(self, logits: torch.Tensor, rows: list[SampleRow],
                 tokens: dict[str, list[int]], logprobs: dict[str, list[TokenLogprobs]],
                 masks=None) -> None:
        """One-hot proposals: sample each position, keep proposals while they equal the
        sampled token (see the module docstring)."""
        states = {}
        for r in rows:
            if r.position == 0 and r.proposals and r.params.seed is not None:
                states[r.request_id] = self.sampler.generator_state(r.request_id, r.params)
        out = self.sampler.sample(
            logits, [r.request_id for r in rows], [r.params for r in rows],
            [r.prompt_token_ids for r in rows], [r.output_token_ids for r in rows],
            self.eos_token_id, masks)
        for rid, drawn, kept in _kept_draws(rows, out.token_ids, out.logprobs):
            tokens[rid] = [t for t, _ in kept]
            if kept[0][1] is not None:
                logprobs[rid] = [e for _, e in kept]
            if rid in states and len(kept) < len(drawn):
                self.sampler.rewind(rid, states[rid], len(kept))

    @staticmethod
    def greedy(rows: list[SampleRow], token_ids: Sequence[int]) -> dict[str, list[int]]:
        """What __call__ returns as tokens when every row is greedy with nothing that
        changes its logits (sampler.takes_plain_argmax) and `token_ids` holds each row's
        argmax: per request, its proposals while they equal the argmax, then the argmax
        where they part."""
        return {rid: [t for t, _ in kept]
                for rid, _, kept in _kept_draws(rows, token_ids, [None] * len(rows))}

    def _leviathan(self, logits: torch.Tensor, rows: list[SampleRow],
                   q_rows: dict[str, torch.Tensor], tokens: dict[str, list[int]],
                   logprobs: dict[str, list[TokenLogprobs]], masks=None) -> None:
        """Sampled proposals: accept x with probability min(1, p(x)/q(x)); at the first
        rejection draw from norm(max(0, p - q)); after k acceptances draw from p."""
        wants_logprobs = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw = logits[wants_logprobs].clone() if wants_logprobs else None
        p = self.sampler.probs(logits, [r.params for r in rows],
                               [r.prompt_token_ids for r in rows],
                               [r.output_token_ids for r in rows], self.eos_token_id,
                               masks)
        # Every request at once: its rows start at `starts`, it verifies ks tokens.
        first_row: dict[str, int] = {}
        for i, r in enumerate(rows):
            first_row.setdefault(r.request_id, i)
        rids = list(first_row)
        starts = torch.tensor([first_row[rid] for rid in rids], dtype=torch.long)
        ks = torch.tensor([len(rows[first_row[rid]].proposals) for rid in rids],
                          dtype=torch.long)
        spec = torch.tensor([t for rid in rids for t in rows[first_row[rid]].proposals],
                            dtype=torch.long)
        q = torch.cat([q_rows[rid] for rid in rids]).to(p.dtype)
        segment = torch.repeat_interleave(torch.arange(len(rids)), ks)
        offsets = torch.cumsum(ks, 0) - ks
        local = torch.arange(spec.numel()) - offsets[segment]
        # k acceptance numbers and one for the final draw per request, from its stream.
        draws = [rid for rid in rids for _ in range(len(rows[first_row[rid]].proposals) + 1)]
        u = self.sampler.uniforms(draws, [rows[first_row[rid]].params for rid in draws])
        u_offsets = offsets + torch.arange(len(rids))
        u_accept = u[u_offsets[segment] + local]
        u_final = u[u_offsets + ks]
        p_x = p[starts[segment] + local, spec].double()
        q_x = q[torch.arange(spec.numel()), spec].double()
        rejected = u_accept * q_x >= p_x
        # Accepted: the proposals before each request's first rejection.
        first_reject = ks.clone()
        if bool(rejected.any()):
            first_reject.scatter_reduce_(0, segment[rejected], local[rejected], reduce="amin")
        final = p[starts + first_reject].clone()
        refused = first_reject < ks
        if bool(refused.any()):
            at = torch.nonzero(refused).flatten()
            residual = (final[at] - q[offsets[at] + first_reject[at]]).clamp_(min=0.0)
            empty = residual.sum(dim=-1) <= 0  # p == q there: p itself
            residual[empty] = final[at][empty]
            final[at] = residual
        drawn = inverse_cdf(final, u_final).tolist()
        kept_rows: dict[str, list[int]] = {}
        for n, rid in enumerate(rids):
            a = int(first_reject[n])
            tokens[rid] = rows[first_row[rid]].proposals[:a] + [drawn[n]]
            kept_rows[rid] = list(range(first_row[rid], first_row[rid] + a + 1))
        if raw is not None:
            position = {i: n for n, i in enumerate(wants_logprobs)}
            for rid, kept in kept_rows.items():
                if rows[kept[0]].params.logprobs is None:
                    continue
                sel = torch.tensor([position[i] for i in kept], dtype=torch.long)
                logprobs[rid] = logprob_entries(
                    raw[sel], torch.tensor(tokens[rid], dtype=torch.long),
                    [rows[kept[0]].params.logprobs] * len(kept))

"""Model-based proposers: `draft` (a smaller checkpoint) and `self` (the target's own
first layers), run by the worker over the paged KV cache.

Both propose k tokens for a request with k forward passes: the first feeds every token
whose draft KV is missing up to the request's last token (the catch-up) and drafts one
token from the logits at the last; each further pass feeds the token just drafted. A
greedy request takes the draft's argmax (of logits with its penalties applied); a
sampled one draws from the draft's processed distribution under the request's own
parameters (`Sampler.probs`), which verification needs and is kept (`draft_probs`).

Where the draft's KV lives:

- `draft`: its own cache, with as many blocks as the target's and addressed by the same
  block ids: the draft's KV of the token in slot s of target block b is in slot s of
  draft block b. So the request's block table is the draft's too, and the draft's KV is
  allocated, freed, swapped (the same copy plan, `swap_blocks`) and shared through the
  prefix cache with the target's blocks, with no second allocator and no table of its
  own. The draft keeps per request how many leading positions hold its KV for the
  request's actual tokens (`_valid`): the passes write the tokens they feed at their
  slots, proposals included; a rejected proposal's position is no longer valid, and the
  catch-up of the next pass starts there. Positions are dropped with the blocks they are
  in (a rollback replaces the table: only the blocks up to the computed tokens are kept)
  and all of them on preemption by recompute; a request new to the worker starts at 0,
  even when the prefix cache gave it blocks another request's draft filled (their
  draft KV is recomputed into those same blocks: the same tokens at the same positions,
  so the values other sharers read do not change beyond rounding). The cost: the draft's
  KV bytes per token are reserved with every target block (worker.py counts them in the
  blocks that fit), and the draft catches up prompt chunks lazily, when the request
  first speculates, instead of in every prefill step.
- `self`: the target's cache for its first `draft_layers` layers. Those layers compute
  the same keys and values for the same tokens whether the target or the draft runs
  them, so below the request's computed tokens the target's KV is the draft's and there
  is nothing to catch up. The draft runs ahead of verification: its passes write the
  draft's KV of the last token and of its proposals, in the first layers only, at
  positions at and past the computed tokens. That is safe because those slots are in
  blocks the request alone holds (the scheduler held them for it: a block is shared only
  once full of computed tokens), and the target's next step writes its own KV at every
  position it computes before any position counts as computed, so a rejected proposal's
  KV is never read as valid and never reaches the prefix cache.

Positions past this step's tokens are written only into slots the scheduler held for
them (`ScheduledRequest.num_proposals`), never into another request's blocks.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from treadle.core.outputs import SchedulerOutput
from treadle.layers.attention import AttentionStep
from treadle.layers.norm import add_rms_norm
from treadle.layers.rotary import RotaryInputs
from treadle.worker.attention.base import AttentionBackend
from treadle.worker.kv_cache import copy_blocks
from treadle.worker.sampler import Sampler, adjust_logits
from treadle.worker.spec.base import ProposalBatch, ProposalRequest, Proposer
from treadle.worker.spec.rejection import inverse_cdf


class DraftForward:
    """One draft model pass: `forward(input_ids, positions, meta)` -> hidden states after
    the final norm, `logits(hidden)` -> float32 logits; over `kv_caches` (one per layer it
    runs) with `attention` (the backend whose metadata it takes)."""

    def __init__(self, forward: Callable, logits: Callable, kv_caches: list[torch.Tensor],
                 attention: AttentionBackend, num_blocks: int) -> None:
        self.forward, self.logits = forward, logits
        self.kv_caches, self.attention, self.num_blocks = kv_caches, attention, num_blocks


def separate_draft(model, kv_caches, attention, num_blocks) -> DraftForward:
    """A draft checkpoint's own model over its own caches."""
    return DraftForward(lambda ids, pos, meta: model(ids, pos, kv_caches, meta),
                        model.compute_logits, kv_caches, attention, num_blocks)


def truncated_target(model, num_layers: int, kv_caches, attention, num_blocks) -> DraftForward:
    """The target's first `num_layers` layers, its final norm and LM head, over the
    target's caches of those layers (one rank: no collectives)."""
    layers = list(model.model.layers.values())[:num_layers]
    caches = kv_caches[:num_layers]

    def forward(input_ids, positions, meta):
        rotary = RotaryInputs(*model.rotary.cos_sin(positions, model.dtype))
        hidden = model.model.embed_tokens(input_ids)
        for layer, cache in zip(layers, caches):
            hidden = layer.forward(hidden, rotary, cache, meta)
        return add_rms_norm(hidden, None, model.model.norm, model.ops)

    return DraftForward(forward, model.compute_logits, caches, attention, num_blocks)


class ModelProposer(Proposer):
    """Proposes with a draft model's forward passes (see the module docstring)."""

    runs_model = True

    def __init__(self, name: str, draft: DraftForward, sampler: Sampler, block_size: int,
                 device: torch.device, eos_token_id: int | None, catches_up: bool,
                 seed: int, swap_caches: list[torch.Tensor] | None = None,
                 block_dim: int = 2, kv_bytes_per_token: int = 0) -> None:
        """`catches_up`: the draft has its own KV (draft), else it reads the target's
        (self). `sampler` computes the draft's distributions (its kernels; it draws
        nothing: the draft's numbers come from its own generators, seeded from `seed`
        and from each seeded request's seed)."""
        self.name = name
        self.draft = draft
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.eos_token_id = eos_token_id
        self.catches_up = catches_up
        self.swap_caches = swap_caches
        self.block_dim = block_dim
        self.kv_bytes_per_token = kv_bytes_per_token
        self._generator = torch.Generator(device="cpu").manual_seed(seed ^ 0x5DEECE66D)
        self._request_generators: dict[str, torch.Generator] = {}
        self._valid: dict[str, int] = {}
        """Leading positions of the request whose draft KV was written for its tokens,
        as far as fed proposals turn out to be its tokens (_fed)."""
        self._fed: dict[str, tuple[int, list[int]]] = {}
        """(first position, tokens): proposals fed at those positions, not yet verified."""
        self._q: dict[str, torch.Tensor] = {}

    # ----- the lifecycle of the draft's KV ---------------------------------------------

    def begin_step(self, scheduler_output: SchedulerOutput) -> None:
        for rid in scheduler_output.finished_request_ids:
            self._forget(rid)
        swapped = set(scheduler_output.swapped_request_ids)
        for rid in scheduler_output.preempted_request_ids:
            self._q.pop(rid, None)
            if rid not in swapped:  # recompute: its blocks (and the draft's KV) are gone
                self._valid.pop(rid, None)
                self._fed.pop(rid, None)
        for s in scheduler_output.scheduled:
            if s.replaces_block_table and s.request_id in self._valid:
                # Only the blocks up to its computed tokens are sure to be the same ones.
                kept = math.ceil(s.num_computed_tokens / self.block_size) * self.block_size
                self._valid[s.request_id] = min(self._valid[s.request_id], kept)

    def _forget(self, rid: str) -> None:
        self._valid.pop(rid, None)
        self._fed.pop(rid, None)
        self._q.pop(rid, None)
        self._request_generators.pop(rid, None)

    def swap_blocks(self, pairs: list[tuple[int, int]], out: bool) -> None:
        if not self.catches_up or not pairs or self.swap_caches is None:
            return
        src, dst = ((self.draft.kv_caches, self.swap_caches) if out
                    else (self.swap_caches, self.draft.kv_caches))
        copy_blocks(src, dst, pairs, self.block_dim)

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        return self._q.pop(request_id, None)

    def _valid_prefix(self, request: ProposalRequest) -> int:
        """Leading positions whose draft KV holds the request's tokens (at most all but
        the last, which every proposal starts by feeding)."""
        last = len(request.token_ids) - 1
        if not self.catches_up:
            return last
        valid = min(self._valid.get(request.request_id, 0), last)
        first, fed = self._fed.get(request.request_id, (valid, []))
        for p in range(first, min(valid, first + len(fed))):
            if request.token_ids[p] != fed[p - first]:
                return p
        return valid

    # ----- the passes ------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, batch: ProposalBatch) -> dict[str, list[int]]:
        requests = [r for r in batch.requests if r.num_proposals > 0]
        for r in requests:
            self._q.pop(r.request_id, None)
        if not requests:
            return {}
        drafted: list[list[int]] = [[] for _ in requests]
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]
        starts = [self._valid_prefix(r) for r in requests]
        last = [len(r.token_ids) - 1 for r in requests]
        # Pass 0: the catch-up up to each request's last token; then one token a pass.
        active = list(range(len(requests)))
        feeds = [r.token_ids[s:] for r, s in zip(requests, starts)]
        first_pos = starts
        depth = 0
        while active:
            logits = self._run(batch.block_table, [requests[i].table_row for i in active],
                               [first_pos[i] for i in active], [feeds[i] for i in active])
            tokens, probs = self._draw([requests[i] for i in active], logits,
                                       [drafted[i] for i in active])
            for n, i in enumerate(active):
                drafted[i].append(tokens[n])
                if probs[n] is not None:
                    q_rows[i].append(probs[n])
            depth += 1
            active = [i for i in active if requests[i].num_proposals > depth]
            for i in active:
                feeds[i] = [drafted[i][-1]]
                first_pos[i] = last[i] + depth
        out = {}
        for i, r in enumerate(requests):
            rid = r.request_id
            out[rid] = drafted[i]
            if q_rows[i] and len(q_rows[i]) == len(drafted[i]):
                self._q[rid] = torch.stack(q_rows[i])
            if self.catches_up:
                # Fed: its tokens up to the last, then the proposals but the final one.
                self._valid[rid] = last[i] + len(drafted[i])
                self._fed[rid] = (last[i] + 1, drafted[i][:-1])
        return out

    def _run(self, block_table: np.ndarray, table_rows: list[int], starts: list[int],
             feeds: list[list[int]]) -> torch.Tensor:
        """One forward pass; returns the logits at each row's last fed token, in the
        given row order."""
        q_lens = np.array([len(f) for f in feeds], dtype=np.int64)
        order = np.argsort(q_lens > 1, kind="stable")  # single-token rows first
        q_lens = q_lens[order]
        starts_a = np.array(starts, dtype=np.int64)[order]
        rows_a = np.array(table_rows, dtype=np.int64)[order]
        num_tokens = int(q_lens.sum())
        cu = np.cumsum(q_lens)
        offsets = cu - q_lens
        input_ids = np.fromiter((t for i in order for t in feeds[i]), dtype=np.int64,
                                count=num_tokens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(offsets - starts_a, q_lens)
        bs = self.block_size
        width = int(((starts_a + q_lens + bs - 1) // bs).max())
        table = block_table[rows_a, :width]
        token_rows = np.repeat(np.arange(len(order)), q_lens)
        slots = table[token_rows, positions // bs] * bs + positions % bs
        step = AttentionStep(q_lens, offsets, starts_a, table, slots,
                             int(np.count_nonzero(q_lens == 1)), bs, self.draft.num_blocks)
        meta = self.draft.attention.build_metadata(step, self.device)
        to_device = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
        hidden = self.draft.forward(to_device(input_ids), to_device(positions), meta)
        last = torch.from_numpy(cu - 1).to(hidden.device)
        logits = self.draft.logits(hidden.index_select(0, last))
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return logits[torch.from_numpy(inverse)]

    def _draw(self, requests: list[ProposalRequest], logits: torch.Tensor,
              drafted: list[list[int]]) -> tuple[list[int], list[torch.Tensor | None]]:
        """One token per row: the argmax for greedy requests, else a draw from the
        draft's processed distribution (returned with it)."""
        prompts = [r.token_ids[:r.num_prompt_tokens] for r in requests]
        outputs = [r.token_ids[r.num_prompt_tokens:] + d for r, d in zip(requests, drafted)]
        params = [r.params for r in requests]
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        tokens = [0] * len(requests)
        probs: list[torch.Tensor | None] = [None] * len(requests)
        if greedy:
            g = logits[greedy]
            adjust_logits(g, [params[i] for i in greedy], [prompts[i] for i in greedy],
                          [outputs[i] for i in greedy], self.eos_token_id)
            for i, t in zip(greedy, g.argmax(dim=-1).tolist()):
                tokens[i] = t
        if sampled:
            q = self.sampler.probs(logits[sampled], [params[i] for i in sampled],
                                   [prompts[i] for i in sampled],
                                   [outputs[i] for i in sampled], self.eos_token_id)
            u = torch.tensor([self._uniform(requests[i]) for i in sampled],
                             dtype=torch.float64)
            for n, (i, t) in enumerate(zip(sampled, inverse_cdf(q, u).tolist())):
                tokens[i] = t
                probs[i] = q[n]
        return tokens, probs

    def _uniform(self, request: ProposalRequest) -> float:
        seed = request.params.seed
        if seed is None:
            return float(torch.rand(1, generator=self._generator, dtype=torch.float64))
        generator = self._request_generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device="cpu").manual_seed(seed ^ 0x5DEECE66D)
            self._request_generators[request.request_id] = generator
        return float(torch.rand(1, generator=generator, dtype=torch.float64))

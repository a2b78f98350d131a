"""Batched sampling of the next token from each request's logits, and logprobs.

One pass over the batch, each row with its own SamplingParams, in vLLM's order:
logit_bias, min_tokens masking and penalties on the raw logits, then temperature -> top-k
-> top-p -> min-p -> sample. Greedy rows take the argmax of the adjusted logits.

Semantics of the filters (transformers' warpers): top-k keeps the k most likely tokens and
every token tied with the k-th; top-p renormalizes over the top-k set and keeps a token
while the tokens more likely than it weigh less than top_p (tied tokens are kept or
dropped together); min-p keeps tokens at least min_p times as likely as the best.

Two implementations, same distribution:

* The C kernel (worker/cpu/kernels/sampling.c through worker/cpu/native_sampling.py, when
  `kernels` is given: the CPU platform hands it to the sampler with the cpu-native
  backend). logit_bias, min_tokens and the penalties touch few
  entries and are applied here, in place; then one kernel call samples every row, rows in
  parallel. Each row is read from memory once; in cache, its max, its weights
  exp((x - max) / T), the top-k and top-p cuts (a threshold on the logit, found by a
  histogram of counts or weights over logit buckets and a selection within one bucket, or
  among the few candidates above a bound estimated from a sample of the row), min-p, and
  the inverse CDF at the row's uniform number. No row is sorted and the logits are not
  modified, so the logprob rows only get their few adjusted entries back before a second
  kernel call computes log-sum-exp, rank and top-N of the raw logits.
* The torch fallback, when no C compiler is available. Rows are grouped by kind (greedy,
  top-k, top-p, neither; `group_order`, which the model runner applies before computing
  logits, so each group is a contiguous slice and no row is copied) and every step works
  in place on its slice: the logits become weights exp((x - max) / T) once, sampling is an
  inverse CDF over block sums (one read of the row), top-k rows use `torch.topk`
  candidates (keeping exactly k on a tie at the k-th logit), and top-p without top-k is
  exact rejection sampling (draw; accept when the tokens more likely than the draw weigh
  less than top_p; else drop every token no more likely and draw again).

On a GPU the torch path runs there: every tensor it makes lives on the logits' device,
and the host waits for the device once per step (the sampled ids and logprobs) plus once
per top-p rejection round (whether any row must draw again).

A row draws one uniform number per step (the torch path's top-p rejections draw more),
and a seeded request draws from its own generator only, so its tokens do not depend on
the rest of the batch (a request recomputed after preemption samples once, at its last
token). The two paths map uniform numbers to tokens differently (the torch path walks
top-k candidates by rank and draws again after a top-p rejection), so a seeded request's
tokens are reproducible on one path, not across them. The sampler holds no request state
beyond those generators; it never decides which requests run and never touches the KV
cache.
"""

from __future__ import annotations

from typing import Sequence

import torch

from treadle.core.outputs import TokenLogprobs
from treadle.sampling_params import SamplingParams
from treadle.worker.logit_adjust import adjust_logits
from treadle.worker.sampling_math import (SamplerOutput, _block_inverse_cdf,  # noqa: F401
                                          _inverse_cdf, logprob_entries)

__all__ = ["Sampler", "SamplerOutput", "adjust_logits", "apply_masks", "group_order",
           "logprob_entries", "prompt_logprobs", "takes_plain_argmax"]

_MAX_REJECTION_ROUNDS = 32
"""Top-p draws per row before it falls back to sorting. A rejection drops the drawn token
and every token no more likely, so rows need few draws; the cap guards pathological ties."""
_GREEDY, _TOP_K, _TOP_P, _PLAIN = range(4)


def _kind(p: SamplingParams) -> int:
    if p.is_greedy:
        return _GREEDY
    if p.top_k > 0:
        return _TOP_K
    return _TOP_P if p.top_p < 1.0 else _PLAIN


def group_order(params: Sequence[SamplingParams]) -> list[int]:
    """The row order in which `sample` needs no copy: greedy, top-k, top-p, neither (rows
    with min-p last within their group). Stable."""
    return sorted(range(len(params)), key=lambda i: (_kind(params[i]), params[i].min_p > 0))


class Sampler:
    """Chooses one token per row of logits."""

    def __init__(self, seed: int, kernels=None, device: torch.device | str = "cpu") -> None:
        """`kernels`: the platform's kernel path (worker/cpu/native_sampling.py
        `NativeSampling`: the C kernel), which samples the logits it `covers`; None: torch
        only. Random numbers are drawn on `device` (the logits' device)."""
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._request_generators: dict[str, torch.Generator] = {}
        self.kernels = kernels

    def drop(self, request_ids) -> None:
        """Forget the generators of requests that have ended."""
        for request_id in request_ids:
            self._request_generators.pop(request_id, None)

    def _request_generator(self, request_id: str, seed: int) -> torch.Generator:
        generator = self._request_generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._request_generators[request_id] = generator
        return generator

    def _draw(self, request_ids: Sequence[str], params: Sequence[SamplingParams]
              ) -> torch.Tensor:
        """One U[0, 1) number per row: seeded rows from their own generator."""
        u = torch.rand(len(params), generator=self._generator, dtype=torch.float64,
                       device=self.device)
        for i, p in enumerate(params):
            if p.seed is not None:
                generator = self._request_generator(request_ids[i], p.seed)
                u[i] = torch.rand(1, generator=generator, dtype=torch.float64,
                                  device=self.device)[0]
        return u

    def uniforms(self, request_ids: Sequence[str], params: Sequence[SamplingParams]
                 ) -> torch.Tensor:
        """One U[0, 1) number per row, drawn as `sample` draws them (seeded rows from
        their request's generator, in row order)."""
        return self._draw(request_ids, params)

    def generator_state(self, request_id: str, params: SamplingParams) -> torch.Tensor | None:
        """A seeded request's generator state (None for an unseeded one), for `rewind`."""
        if params.seed is None:
            return None
        return self._request_generator(request_id, params.seed).get_state()

    def rewind(self, request_id: str, state: torch.Tensor, num_draws: int) -> None:
        """Put a seeded request's generator back to `state`, then draw `num_draws`
        numbers: as if only that many rows had been sampled since (speculative decoding
        keeps the stream of a seeded request what it would be without speculation)."""
        generator = self._request_generators[request_id]
        generator.set_state(state)
        for _ in range(num_draws):
            torch.rand(1, generator=generator, dtype=torch.float64, device=self.device)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, request_ids: Sequence[str],
               params: Sequence[SamplingParams],
               prompt_token_ids: Sequence[Sequence[int]] | None = None,
               output_token_ids: Sequence[Sequence[int]] | None = None,
               eos_token_id: int | None = None, masks=None) -> SamplerOutput:
        """logits: [num_rows, vocab] float32, overwritten. Per row: its request id,
        parameters, prompt and generated tokens so far (for penalties, bad_words, DRY
        and min_tokens). `masks` (worker.grammar.StepMasks): allowed-token bitmasks of
        constrained rows, applied after logit_bias and the penalties (logprobs stay the
        raw logits'). Rows in `group_order` are sampled in place; others are first copied
        into it (the C kernel takes rows in any order). Rows with XTC go through
        worker/xtc.py, which samples the others here."""
        if any(p.uses_xtc for p in params):
            from treadle.worker.xtc import sample_with_xtc  # it samples through this class
            return sample_with_xtc(self, logits, request_ids, params, prompt_token_ids,
                                   output_token_ids, eos_token_id, masks)
        return self.sample_rows(logits, request_ids, params, prompt_token_ids,
                                output_token_ids, eos_token_id, masks)

    @torch.inference_mode()
    def sample_rows(self, logits: torch.Tensor, request_ids: Sequence[str],
                    params: Sequence[SamplingParams],
                    prompt_token_ids: Sequence[Sequence[int]] | None = None,
                    output_token_ids: Sequence[Sequence[int]] | None = None,
                    eos_token_id: int | None = None, masks=None) -> SamplerOutput:
        """`sample` without XTC: each row from the distribution its other controls make."""
        if self.kernels is not None and self.kernels.covers(logits):
            return self.kernels.sample(logits, request_ids, params, prompt_token_ids,
                                       output_token_ids, eos_token_id, masks, self._draw)
        num_rows = logits.shape[0]
        order = group_order(params)
        if order != list(range(num_rows)):
            position = {i: j for j, i in enumerate(order)}
            result = self.sample_rows(
                logits[order], [request_ids[i] for i in order], [params[i] for i in order],
                None if prompt_token_ids is None else [prompt_token_ids[i] for i in order],
                None if output_token_ids is None else [output_token_ids[i] for i in order],
                eos_token_id, None if masks is None else
                type(masks)(masks.bitmask, [position[r] for r in masks.rows]))
            tokens, entries = [0] * num_rows, [None] * num_rows
            for j, i in enumerate(order):
                tokens[i], entries[i] = result.token_ids[j], result.logprobs[j]
            return SamplerOutput(tokens, entries)

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = logits[logprob_rows] if logprob_rows else None
        adjust_logits(logits, params, prompt_token_ids, output_token_ids, eos_token_id)
        apply_masks(logits, masks)
        kinds = [_kind(p) for p in params]
        num_greedy = kinds.count(_GREEDY)
        tokens = torch.empty(num_rows, dtype=torch.long, device=logits.device)
        if num_greedy:
            tokens[:num_greedy] = logits[:num_greedy].argmax(dim=-1)
        if num_greedy < num_rows:
            rids, rparams = request_ids[num_greedy:], params[num_greedy:]
            tokens[num_greedy:] = _sample_random(
                logits[num_greedy:], rparams, kinds[num_greedy:],
                lambda rows: self._draw([rids[r] for r in rows], [rparams[r] for r in rows]))

        entries: list[TokenLogprobs | None] = [None] * num_rows
        if raw is not None:
            num_top = [params[i].logprobs for i in logprob_rows]
            for i, entry in zip(logprob_rows, logprob_entries(
                    raw, tokens[logprob_rows], num_top)):
                entries[i] = entry
        return SamplerOutput(tokens.tolist(), entries)

    @torch.inference_mode()
    def probs(self, logits: torch.Tensor, params: Sequence[SamplingParams],
              prompt_token_ids: Sequence[Sequence[int]] | None = None,
              output_token_ids: Sequence[Sequence[int]] | None = None,
              eos_token_id: int | None = None, masks=None) -> torch.Tensor:
        """The distribution `sample_rows` draws each row from, float32 [rows, vocab]:
        every control applied (logit_bias, allowed_token_ids, bad_words, min_tokens,
        penalties, DRY, the grammar `masks` as in `sample`, temperature, top-k, top-p,
        min-p) but XTC's random cut (worker/xtc.py applies it to this distribution; a
        request with XTC is never speculated on); greedy rows one-hot at their token.
        `logits` is overwritten (the penalties are applied in place). Through the C
        kernel when there is one, else by sorting (processed_logits)."""
        if self.kernels is not None and self.kernels.covers(logits):
            return self.kernels.probs(logits, params, prompt_token_ids, output_token_ids,
                                      eos_token_id, masks)
        x = self.processed_logits(logits, params, prompt_token_ids, output_token_ids,
                                  eos_token_id, masks)
        out = torch.softmax(x.float(), dim=-1)
        for i, p in enumerate(params):
            if p.is_greedy:
                out[i].zero_()
                out[i, int(x[i].argmax())] = 1.0
        return out

    @torch.inference_mode()
    def processed_logits(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                         prompt_token_ids: Sequence[Sequence[int]] | None = None,
                         output_token_ids: Sequence[Sequence[int]] | None = None,
                         eos_token_id: int | None = None, masks=None) -> torch.Tensor:
        """The logits the sampler draws from, with every control applied (filtered tokens
        and those the grammar `masks` forbid at -inf); greedy rows get no temperature and
        no filtering. Does not modify `logits`. For tests, inspection and the torch path
        of `probs` (it sorts, rows sharing one SamplingParams object together; `sample`
        never does)."""
        x = logits.clone()
        adjust_logits(x, params, prompt_token_ids, output_token_ids, eos_token_id)
        apply_masks(x, masks)
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            if not p.is_greedy:
                groups.setdefault(id(p), []).append(i)
        for rows in groups.values():
            p = params[rows[0]]
            index = torch.tensor(rows, dtype=torch.long)
            block = x[index] / p.temperature
            vals = block.topk(p.top_k or block.shape[1], dim=-1).values
            keep = _keep_counts(vals, [p] * len(rows))
            # Every logit equal to the last kept one is kept too (transformers' top-k).
            cut = vals.gather(1, (keep - 1).unsqueeze(1))
            x[index] = torch.where(block >= cut, block, float("-inf"))
        return x


def apply_masks(logits: torch.Tensor, masks) -> None:
    """Disallowed tokens of the constrained rows to -inf, in place (the others untouched)."""
    if masks is None or not masks.rows:
        return
    from treadle.structured.matcher import apply_bitmask_

    rows = list(masks.rows)
    part = logits[rows]
    apply_bitmask_(part, masks.bitmask)
    logits[rows] = part


def takes_plain_argmax(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a sampling position of these parameters draws the first token of the
    largest raw logit: greedy, with nothing that changes or reports logits (logit_bias,
    a min_tokens ban still in force, penalties, logprobs, a grammar). Such positions need
    no logits at all (LlamaForCausalLM.greedy_tokens)."""
    return (params.is_greedy and params.logprobs is None and not params.logit_bias
            and not (params.min_tokens and num_output_tokens < params.min_tokens)
            and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and params.structured_outputs is None
            and not params.allowed_token_ids and not params.bad_words
            and not params.uses_dry)


def _sample_random(w: torch.Tensor, params: Sequence[SamplingParams], kinds: list[int],
                   draw) -> torch.Tensor:
    """One token per row of adjusted logits w [rows, vocab] (temperature > 0, rows in
    group order), computed in place. draw(rows) gives fresh uniforms for those rows."""
    num_rows, dev = w.shape[0], w.device
    inv_t = torch.tensor([1.0 / p.temperature for p in params], dtype=w.dtype,
                         device=dev).unsqueeze(1)
    u = draw(list(range(num_rows)))
    tokens = torch.empty(num_rows, dtype=torch.long, device=dev)
    k_end = kinds.count(_TOP_K)
    if k_end:  # top-k commutes with temperature: only the candidates are scaled
        kparams = params[:k_end]
        # top_k above the vocabulary keeps every token (transformers' TopK does too)
        vals, idx = w[:k_end].topk(min(max(p.top_k for p in kparams), w.shape[1]), dim=-1)
        vals = (vals - vals[:, :1]) * inv_t[:k_end]
        keep = _keep_counts(vals, kparams)
        vals.exp_().masked_fill_(torch.arange(vals.shape[1], device=dev) >= keep.unsqueeze(1),
                                 0.0)
        pick = _inverse_cdf(vals, u[:k_end])[0].minimum(keep - 1)
        tokens[:k_end] = idx.gather(1, pick.unsqueeze(1)).squeeze(1)
    if k_end == num_rows:
        return tokens
    rest = w[k_end:]
    row_max = rest.amax(dim=-1, keepdim=True)
    # (w - max) / T, not w / T - max / T: at large logits and small temperatures the
    # latter rounds the most likely token's exponent below 0 and every weight to 0
    rest.sub_(row_max).mul_(inv_t[k_end:])
    rest.exp_()  # weights: the most likely token of each row weighs 1
    min_p = torch.tensor([p.min_p for p in params[k_end:]], dtype=w.dtype,
                         device=dev).unsqueeze(1)
    first_min_p = next((i for i, p in enumerate(params[k_end:]) if p.min_p > 0), None)
    n_end = kinds.count(_TOP_P)
    totals = None
    if first_min_p is not None:
        if n_end:  # top-p is relative to the mass before min-p
            totals = rest[:n_end].sum(dim=-1).double()
        for lo, hi in _min_p_slices(params[k_end:], n_end):
            part = rest[lo:hi]
            # relative to the row's largest weight, which rounding may put just under 1:
            # min_p 1.0 keeps the most likely token, never none
            part.masked_fill_(part < min_p[lo:hi] * part.amax(dim=-1, keepdim=True), 0.0)
    pick, mass = _block_inverse_cdf(rest, u[k_end:])
    if n_end:
        nucleus = torch.tensor([p.top_p for p in params[k_end:k_end + n_end]],
                               dtype=torch.float64, device=dev)
        z = mass[:n_end] if totals is None else totals
        pick[:n_end] = _reject_outside_nucleus(
            rest[:n_end], pick[:n_end], nucleus * z,
            lambda rows: draw([k_end + r for r in rows]))
    tokens[k_end:] = pick
    return tokens


def _min_p_slices(params: Sequence[SamplingParams], n_end: int) -> list[tuple[int, int]]:
    """Contiguous runs of min-p rows (at the end of the top-p group and of the rest)."""
    runs = []
    for lo, hi in ((0, n_end), (n_end, len(params))):
        first = next((i for i in range(lo, hi) if params[i].min_p > 0), None)
        if first is not None:
            runs.append((first, hi))
    return runs


def _reject_outside_nucleus(w: torch.Tensor, pick: torch.Tensor, limit: torch.Tensor, draw
                            ) -> torch.Tensor:
    """Top-p by rejection over weights w [rows, vocab] (overwritten). A draw is in the
    nucleus when the tokens strictly more likely weigh less than limit (top_p times the
    row's mass); when it is not, no token as unlikely is either: they get weight 0 and
    the row draws again (later rounds work on a copy of the rows still drawing). Tokens
    above a draw are never min-p-filtered, so sums over the filtered weights are exact."""
    rows = list(range(w.shape[0]))
    sub, sub_pick, sub_limit = w, pick.clone(), limit
    for _ in range(_MAX_REJECTION_ROUNDS):
        drawn = sub.gather(1, sub_pick.unsqueeze(1))
        above = (sub * (sub > drawn)).sum(dim=-1).double()
        out = (above >= sub_limit).nonzero().flatten().tolist()
        if not out:
            return pick
        rows = [rows[j] for j in out]
        sub = sub[out]
        sub.masked_fill_(sub <= drawn[out], 0.0)
        sub_pick, sub_limit = _block_inverse_cdf(sub, draw(rows))[0], sub_limit[out]
        pick[rows] = sub_pick
    # Pathological ties: sort the rows still drawing and take their exact nucleus.
    for j, r in enumerate(rows):
        vals, idx = sub[j].sort(descending=True)
        keep = max(1, int(((vals.double().cumsum(0) - vals) < sub_limit[j]).sum()))
        pick[r] = idx[int(_inverse_cdf(vals[None, :keep], draw([r]))[0][0])]
    return pick


def _keep_counts(vals: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """How many of the descending candidate logits vals [rows, K] survive top-k, top-p
    and min-p (>= 1); K covers each row's top_k (or the whole vocabulary). Semantics of
    transformers' TopK, TopP and MinP warpers: top-p renormalizes over the top-k set and
    keeps a token while the mass of the tokens ranked above it is below top_p; min-p
    keeps tokens at least min_p times as likely as the best."""
    width, dev = vals.shape[1], vals.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else width for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)
    min_p = torch.tensor([p.min_p for p in params], dtype=vals.dtype, device=dev)
    in_k = torch.arange(width, device=dev) < top_k.unsqueeze(1)
    probs = (vals - vals[:, :1]).exp().double().masked_fill(~in_k, 0.0)
    cum = probs.cumsum(dim=-1)
    before = (cum - probs) / cum[:, -1:]
    n_p = torch.where(top_p >= 1.0, width, (before < top_p.unsqueeze(1)).sum(dim=-1))
    n_min = (vals >= vals[:, :1] + torch.log(min_p).unsqueeze(1)).sum(dim=-1)
    return torch.minimum(torch.minimum(top_k, n_p), n_min).clamp(min=1)


def prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int], num_top: int,
                    max_rows: int = 256) -> list[TokenLogprobs]:
    """Logprobs of each next prompt token given logits [rows, vocab] of the positions
    before it (overwritten), in slices of `max_rows` rows."""
    out = []
    targets = torch.tensor(next_token_ids, dtype=torch.long, device=logits.device)
    for start in range(0, logits.shape[0], max_rows):
        chunk = logits[start:start + max_rows].float()
        out += logprob_entries(chunk, targets[start:start + max_rows],
                               [num_top] * chunk.shape[0])
    return out

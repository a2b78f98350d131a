"""The sampler's arithmetic that other samplers reuse (worker/xtc.py, worker/spec/): the
inverse CDF over unnormalized weights (one row cumsum, or block sums then one block),
logprob entries from raw logits, and `SamplerOutput`. Pure torch on the logits' device;
no request state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from treadle.core.outputs import TokenLogprobs

_BLOCK = 512
"""Weights per block of the two-level inverse CDF (block sums, then one block)."""


@dataclass
class SamplerOutput:
    token_ids: list[int]
    """One sampled token per row."""
    logprobs: list[TokenLogprobs | None]
    """Per row: the sampled token's logprob and the top-N, or None when not asked for."""


def _block_inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse CDF over non-negative weights w [rows, vocab] (unnormalized) without a
    full cumsum: block sums choose a block, then a cumsum of that block alone.
    Returns (token per row, total weight per row as float64)."""
    rows, vocab = w.shape
    if vocab <= 4 * _BLOCK:
        return _inverse_cdf(w, u)
    sums = w.unfold(1, _BLOCK, _BLOCK).sum(dim=-1).double()  # float32 sums: vectorized
    main = sums.shape[1] * _BLOCK
    if main < vocab:
        sums = torch.cat([sums, w[:, main:].sum(dim=-1, keepdim=True).double()], 1)
    cdf = sums.cumsum(dim=-1)
    total = cdf[:, -1]
    target = (u * total).unsqueeze(1)
    # A target rounded up to the total lands in the last block with any weight.
    blocks = torch.arange(sums.shape[1], device=w.device)
    last = torch.where(sums > 0, blocks, 0).amax(dim=1, keepdim=True)
    block = torch.searchsorted(cdf, target, right=True).minimum(last)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    cols = block * _BLOCK + torch.arange(_BLOCK, device=w.device)
    inside = cols < vocab
    weights = w.gather(1, cols.clamp(max=vocab - 1)).double() * inside
    j = torch.searchsorted(weights.cumsum(dim=-1), target - before, right=True)
    j = _nearest_kept(weights, j.clamp_(max=_BLOCK - 1))  # the block's sums round too
    pick = (block * _BLOCK + j).squeeze(1).clamp_(max=vocab - 1)
    return pick, total


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of non-negative weights w [rows, n] (unnormalized), the first index whose
    cumulative weight exceeds u * total, never a zero-weight entry. Returns (index per
    row, total weight per row as float64)."""
    cdf = w.double().cumsum(dim=-1)
    total = cdf[:, -1]
    pick = torch.searchsorted(cdf, (u * total).unsqueeze(1), right=True)
    pick = _nearest_kept(w, pick.clamp_(max=w.shape[1] - 1))  # u * total rounded up
    return pick.squeeze(1), total


def _nearest_kept(w: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """pick [rows, 1] moved, where rounding put it on a zero-weight entry of w [rows, n],
    to the last kept entry before it (the first kept one if there is none): elementwise
    over the rows' n entries, so the device never waits for the host."""
    kept = w > 0
    index = torch.arange(w.shape[1], device=w.device).expand_as(kept)
    before = torch.where(kept & (index <= pick), index, -1).amax(dim=1, keepdim=True)
    first = torch.where(kept, index, w.shape[1]).amin(dim=1, keepdim=True)
    return torch.where(before >= 0, before, first)


def logprob_entries(logits: torch.Tensor, token_ids: torch.Tensor,
                    num_top: Sequence[int]) -> list[TokenLogprobs]:
    """Per row of raw logits [rows, vocab] (overwritten): the given token's logprob and
    rank, then the num_top[row] most likely tokens (ranks 1..N). log_softmax is computed
    as logit - logsumexp; a token's rank counts the tokens at least as likely."""
    chosen = logits.gather(1, token_ids.view(-1, 1))
    ranks = (logits >= chosen).sum(dim=-1).tolist()
    width = max(num_top, default=0)
    top_vals = top_ids = None
    if width:
        top_vals, top_ids = logits.topk(width, dim=-1)
    row_max = logits.amax(dim=-1, keepdim=True)
    lse = row_max + logits.sub_(row_max).exp_().sum(dim=-1, keepdim=True).log()
    chosen_ids, chosen_lps = token_ids.tolist(), (chosen - lse).squeeze(1).tolist()
    if width:
        top_lps, top_ids = (top_vals - lse).tolist(), top_ids.tolist()
    out = []
    for r, n in enumerate(num_top):
        ids, lps, rks = [chosen_ids[r]], [chosen_lps[r]], [ranks[r]]
        if n:
            ids += top_ids[r][:n]
            lps += top_lps[r][:n]
            rks += range(1, n + 1)
        out.append(TokenLogprobs(ids, lps, rks))
    return out

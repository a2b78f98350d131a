"""XTC ("exclude top choices", llama.cpp's sampler): sometimes take the most likely
tokens away, so that a less obvious (but still likely) one is chosen.

Owns the sampler's rows that use XTC. Semantics (llama.cpp's, on treadle's order of
controls): at each token, the row draws one uniform number; when it is below
`xtc_probability`, every token whose probability is at least `xtc_threshold` (in the
distribution the row's other controls make: penalties, DRY, temperature, top-k, top-p,
min-p, its grammar) is removed except the least likely of them, when there are two or
more (tokens tied at that least probability are all kept; llama.cpp keeps one of them,
in whatever order its sort left them); the rest is renormalized and one token drawn.
Otherwise the row is sampled as if it had no XTC. llama.cpp puts temperature last in its
default chain, so at temperature 1 the two agree exactly; treadle applies temperature
first (vLLM's order), as for its other filters.

How: the rows whose draw fires take the platform's `Sampler.probs` (the C kernel's when
there is one, else torch), the cut here, and an inverse-CDF draw at their next uniform
number; every other row goes through `Sampler.sample_rows` as usual. A seeded request
draws XTC's number first and its sampling number second, from its own generator.
Logprobs stay those of the raw logits. It never decides which requests run.
"""

from __future__ import annotations

from typing import Sequence

import torch

from treadle.core.outputs import TokenLogprobs
from treadle.sampling_params import SamplingParams
from treadle.worker.sampling_math import SamplerOutput, _inverse_cdf, logprob_entries


def exclude_top_choices(probs: torch.Tensor, thresholds: Sequence[float]) -> torch.Tensor:
    """XTC's cut, in place, on normalized distributions probs [rows, vocab]: in each row
    with two or more candidates (tokens of nonzero probability) at least as likely as its
    threshold, all of those but the least likely become 0. Returns `probs`."""
    threshold = torch.tensor(thresholds, dtype=probs.dtype, device=probs.device).unsqueeze(1)
    top = (probs >= threshold) & (probs > 0)  # filtered tokens are no candidates
    many = top.sum(dim=-1, keepdim=True) >= 2
    least = torch.where(top, probs, float("inf")).amin(dim=-1, keepdim=True)
    probs.masked_fill_(top & many & (probs > least), 0.0)
    return probs


def _subset_masks(masks, rows: list[int]):
    """The grammar masks of `rows` (logits rows), renumbered as the subset's rows."""
    if masks is None:
        return None
    position = {r: j for j, r in enumerate(rows)}
    keep = [k for k, r in enumerate(masks.rows) if r in position]
    if not keep:
        return None
    return type(masks)(masks.bitmask[keep], [position[masks.rows[k]] for k in keep])


def _pick(items, rows: list[int]):
    return None if items is None else [items[i] for i in rows]


def sample_with_xtc(sampler, logits: torch.Tensor, request_ids: Sequence[str],
                    params: Sequence[SamplingParams], prompt_token_ids, output_token_ids,
                    eos_token_id: int | None, masks) -> SamplerOutput:
    """`Sampler.sample` for a batch where some rows use XTC (see the module docstring)."""
    xtc_rows = [i for i, p in enumerate(params) if p.uses_xtc]
    chance = sampler.uniforms([request_ids[i] for i in xtc_rows],
                              [params[i] for i in xtc_rows]).tolist()
    fired = [i for i, u in zip(xtc_rows, chance) if u < params[i].xtc_probability]
    num_rows = logits.shape[0]
    tokens: list[int] = [0] * num_rows
    entries: list[TokenLogprobs | None] = [None] * num_rows
    chosen = set(fired)
    rest = [i for i in range(num_rows) if i not in chosen]
    if rest:
        out = sampler.sample_rows(
            logits[rest] if fired else logits, _pick(request_ids, rest), _pick(params, rest),
            _pick(prompt_token_ids, rest), _pick(output_token_ids, rest), eos_token_id,
            _subset_masks(masks, rest) if fired else masks)
        for j, i in enumerate(rest):
            tokens[i], entries[i] = out.token_ids[j], out.logprobs[j]
    if not fired:
        return SamplerOutput(tokens, entries)
    fparams = _pick(params, fired)
    logprob_rows = [j for j, p in enumerate(fparams) if p.logprobs is not None]
    raw = logits[[fired[j] for j in logprob_rows]] if logprob_rows else None
    probs = sampler.probs(logits[fired], fparams, _pick(prompt_token_ids, fired),
                          _pick(output_token_ids, fired), eos_token_id,
                          _subset_masks(masks, fired))
    exclude_top_choices(probs, [p.xtc_threshold for p in fparams])
    picked = _inverse_cdf(probs, sampler.uniforms(_pick(request_ids, fired), fparams))[0]
    for j, i in enumerate(fired):
        tokens[i] = int(picked[j])
    if raw is not None:
        lp = logprob_entries(raw, picked[logprob_rows],
                             [fparams[j].logprobs for j in logprob_rows])
        for j, entry in zip(logprob_rows, lp):
            entries[fired[j]] = entry
    return SamplerOutput(tokens, entries)

"""The sampler's C-kernel path (kernels/sampling.c): one kernel call samples every row.

Owns what `Sampler.sample` and `Sampler.probs` do when the CPU platform gave the sampler
this path (worker/sampler.py says what the kernel computes and why): the logit
adjustments and grammar masks applied in place (the sampler's own functions), one
uniform number per row drawn by the sampler, one `NativeKernels.sample` call, and the
logprob rows given their raw logits back before one `NativeKernels.logprobs` call. It
covers float32 logits with contiguous rows; anything else goes the torch path. It keeps
no state besides the kernels and never decides which requests run.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from treadle.core.outputs import TokenLogprobs
from treadle.sampling_params import SamplingParams
from treadle.worker.sampler import SamplerOutput, adjust_logits, apply_masks


def _controls(params: Sequence[SamplingParams]) -> tuple[torch.Tensor, ...]:
    """Per row: inverse temperature (greedy rows 0; 1 / T rounded to float32 as in the
    torch path), top_k, top_p, min_p, as the kernels take them."""
    return (torch.tensor([0.0 if p.is_greedy else 1.0 / p.temperature for p in params],
                         dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.int64),
            torch.tensor([p.top_p for p in params], dtype=torch.float64),
            torch.tensor([p.min_p for p in params], dtype=torch.float32))


class NativeSampling:
    """The sampler's kernel path on `kernels` (worker/cpu/native.py NativeKernels)."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    @staticmethod
    def covers(logits: torch.Tensor) -> bool:
        return logits.dtype == torch.float32 and logits.stride(1) == 1

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str],
               params: Sequence[SamplingParams],
               prompt_token_ids: Sequence[Sequence[int]] | None,
               output_token_ids: Sequence[Sequence[int]] | None,
               eos_token_id: int | None, masks,
               draw: Callable[[Sequence[str], Sequence[SamplingParams]], torch.Tensor]
               ) -> SamplerOutput:
        """`Sampler.sample` through the C kernel: penalties in place here, then one kernel
        call for every row; the logprob rows get their raw logits back (the kernel leaves
        the logits as it found them, so only the few adjusted entries need restoring; a
        masked row that asks for logprobs is kept whole before its mask). `draw`: the
        sampler's uniform numbers for (request ids, params)."""
        num_rows = logits.shape[0]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        masked_lp = sorted(set(logprob_rows) & set(masks.rows)) if masks is not None else []
        raw_masked = logits[masked_lp].clone() if masked_lp else None
        saved = adjust_logits(logits, params, prompt_token_ids, output_token_ids,
                              eos_token_id, save_rows=logprob_rows)
        apply_masks(logits, masks)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        u = torch.zeros(num_rows, dtype=torch.float64)
        if random_rows:
            u[random_rows] = draw([request_ids[i] for i in random_rows],
                                  [params[i] for i in random_rows])
        tokens = self.kernels.sample(logits, *_controls(params), u)
        token_list = tokens.tolist()

        entries: list[TokenLogprobs | None] = [None] * num_rows
        if logprob_rows:
            for rows, cols, values in reversed(saved):
                logits[rows, cols] = values
            if raw_masked is not None:
                logits[masked_lp] = raw_masked
            self._logprobs(logits, tokens, token_list, params, logprob_rows, entries)
        return SamplerOutput(token_list, entries)

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, token_list: list[int],
                  params: Sequence[SamplingParams], logprob_rows: list[int],
                  entries: list[TokenLogprobs | None]) -> None:
        """Fill `entries` of the logprob rows from the raw logits (one kernel call)."""
        rows = torch.tensor(logprob_rows, dtype=torch.int64)
        num_top = [params[i].logprobs for i in logprob_rows]
        stats = self.kernels.logprobs(logits, rows, tokens[rows].contiguous(), max(num_top))
        chosen = logits[rows, tokens[rows]].double()
        chosen_lps = (chosen - stats.lse).tolist()
        ranks, lse = stats.ranks.tolist(), stats.lse
        top_lps = (stats.top_values.double() - lse.unsqueeze(1)).tolist()
        top_ids = stats.top_ids.tolist()
        for j, (i, n) in enumerate(zip(logprob_rows, num_top)):
            entries[i] = TokenLogprobs([token_list[i]] + top_ids[j][:n],
                                       [chosen_lps[j]] + top_lps[j][:n],
                                       [ranks[j]] + list(range(1, n + 1)))

    def probs(self, logits: torch.Tensor, params: Sequence[SamplingParams],
              prompt_token_ids: Sequence[Sequence[int]] | None,
              output_token_ids: Sequence[Sequence[int]] | None,
              eos_token_id: int | None, masks) -> torch.Tensor:
        """`Sampler.probs` through the C kernel: every control applied, float32 [rows,
        vocab]; `logits` is overwritten."""
        adjust_logits(logits, params, prompt_token_ids, output_token_ids, eos_token_id)
        apply_masks(logits, masks)
        return self.kernels.probs(logits, *_controls(params))

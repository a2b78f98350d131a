"""The proposer interface: what a speculative-decoding proposer is given and returns.

A proposer lives in the worker of the output rank (the rank that samples). Each step,
after the target's tokens are sampled and verified, the model runner hands it one
`ProposalRequest` per request that the scheduler asked proposals for
(`ScheduledRequest.num_proposals`), with every token of the request known so far, and
gets back up to that many proposed tokens per request; they travel to the scheduler in
`ModelRunnerOutput.spec_token_ids` and are verified in the request's next step. A
proposer that samples (a draft model under temperature) also keeps the probabilities it
sampled from, which verification needs (`draft_probs`). A proposer never decides how
many tokens to propose, nor which requests speculate: the scheduler does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from treadle.core.outputs import SchedulerOutput
from treadle.sampling_params import SamplingParams


@dataclass
class ProposalRequest:
    """One request to propose for, after this step's verification."""

    request_id: str
    token_ids: list[int]
    """Every token the request has now (prompt, output, this step's new tokens); the
    proposals follow the last one."""
    num_prompt_tokens: int
    num_proposals: int
    params: SamplingParams
    table_row: int
    """Its row of `ProposalBatch.block_table` (its blocks, with the slots the scheduler
    held past this step's tokens for proposals written ahead)."""


@dataclass
class ProposalBatch:
    requests: list[ProposalRequest]
    block_table: np.ndarray
    """The persistent batch's block-table array (rows indexed by ProposalRequest.table_row)."""


class Proposer(ABC):
    """Proposes tokens to follow each request's last one."""

    name: str
    kv_bytes_per_token: int = 0
    """KV bytes it keeps per token beside the target's (a draft model's own cache)."""
    runs_model: bool = False
    """Whether it runs a model whose passes write KV past the computed tokens."""

    def begin_step(self, scheduler_output: SchedulerOutput) -> None:
        """See the step message before the step runs (requests ended, preempted, tables
        replaced). Default: nothing to track."""

    @abstractmethod
    def propose(self, batch: ProposalBatch) -> dict[str, list[int]]:
        """Up to num_proposals tokens per request (fewer, or none, when it has none)."""

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        """For a request whose last proposals were sampled: [num_proposals, vocab]
        float32, the distribution each was drawn from; None for deterministic proposals
        (a lookup, or a greedy request's argmax). Consumed by the call."""
        return None

    def swap_blocks(self, pairs: list[tuple[int, int]], out: bool) -> None:
        """Copy the proposer's own KV blocks with the target's swap plan (out: device to
        swap space, else back). Default: it has none."""

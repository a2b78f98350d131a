"""The messages of one engine step: scheduler -> worker -> scheduler -> output processor.

Plain data, no behaviour and no torch: the scheduler fills a SchedulerOutput, the model
runner answers with a ModelRunnerOutput, and the scheduler turns that into one
EngineCoreOutput per request that produced something.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from treadle.request import FinishReason
from treadle.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]
    """The tokens computed this step (a prompt chunk, a recompute, or one decode token)."""
    num_computed_tokens: int
    """Position of the first of them (tokens already in the KV cache)."""
    block_ids: list[int]
    """The request's block table; it covers every token computed this step."""
    sample: bool
    """True when this step reaches the request's last known token: sample the next one."""
    sampling_params: SamplingParams
    num_output_tokens: int
    """Tokens the request has generated so far (the sampler's penalties and seeds use it)."""
    prompt_token_ids: list[int] = field(default_factory=list)
    """The request's prompt (a reference, not a copy: read-only for the worker)."""
    output_token_ids: list[int] = field(default_factory=list)
    """The request's generated tokens so far (a reference, not a copy: read-only)."""

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """Everything the worker needs to run one step."""

    scheduled: list[ScheduledRequest]
    """Decodes first, then prefill chunks, as the scheduler chose them."""
    finished_request_ids: set[str] = field(default_factory=set)
    """Requests that ended since the last step: the worker drops their state."""
    preempted_request_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, swap block) copies to make before the forward pass."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(swap block, device block) copies to make after swap_out, before the forward pass."""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.swap_in


@dataclass
class TokenLogprobs:
    """Logprobs at one position, from the model's raw logits (before any sampling control).

    Entry 0 is the token actually there (the sampled token, or the prompt token), then the
    top-N most likely tokens in rank order (the token at 0 may appear among them again).
    Ranks start at 1; a token's rank counts the tokens at least as likely as it.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


@dataclass
class PromptLogprobs:
    """Prompt logprobs computed in one step for a run of consecutive prompt positions."""

    first_position: int
    """Index in the prompt of the token that entries[0] scores (>= 1: nothing predicts
    token 0). A recomputed chunk repeats positions already reported; readers key by it."""
    entries: list[TokenLogprobs]


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced."""

    sampled_token_ids: dict[str, int]
    """Next token of each request scheduled with sample=True."""
    logprobs: dict[str, Any] = field(default_factory=dict)
    """Per request that sampled and asked for logprobs: a TokenLogprobs of the sampled
    token and the top-N."""
    prompt_logprobs: dict[str, Any] = field(default_factory=dict)
    """Per request with a prompt chunk this step that asked for prompt logprobs: a
    PromptLogprobs."""


@dataclass
class EngineCoreOutput:
    """New tokens of one request in one step, and whether it has finished."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    new_logprobs: Any = None
    """The runner's TokenLogprobs for the new token, when asked for."""
    new_prompt_logprobs: Any = None
    """The runner's PromptLogprobs for this step's prompt chunk, when asked for."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

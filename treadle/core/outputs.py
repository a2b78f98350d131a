"""The messages of one engine step: scheduler -> worker -> scheduler -> output processor.

Plain dataclasses of ints, lists, strings and SamplingParams, no behaviour and no torch,
so that they cross a process boundary as they are (pickle; see treadle/bench/messages.py
for what that costs). The scheduler fills a SchedulerOutput, the worker answers with a
ModelRunnerOutput, and the scheduler turns that into one EngineCoreOutput per request
that produced something.

`WorkerInfo` is the one message of start-up: what the worker found out about the model and
the device. The step message is incremental (docs/step_messages.md has the design): a request's
prompt, sampling parameters and block table travel once, in `NewRequestData`, the first
time the request is scheduled; after that, each step carries only what changed since the
worker last saw it (`ScheduledRequest`: tokens appended, blocks appended, tokens to
compute). The worker keeps the rest in its persistent batch. The scheduler is the one
source of truth for a request's tokens: the worker learns of its own sampled tokens
only when the scheduler has accepted them, so a rejected speculative token never enters
the worker's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from treadle.core.policy import PreemptionCosts
from treadle.lora import LoRARequest
from treadle.core.spec_decode import SpecCosts
from treadle.request import FinishReason
from treadle.sampling_params import SamplingParams


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker reports once its model is loaded, before the KV cache is allocated:
    the facts the engine core needs and cannot know without the device."""

    model_dir: str
    dtype: str
    """The model's dtype, e.g. 'bfloat16'."""
    vocab_size: int
    eos_token_id: int | None
    max_model_len: int
    num_parameters: int
    kv_bytes_per_token: int
    """KV-cache bytes one token holds across all layers (this worker's share)."""
    num_kv_blocks: int
    """Blocks that fit in the KV memory the worker was given."""
    num_swap_blocks: int
    """Blocks that fit in the swap space (0 when preemption never swaps)."""
    preemption_costs: PreemptionCosts | None
    """Measured recompute and swap rates (preemption_mode=auto), else None."""
    attention_backend: str
    kernels: str
    """One line: which kernels run (for the start-up log)."""
    num_lora_slots: int = 0
    """Adapters the worker holds resident at once (0: LoRA is off): the scheduler never
    runs more distinct adapters in one step."""
    lora_module_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Module an adapter may target -> (in_features, out_features) of the whole model."""
    num_layers: int = 0
    """Decoder layers of the whole model."""
    spec_costs: SpecCosts | None = None
    """Measured step and draft costs for the adaptive speculation policy (the output
    rank's, with speculative decoding configured), else None."""
    layer_windows: tuple[int | None, ...] = ()
    """Each layer's sliding window (None: full attention), whole model: the engine core
    splits the KV memory from it once (core/kv/config.py) and tells the workers."""
    kv_medium: str = "CPU"
    """Where the KV cache lives, as KV events name it: CPU (host memory) or GPU."""


@dataclass
class NewRequestData:
    """What the worker keeps of a request for as long as it lives (sent once)."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    lora_request: LoRARequest | None = None
    """The adapter it runs with (the worker loads it into a slot when needed)."""


@dataclass
class KVCompaction:
    """Heavy-hitter eviction of one request before the step (kv_specs/eviction.py): of its
    `num_tokens` cached tokens keep `num_kept` (the `num_recent` most recent and the
    highest-scoring others, in their order), moved to the first slots of `dst_block_ids`.
    `src_block_ids` is its block table before, so the worker needs nothing else of it."""

    request_id: str
    num_tokens: int
    num_kept: int
    num_recent: int
    src_block_ids: list[int]
    dst_block_ids: list[int]


@dataclass
class ScheduledRequest:
    """One request's share of a step: what the worker does not know yet, and what to run."""

    request_id: str
    num_computed_tokens: int
    """Position of the first token computed this step (tokens already in the KV cache)."""
    num_scheduled_tokens: int
    """Tokens computed this step: a prompt chunk, a recompute, or the last sampled token
    plus `spec_token_ids`."""
    num_evicted_tokens: int = 0
    """Computed tokens whose KV was evicted (H2O): the row's first new token goes to cache
    slot num_computed_tokens - num_evicted_tokens, at position num_computed_tokens."""
    new_token_ids: list[int] = field(default_factory=list)
    """Tokens appended to the request (generated ones) since the worker last saw it."""
    new_block_ids: list[int] = field(default_factory=list)
    """Blocks appended to the request's block table since the worker last saw it."""
    replaces_block_table: bool = False
    """`new_block_ids` is the whole table (after a preemption or a rollback)."""
    new_sliding_block_ids: list[int] = field(default_factory=list)
    """The same for the sliding-window layers' table (core/kv/sliding.py; empty without
    a sliding group): as many entries as `new_block_ids`, stale where freed."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed tokens computed after the request's last token this step (speculation):
    the worker scores them and returns the accepted ones plus one of its own."""
    sample: bool = False
    """True when this step reaches the request's last known token: sample what follows."""
    is_decoding: bool = False
    """The request's prompt is computed: this step computes its last generated token
    (Request.is_decoding when it was scheduled)."""
    num_proposals: int = 0
    """Tokens the worker's proposer should propose after this step for the request's next
    one (the scheduler's choice, core/spec_decode.py; 0: none). With a model-based
    proposer the request's blocks hold slots for them (its KV is written ahead)."""
    new_request: NewRequestData | None = None
    """Set the first time the worker sees the request."""


@dataclass
class SchedulerOutput:
    """Everything the worker needs to run one step."""

    scheduled: list[ScheduledRequest]
    """Decodes first, then prefill chunks, as the scheduler chose them (the worker orders
    its rows itself; this order is for people reading a trace)."""
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that ended since the last step: the worker drops their state."""
    preempted_request_ids: list[str] = field(default_factory=list)
    """Requests that lost their KV this step (the worker keeps their state)."""
    swapped_request_ids: list[str] = field(default_factory=list)
    """Those of preempted_request_ids whose KV went to the swap space (it comes back by
    swap_in, block for block); the others lost it and recompute."""
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device block, swap block) copies to make before the forward pass."""
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(swap block, device block) copies to make after swap_out, before the forward pass."""
    num_recomputed_tokens: int = 0
    """Scheduled tokens whose KV a recompute preemption threw away: work done again."""
    kv_compactions: list[KVCompaction] = field(default_factory=list)
    """Heavy-hitter evictions to carry out first, before the swap copies and the forward
    pass (their freed blocks may be written or swapped into this step)."""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return (not self.scheduled and not self.swap_out and not self.swap_in
                and not self.kv_compactions)


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
    full: object = None
    """With prompt_logprobs -1: a numpy float16 array [positions, vocab] of every
    position's log-probabilities (then `entries` is empty)."""


@dataclass
class StepTimings:
    """What one step cost the worker (seconds and bytes), for the engine's statistics."""

    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    swap_s: float = 0.0
    """Copying swapped-out and swapped-in blocks."""
    comm_s: float = 0.0
    """In collectives: all-reduces, logit gathers, activations between stages."""
    propose_s: float = 0.0
    """In the speculative proposer (its lookup or its draft model's passes)."""
    swap_bytes_out: int = 0
    swap_bytes_in: int = 0


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced."""

    sampled_token_ids: dict[str, list[int]]
    """New tokens of each request scheduled with sample=True: one, or with speculation
    the accepted proposed tokens followed by one the worker sampled."""
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """Per request that sampled and asked for logprobs: one TokenLogprobs per new token."""
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    """Per request with a prompt chunk this step that asked for prompt logprobs."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Tokens proposed for each request's next step (a speculative proposer's output)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests a per-request component failed for this step (its grammar, its adapter's
    load): id -> what happened. The scheduler ends each with finish reason 'error' and
    drops whatever the step sampled for it; the other requests go on."""
    timings: StepTimings = field(default_factory=StepTimings)


@dataclass
class EngineCoreOutput:
    """New tokens of one request in one step, and whether it has finished."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    """The runner's TokenLogprobs for each new token, when asked for."""
    new_prompt_logprobs: PromptLogprobs | None = None
    """The runner's PromptLogprobs for this step's prompt chunk, when asked for."""
    num_cached_tokens: int = 0
    """Prompt tokens the prefix cache supplied when the request was admitted (reported
    with its first output)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


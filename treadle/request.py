"""A request's lifecycle: its tokens, its progress, its status and why it finished.

The scheduler and the KV manager read and advance this state; nothing here decides
policy or touches tensors.
"""

from __future__ import annotations

import enum
import time

from treadle.lora import LoRARequest
from treadle.sampling_params import SamplingParams


INTERACTIVE = "interactive"
BATCH = "batch"
BANDS = (INTERACTIVE, BATCH)
"""A request's band, most urgent first: batch work (the Batch API's lines) runs in the
lowest band under every policy: after every interactive request, on idle capacity only,
and first to be preempted (docs/scheduling.md, "The batch band")."""


def check_scheduling(band: str = INTERACTIVE, slo_ttft_ms: float | None = None,
                     slo_tpot_ms: float | None = None) -> None:
    """A ValueError naming the first of a request's band and deadlines that is not valid:
    a band of BANDS, deadlines positive finite milliseconds (or None)."""
    if band not in BANDS:
        raise ValueError(f"band must be one of {', '.join(BANDS)}, got {band!r}")
    for name, value in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < float("inf")):
            raise ValueError(f"{name} must be a positive number of milliseconds, "
                             f"got {value!r}")


class RequestStatus(enum.IntEnum):
    """Where a request is. Every value >= FINISHED_STOPPED is a finished state."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    """Preempted by recompute: back in the waiting queue with no KV."""
    SWAPPED = 3
    """Preempted by swap: its KV waits in the swap pool."""
    WAITING_FOR_REMOTE_KV = 4
    """P/D: its prompt was prefilled elsewhere; it waits, outside the waiting queue and
    holding no running slot, for the KV blocks to land (treadle/distributed/pd_engine.py)."""
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    """Why a request ended, as the OpenAI API names it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One generation request and its progress through the engine.

    `num_computed_tokens` counts the tokens whose KV is in the cache; the request wants to
    catch up to `num_tokens` (prompt plus generated). There are no prefill and decode
    phases: a request with many uncomputed tokens is "prefilling", one with a single
    uncomputed token is "decoding" (`is_decoding`, the one definition the scheduler, the
    worker and the trace use). A decoding request may carry `spec_token_ids`: tokens
    proposed to follow its last one, computed with it in one step and kept only as far
    as the model agrees with them.

    With heavy-hitter eviction (kv_specs/eviction.py) the cache holds fewer tokens than
    were computed: `num_evicted_tokens` of them were dropped, and `num_kv_tokens` is what
    the request's blocks hold (positions still count every computed token).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_id: int | None = None,
                 arrival_time: float | None = None, priority: int = 0,
                 cache_salt: str | None = None, tenant: str | None = None,
                 length_hint: int | None = None,
                 lora_request: LoRARequest | None = None, band: str = INTERACTIVE,
                 slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> None:
        check_scheduling(band, slo_ttft_ms, slo_tpot_ms)
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.tenant = tenant
        """Who the request is for: the `fair` policy shares tokens between tenants."""
        self.length_hint = length_hint
        """Expected number of output tokens, when known (the `srpt` policy uses it instead
        of max_tokens)."""
        self.lora_request = lora_request
        """The LoRA adapter it runs with; None: the base model."""
        self.band = band
        """interactive, or batch: the lowest band under every policy (BANDS)."""
        self.slo_ttft_ms = slo_ttft_ms
        """Its time-to-first-token target, from arrival (the `slo` policy orders by it)."""
        self.slo_tpot_ms = slo_tpot_ms
        """Its target time per output token after the first (the `slo` policy)."""
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.max_num_computed_tokens = 0
        self.num_evicted_tokens = 0
        """Computed tokens whose KV was evicted (H2O); 0 again when it recomputes."""
        """The most tokens it ever had in the KV cache (a recompute preemption loses them:
        computing them again is work done twice)."""
        self.num_cached_tokens = 0
        """Prompt tokens found in the prefix cache when the request was first admitted
        (the scheduler sets it; the API reports it as usage.prompt_tokens_details)."""
        self.status = RequestStatus.WAITING
        self.error: str | None = None
        self.num_preemptions = 0
        self.queued_s = 0.0
        """Seconds it spent waiting (queued, not running) before it last started."""
        self.queued_since: float | None = self.arrival_time
        """When it last started waiting (arrival, or its preemption); None while it runs
        (the scheduler keeps both: `waited`)."""
        self.resumed_step: int | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.spec_token_ids: list[int] = []
        """Proposed next tokens (speculative decoding), scored in the request's next step."""
        self.parent_id: str | None = None
        """The user request this one is a sample of (the n samples of an n > 1 request
        share it); None for a request made directly."""

    @property
    def lora_int_id(self) -> int | None:
        """Its adapter's id, None for the base model."""
        return None if self.lora_request is None else self.lora_request.lora_int_id

    def waited(self, now: float) -> float:
        """Seconds it has spent waiting to run, up to `now` (time running not counted)."""
        since = self.queued_since
        return self.queued_s + (max(0.0, now - since) if since is not None else 0.0)

    def start_running(self, now: float) -> None:
        """It leaves the queue for a running slot (the scheduler calls this)."""
        self.queued_s = self.waited(now)
        self.queued_since = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV its blocks hold: the computed ones less any evicted."""
        return self.num_computed_tokens - self.num_evicted_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Every token but the last is in the KV cache: the next step computes that one
        token (and any proposed tokens after it) and samples what follows. Usually the
        last generated token; also the last token of a prompt whose chunks left one."""
        return self.num_computed_tokens == len(self.all_token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status this request has reached after its last token, if any."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if last == self.eos_token_id and (not params.ignore_eos
                                          or params.structured_outputs is not None):
            return RequestStatus.FINISHED_STOPPED  # a grammar's end is the request's end
        if last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if (len(self.output_token_ids) >= params.max_tokens
                or len(self.all_token_ids) >= max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")

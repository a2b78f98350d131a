"""The one loop over outputs: engine-core outputs -> up-to-date user-facing RequestOutputs.

Owns, per user request: incremental detokenization, stop strings (a match ends the
request; `process` returns the engine ids to stop), logprobs dictionaries, prompt
logprobs, finish and stop reasons, timings, and the grouping of the n samples of an
n > 1 request. It creates the engine Requests (`engine_requests`), with the request's
scheduling attributes (priority, tenant, which is also the prefix-cache salt, length
hint), so that the n samples share the prompt's KV blocks: sample 0 goes first; samples
1..n-1 become ready once sample 0 has computed its prompt (`requests_to_add`), when the
prefix cache gives them every full prompt block. Engine ids: the request id for n = 1,
f"{id}#{i}" for n > 1.

It never calls into the engine: `process` returns what to stop, `requests_to_add` what
to add, and the caller (engine/driver.py) does both. It never schedules, never touches
tensors, and never raises on a bad request once added: errors arrive as outputs
(`reject`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treadle.core.kv.hashing import prefix_salt
from treadle.core.outputs import EngineCoreOutput, PromptLogprobs, TokenLogprobs
from treadle.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher, make_decode
from treadle.lora import LoRARequest
from treadle.request import INTERACTIVE, FinishReason, Request
from treadle.sampling_params import ALL_LOGPROBS, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Logprob:
    """One token's log-probability (from the model's raw logits) and rank (1 = best)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
    """The token's own text (special tokens included); None without a tokenizer."""


@dataclass
class CompletionOutput:
    """One generated sequence, cumulative: every field only ever grows while it runs."""

    index: int
    text: str
    """Text that could still be the start of a stop string is held back until resolved."""
    token_ids: list[int]
    finish_reason: str | None
    """'stop', 'length', 'abort' or 'error'; None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it; None for EOS and other reasons."""
    logprobs: list[dict[int, Logprob]] | None = None
    """Per generated token: the chosen token and the top-N (when logprobs was asked)."""
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    """When things happened to a request (time.monotonic seconds)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None

    @property
    def ttft(self) -> float | None:
        """Arrival to first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one user request (all its samples)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    error: str | None = None
    """Why the request failed, when its finish_reason is 'error'."""
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """Per prompt token (None for the first): its logprob and the top-N."""
    prompt_logprob_array: Any = None
    """With prompt_logprobs -1: numpy float16 [prompt tokens, vocab], row j the
    log-probabilities of the token at position j given those before it (row 0 NaN)."""
    num_cached_tokens: int = 0
    """Prompt tokens the prefix cache supplied (OpenAI's usage.prompt_tokens_details)."""


def engine_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


class _Sample:
    """One engine request: one of the n samples of a user request."""

    def __init__(self, index: int, request: Request, decode, prompt_token_ids) -> None:
        self.index = index
        self.request = request
        self.params: SamplingParams = request.sampling_params
        self.handed_out = False
        self.ready = index == 0
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = (
            [] if self.params.logprobs is not None else None)
        self.cumulative_logprob: float | None = (
            0.0 if self.params.logprobs is not None else None)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detokenizer = (IncrementalDetokenizer(decode, prompt_token_ids)
                            if decode is not None else None)
        self.matcher = StopStringMatcher(self.params.stop,
                                         self.params.include_stop_str_in_output)

    def snapshot(self) -> CompletionOutput:
        return CompletionOutput(
            self.index, self.text, list(self.token_ids), self.finish_reason, self.stop_reason,
            None if self.logprobs is None else list(self.logprobs), self.cumulative_logprob)

    def end_text(self) -> None:
        """The sequence ended without a stop string: release everything held back."""
        if self.detokenizer is not None:
            self.text += self.matcher.feed(self.detokenizer.flush(), check=False)
        self.text += self.matcher.flush()


class _UserRequest:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time
        self.samples: list[_Sample] = []
        self.error: str | None = None
        whole = params.prompt_logprobs == ALL_LOGPROBS
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None if params.prompt_logprobs is None or whole else [None] * len(prompt_token_ids))
        self.prompt_logprob_array = None
        """The whole vocabulary's prompt log-probabilities (prompt_logprobs -1), filled
        as chunks arrive."""
        self.finished_time: float | None = None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def metrics(self) -> RequestMetrics:
        scheduled = [s.request.first_scheduled_time for s in self.samples
                     if s.request.first_scheduled_time is not None]
        first_tokens = [s.request.first_token_time for s in self.samples
                        if s.request.first_token_time is not None]
        return RequestMetrics(self.arrival_time, min(scheduled, default=None),
                              min(first_tokens, default=None), self.finished_time)


class OutputProcessor:
    """The one loop over outputs: detokenization, stop strings, logprobs, n>1 grouping."""

    def __init__(self, tokenizer) -> None:
        """`tokenizer`: a transformers tokenizer, or None (token ids only, text "")."""
        self.tokenizer = tokenizer
        self._requests: dict[str, _UserRequest] = {}
        self._by_engine_id: dict[str, tuple[_UserRequest, _Sample]] = {}
        self._token_text_cache: dict[int, str] = {}
        self._decode_raw = make_decode(tokenizer, False) if tokenizer is not None else None

    # ----- requests in ----------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float, priority: int = 0,
                    tenant: str | None = None, length_hint: int | None = None,
                    lora_request: LoRARequest | None = None, band: str = INTERACTIVE,
                    slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None) -> None:
        """Track a user request and create its engine Requests (see engine_requests).

        `tenant`, with the request's own `cache_salt`, is each engine request's
        prefix-cache salt: tenants (and salts) never share KV. `band`, `slo_ttft_ms` and
        `slo_tpot_ms`: the scheduler's (treadle/request.py)."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if params.stop and self.tokenizer is None:
            logger.warning("request %s: stop strings ignored, the model has no tokenizer",
                           request_id)
        state = _UserRequest(request_id, prompt, prompt_token_ids, params, arrival_time)
        decode = (make_decode(self.tokenizer, params.skip_special_tokens,
                              params.spaces_between_special_tokens)
                  if self.tokenizer is not None else None)
        for i in range(params.n):
            sample_params = params if params.n == 1 else params.for_sample(i)
            request = Request(engine_request_id(request_id, i, params.n), prompt_token_ids,
                              sample_params, arrival_time=arrival_time, priority=priority,
                              cache_salt=prefix_salt(tenant, params.cache_salt),
                              tenant=tenant, length_hint=length_hint,
                              lora_request=lora_request, band=band, slo_ttft_ms=slo_ttft_ms,
                              slo_tpot_ms=slo_tpot_ms)
            request.parent_id = request_id
            sample = _Sample(i, request, decode, prompt_token_ids)
            state.samples.append(sample)
            self._by_engine_id[request.request_id] = (state, sample)
        self._requests[request_id] = state

    def engine_requests(self, request_id: str) -> list[Request]:
        """The engine Requests to add to EngineCore now: sample 0 right after add_request,
        the other samples of an n > 1 request once `requests_to_add` names it. Each is
        handed out once; callers may set priority, cache_salt and arrival_time on them."""
        state = self._requests.get(request_id)
        if state is None:
            return []
        ready = [s for s in state.samples
                 if s.ready and not s.handed_out and s.finish_reason is None]
        for s in ready:
            s.handed_out = True
        return [s.request for s in ready]

    def requests_to_add(self) -> list[str]:
        """User requests with samples ready to be added (see engine_requests)."""
        return [rid for rid, state in self._requests.items()
                if any(s.ready and not s.handed_out and s.finish_reason is None
                       for s in state.samples)]

    def engine_request_ids(self, request_id: str) -> list[str]:
        """Every engine id of the request (to abort in the core; unknown ids are no-ops)."""
        state = self._requests.get(request_id)
        return [] if state is None else [s.request.request_id for s in state.samples]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ----- ends decided outside -------------------------------------------------------

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish every running sample with 'abort'; the final output, or None if unknown."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        for s in state.samples:
            if s.finish_reason is None:
                s.end_text()
                s.finish_reason = FinishReason.ABORT.value
        return self._finish(state)

    def reject(self, request_id: str, error: str) -> RequestOutput:
        """Finish the request with 'error' (e.g. refused at admission) and its final output.
        Works for an id never added too (then with no prompt)."""
        state = self._requests.get(request_id)
        if state is None:
            return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], "error")],
                                 finished=True, error=error)
        state.error = error
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = FinishReason.ERROR.value
        return self._finish(state)

    # ----- the loop -------------------------------------------------------------------

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """One RequestOutput per user request that changed, and the engine ids to stop
        now (EngineCore.stop_request) because a stop string matched."""
        changed: dict[str, _UserRequest] = {}
        to_stop: list[str] = []
        for out in outputs:
            located = self._by_engine_id.get(out.request_id)
            if located is None:
                continue
            state, sample = located
            if sample.finish_reason is not None:
                continue  # e.g. stopped by a stop string while the next step was running
            if out.new_prompt_logprobs is not None and sample.index == 0:
                self._add_prompt_logprobs(state, out.new_prompt_logprobs)
            if sample.index == 0:
                state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if not out.new_token_ids and not out.finished:
                continue
            changed[state.request_id] = state
            if self._update(state, sample, out) and not out.finished:
                to_stop.append(out.request_id)
            if sample.index == 0 and len(state.samples) > 1:
                self._release_siblings(state, sample)
        results = []
        for state in changed.values():
            results.append(self._finish(state) if state.finished else self._snapshot(state))
        return results, to_stop

    def _update(self, state: _UserRequest, sample: _Sample, out: EngineCoreOutput) -> bool:
        """Apply one output to one sample; True when a stop string ended it."""
        params = sample.params
        if params.max_tokens == 0:
            # Scoring a prompt (prompt_logprobs): nothing is generated. The scheduler still
            # samples one token before it finishes the request; it is not output.
            if out.error is not None:
                state.error = out.error
            if out.finish_reason is not None:
                sample.end_text()
                sample.finish_reason = (out.finish_reason.value if out.finish_reason in (
                    FinishReason.ABORT, FinishReason.ERROR) else FinishReason.LENGTH.value)
            return False
        new_ids = out.new_token_ids
        sample.token_ids.extend(new_ids)
        if out.new_logprobs is not None and sample.logprobs is not None:
            for entry in out.new_logprobs:
                sample.logprobs.append(self._logprob_dict(entry))
                sample.cumulative_logprob += entry.logprobs[0]
        if out.error is not None:
            state.error = out.error
        finish = out.finish_reason
        stopped_by_token = finish == FinishReason.STOP and bool(new_ids)
        text_ids = new_ids
        if stopped_by_token and not params.include_stop_str_in_output:
            text_ids = new_ids[:-1]  # the stop token's (or EOS's) text is not shown
        if sample.detokenizer is not None:
            delta = sample.detokenizer.push(text_ids)
            sample.text += sample.matcher.feed(
                delta, check=len(sample.token_ids) >= params.min_tokens)
        if sample.matcher.matched is not None:
            sample.finish_reason = FinishReason.STOP.value
            sample.stop_reason = sample.matcher.matched
            return True
        if finish is not None:
            sample.end_text()
            sample.finish_reason = finish.value
            if stopped_by_token and new_ids[-1] in params.stop_token_ids:
                sample.stop_reason = new_ids[-1]
        return False

    def _release_siblings(self, state: _UserRequest, first: _Sample) -> None:
        """Sample 0 has computed the prompt (or ended): the others may start."""
        for s in state.samples[1:]:
            if s.ready or s.finish_reason is not None:
                continue
            if first.finish_reason in (FinishReason.ABORT.value, FinishReason.ERROR.value):
                s.finish_reason = first.finish_reason
            else:
                s.ready = True

    def _add_prompt_logprobs(self, state: _UserRequest, chunk: PromptLogprobs) -> None:
        if chunk.full is not None:
            if state.prompt_logprob_array is None:
                state.prompt_logprob_array = np.full(
                    (len(state.prompt_token_ids), chunk.full.shape[1]), np.nan, np.float16)
            first = chunk.first_position
            state.prompt_logprob_array[first:first + len(chunk.full)] = chunk.full
            return
        if state.prompt_logprobs is None:
            return
        for k, entry in enumerate(chunk.entries):
            state.prompt_logprobs[chunk.first_position + k] = self._logprob_dict(entry)

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        result: dict[int, Logprob] = {}
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            if token_id not in result:
                result[token_id] = Logprob(logprob, rank, self._token_text(token_id))
        return result

    def _token_text(self, token_id: int) -> str | None:
        if self._decode_raw is None:
            return None
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self._token_text_cache[token_id] = self._decode_raw([token_id])
        return text

    def _snapshot(self, state: _UserRequest) -> RequestOutput:
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids,
            [s.snapshot() for s in state.samples], finished=state.finished,
            error=state.error, metrics=state.metrics(),
            prompt_logprobs=(None if state.prompt_logprobs is None
                             else list(state.prompt_logprobs)),
            prompt_logprob_array=state.prompt_logprob_array,
            num_cached_tokens=state.num_cached_tokens)

    def _finish(self, state: _UserRequest) -> RequestOutput:
        """The final output of a finished request; forget it."""
        state.finished_time = time.monotonic()
        self._requests.pop(state.request_id, None)
        for s in state.samples:
            self._by_engine_id.pop(s.request.request_id, None)
        return self._snapshot(state)

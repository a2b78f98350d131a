"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, params)`.

Owns tokenization of string prompts and the loop that steps the engine until every
request of a `generate` call has ended, with its progress bar. Adding requests and
processing a step's outputs go through EngineDriver (the same path as the server's);
detokenization, stop strings, logprobs and n > 1 grouping are the OutputProcessor's;
scheduling stays in EngineCore, model execution in its workers. RequestOutput and
CompletionOutput are re-exported here.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from typing import Any, Sequence, Union

from tqdm.auto import tqdm

from treadle.config import EngineConfig
from treadle.engine.core import EngineCore
from treadle.engine.driver import EngineDriver
from treadle.engine.limits import EngineLimits
from treadle.engine.output_processor import (CompletionOutput, Logprob, RequestMetrics,
                                             RequestOutput)
from treadle.engine.watchdog import core_watchdog
from treadle.lora import LoRARequest
from treadle.models.tokenizer import load_tokenizer
from treadle.request import INTERACTIVE, check_scheduling
from treadle.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput",
           "load_tokenizer"]

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int], dict[str, Any]]


class PromptError(ValueError):
    """This one prompt cannot be turned into token ids (it fails alone, with an output)."""


OFFLINE_MAX_NUM_BATCHED_TOKENS = 1024
"""The step budget of `LLM` when none is given; the server keeps SchedulerConfig's 512.
Offline, only throughput counts, and a larger step spreads each step's fixed costs over
more prompt tokens: +3% output tokens/s on the engine-core workload (bf16, 2 cores, two
alternating runs each: 302.0 / 297.5 at 1024, 293.8 / 288.9 at 512, 294.3 / 296.9 at
2048). Online, steps twice as long delay first tokens (azure replay p99 TTFT 1.26 s at
1024 against 0.92 s at 512, one run each). vLLM makes the same split on CPU (4096 for
its LLM class, 2048 for its server)."""


STRUCTURED_UNSUPPORTED = ("structured_outputs: this model has no tokenizer files, so no "
                          "grammar can be built for it")
"""Without a tokenizer (EngineCore.supports_structured_outputs false) a constrained request
is refused rather than run unconstrained."""


class LLM:
    """An engine for offline batch generation."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        engine_options.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        self.config = EngineConfig.from_options(model=model, **engine_options)
        self.engine = EngineCore(self.config)
        self.limits = EngineLimits.from_core(self.engine)
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self.driver = EngineDriver(self.engine, self.tokenizer)
        self._request_counter = itertools.count()

    def _prompt_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt; PromptError saying what is wrong with it."""
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                return text if isinstance(text, str) else None, self._checked_ids(
                    prompt["prompt_token_ids"], "prompt_token_ids")
            if "prompt" in prompt:
                return self._prompt_token_ids(prompt["prompt"])
            raise PromptError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, (list, tuple)):
            return None, self._checked_ids(prompt, "prompt")
        raise PromptError(f"prompt must be a str, a list of token ids or a dict, "
                          f"got {type(prompt).__name__}")

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise PromptError("this model has no tokenizer: pass prompts as token ids "
                              "({'prompt_token_ids': [...]})")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PromptError(f"prompt holds a lone UTF-16 surrogate at character {exc.start}: "
                              "not valid Unicode, no tokenizer can encode it") from None
        try:
            return self.tokenizer.encode(text, add_special_tokens=True)
        except Exception as exc:  # a tokenizer may refuse text: that prompt fails, alone
            raise PromptError(f"prompt could not be tokenized: {exc}") from None

    def _checked_ids(self, ids, name: str) -> list[int]:
        """Token ids as plain ints, each an integer (numpy's too, not bool) in the vocabulary."""
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise PromptError(f"{name} must be a list of token ids, got {type(ids).__name__}")
        vocab = self.limits.vocab_size
        checked = []
        for i, token in enumerate(ids):
            if not isinstance(token, numbers.Integral) or isinstance(token, bool):
                raise PromptError(f"{name}[{i}] is {token!r}: token ids are integers in "
                                  f"[0, {vocab})")
            if not 0 <= token < vocab:
                raise PromptError(f"{name}[{i}] is {token}, outside the vocabulary "
                                  f"[0, {vocab})")
            checked.append(int(token))
        return checked

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: int | Sequence[int] = 0,
                 tenant: str | None | Sequence[str | None] = None,
                 length_hint: int | None | Sequence[int | None] = None,
                 lora_request: LoRARequest | None | Sequence[LoRARequest | None] = None,
                 band: str | Sequence[str] = INTERACTIVE,
                 slo_ttft_ms: float | None | Sequence[float | None] = None,
                 slo_tpot_ms: float | None | Sequence[float | None] = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        `priority` (lower runs first), `tenant` (the `fair` policy's share),
        `length_hint` (expected output tokens, for `srpt`), `lora_request` (the
        adapter to run with, None for the base model; needs `enable_lora=True`), `band`
        ("interactive", or "batch": after every interactive request under every policy)
        and the deadlines `slo_ttft_ms` / `slo_tpot_ms` (time to first token from the
        call, time per output token after it; the `slo` policy orders by them) are one
        value for every prompt or one per prompt. They are arguments here, as vLLM's
        `priority` is, not SamplingParams fields: they say when a request runs, not what
        it generates (the workers never see them). A bad value is a ValueError naming
        it, before anything runs. A prompt that can never run (empty, too
        long for the context or the KV cache, token ids that are not integers in the
        vocabulary, text that cannot be tokenized, not a prompt at all, an adapter that
        does not fit the model) gets an output with finish_reason 'error' and the reason
        in `error`; the other prompts complete normally.
        """
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(sampling_params)} "
                             "sampling_params: pass one, or one per prompt")

        if (any(p.structured_outputs is not None for p in sampling_params)
                and not self.engine.supports_structured_outputs):
            raise ValueError(STRUCTURED_UNSUPPORTED)
        count = len(prompts)
        scheduling = list(zip(_per_prompt(priority, count, "priority"),
                              _per_prompt(tenant, count, "tenant"),
                              _per_prompt(length_hint, count, "length_hint"),
                              _per_prompt(lora_request, count, "lora_request")))
        deadlines = list(zip(_per_prompt(band, count, "band"),
                             _per_prompt(slo_ttft_ms, count, "slo_ttft_ms"),
                             _per_prompt(slo_tpot_ms, count, "slo_tpot_ms")))
        for (_, _, _, lora), attributes in zip(scheduling, deadlines):
            if lora is not None and not isinstance(lora, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest or None, got {lora!r}")
            check_scheduling(*attributes)
        # Tokenize everything first; a prompt that cannot be tokenized fails alone.
        tokenized = [self._tokenized_or_error(prompt) for prompt in prompts]
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, params, (priority, tenant, hint, lora), (band, ttft, tpot) in zip(
                tokenized, sampling_params, scheduling, deadlines):
            request_id = str(next(self._request_counter))
            order.append(request_id)
            if isinstance(prompt, PromptError):
                results[request_id] = self.driver.processor.reject(request_id, str(prompt))
                continue
            text, token_ids = prompt
            rejected = self.driver.add(request_id, text, token_ids, params, time.monotonic(),
                                       priority, tenant, hint, lora, band, ttft, tpot)
            if rejected is not None:
                results[request_id] = rejected

        self._run([rid for rid in order if rid not in results], results, use_tqdm)
        return [results[rid] for rid in order]

    def _tokenized_or_error(self, prompt: PromptType):
        try:
            return self._prompt_token_ids(prompt)
        except PromptError as exc:
            return exc

    def _run(self, request_ids: list[str], results: dict[str, RequestOutput],
             use_tqdm: bool) -> None:
        pending = set(request_ids)
        progress = tqdm(total=len(pending), desc="Generating", unit="req",
                        disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        tokens_before = self.driver.num_generated_tokens
        # A stall (no step for stall_timeout with work queued) is logged with what the
        # scheduler held; offline there is no probe to fail, the call goes on waiting.
        watchdog = core_watchdog(self.engine, self.config.parallel.stall_timeout)
        watchdog.start()
        try:
            while pending:
                if not self.driver.has_unfinished_requests():
                    raise RuntimeError(f"{len(pending)} requests neither run nor finished")
                for output in self.driver.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        results[output.request_id] = output
                        progress.update(1)
                rate = ((self.driver.num_generated_tokens - tokens_before)
                        / max(time.perf_counter() - start, 1e-9))
                progress.set_postfix_str(f"{rate:.1f} out tok/s", refresh=False)
            while self.engine.num_steps_in_flight:  # overlap_steps: the one submitted last
                self.driver.step()
        except BaseException:
            for request_id in pending:  # leave the engine clean for the next call
                self.driver.abort(request_id)
            raise
        finally:
            watchdog.stop()
            progress.close()

    def get_stats(self) -> dict:
        """Engine-side statistics accumulated since the engine started."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache block no request holds (KV events announce it);
        whether nothing cached is left."""
        return self.engine.reset_prefix_cache()


def _per_prompt(value, count: int, name: str) -> list:
    """One value per prompt: a scalar repeated, or a sequence of exactly `count`."""
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"got {count} prompts but {len(value)} values of {name}: "
                             "pass one, or one per prompt")
        return list(value)
    return [value] * count

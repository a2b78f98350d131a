"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, params)`.

Owns tokenization of string prompts, the loop that steps the engine until every request
of a `generate` call has ended, the progress bar, and the user-facing output objects.
Scheduling and model execution stay in EngineCore.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

from tqdm.auto import tqdm

from treadle.config import EngineConfig
from treadle.engine.core import EngineCore
from treadle.request import Request
from treadle.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = Union[str, list[int], dict[str, Any]]


@dataclass
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """'stop', 'length', 'abort' or 'error'."""


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
    """The result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    error: str | None = None
    """Why the request failed, when its finish_reason is 'error'."""
    metrics: RequestMetrics | None = None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None when the folder has no tokenizer files.

    Without one, the engine still runs on token ids (as vLLM's skip_tokenizer_init);
    string prompts are then refused and output text is empty.
    """
    if not any((Path(model_dir) / name).exists() for name in _TOKENIZER_FILES):
        logger.warning("no tokenizer files in %s: prompts must be token ids", model_dir)
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


class LLM:
    """An engine for offline batch generation."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.config = EngineConfig.from_options(model=model, **engine_options)
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self._request_counter = itertools.count()

    def _prompt_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids "
                                 "({'prompt_token_ids': [...]})")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._prompt_token_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {prompt!r}")

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt that can never run (empty, too long for the context or the KV cache)
        gets an output with finish_reason 'error' and the reason in `error`; the other
        prompts complete normally.
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

        results: dict[str, RequestOutput] = {}
        requests: dict[str, Request] = {}
        order = []
        for prompt, params in zip(prompts, sampling_params):
            text, token_ids = self._prompt_token_ids(prompt)
            request_id = str(next(self._request_counter))
            request = Request(request_id, token_ids, params)
            order.append(request_id)
            results[request_id] = RequestOutput(request_id, text, request.prompt_token_ids)
            rejected = self.engine.add_request(request)
            if rejected is not None:
                results[request_id].error = rejected.error
                results[request_id].outputs.append(CompletionOutput(0, "", [], "error"))
            else:
                requests[request_id] = request

        self._run(requests, results, use_tqdm)
        return [results[rid] for rid in order]

    def _run(self, requests: dict[str, Request], results: dict[str, RequestOutput],
             use_tqdm: bool) -> None:
        pending = set(requests)
        progress = tqdm(total=len(requests), desc="Generating", unit="req",
                        disable=not use_tqdm, dynamic_ncols=True)
        start = time.perf_counter()
        num_output_tokens = 0
        try:
            while pending:
                for out in self.engine.step():
                    num_output_tokens += len(out.new_token_ids)
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        self._finish(requests[out.request_id], results[out.request_id])
                        progress.update(1)
                elapsed = time.perf_counter() - start
                progress.set_postfix_str(f"{num_output_tokens / max(elapsed, 1e-9):.1f} out tok/s",
                                         refresh=False)
        except BaseException:
            for request_id in pending:  # leave the engine clean for the next call
                self.engine.abort_request(request_id)
            raise
        finally:
            progress.close()

    def _finish(self, request: Request, result: RequestOutput) -> None:
        text = ("" if self.tokenizer is None else
                self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True))
        result.outputs.append(CompletionOutput(
            0, text, list(request.output_token_ids), request.finish_reason.value))
        result.metrics = RequestMetrics(request.arrival_time, request.first_scheduled_time,
                                        request.first_token_time, time.monotonic())

    def get_stats(self) -> dict:
        """Engine-side statistics accumulated since the engine started."""
        return self.engine.stats()

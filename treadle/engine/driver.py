"""The path shared by the offline LLM and the AsyncEngine between user requests and the
engine core: add, abort, step.

Owns the one way a user request enters EngineCore (its samples, with their scheduling
attributes, as the OutputProcessor makes them ready) and the one way a step's outputs
come back (processed into RequestOutputs; requests whose stop string matched are stopped
in the core; samples that became ready are added). On the way in, a prompt is cut to
`truncate_prompt_tokens` and `bad_words` / DRY's breakers become token ids (unless the
front end did it already: engine/token_words.py). It holds no request state of its
own: that is the OutputProcessor's and the core's.
"""

from __future__ import annotations

from treadle.core.outputs import EngineCoreOutput
from treadle.engine.core import EngineCore
from treadle.engine.output_processor import OutputProcessor, RequestOutput
from treadle.engine.token_words import TokenWords
from treadle.lora import LoRARequest
from treadle.request import INTERACTIVE
from treadle.sampling_params import SamplingParams


class EngineDriver:
    """EngineCore and OutputProcessor, driven together."""

    def __init__(self, core: EngineCore, tokenizer) -> None:
        self.core = core
        self.processor = OutputProcessor(tokenizer)
        self.words = TokenWords(tokenizer)
        self.num_generated_tokens = 0
        """Tokens the core generated over every step so far."""

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, arrival_time: float, priority: int = 0,
            tenant: str | None = None, length_hint: int | None = None,
            lora_request: LoRARequest | None = None, band: str = INTERACTIVE,
            slo_ttft_ms: float | None = None,
            slo_tpot_ms: float | None = None) -> RequestOutput | None:
        """Add a user request; its final output at once when the core refuses it (the
        request can never run), else None. `band`: interactive, or batch (the lowest
        band under every policy); `slo_ttft_ms` / `slo_tpot_ms`: its deadlines (the
        `slo` policy's); treadle/request.py."""
        error = None
        try:
            params = self.words.resolve(params)
        except ValueError as exc:
            error = str(exc)
        if params.truncate_prompt_tokens is not None:
            prompt_token_ids = prompt_token_ids[-params.truncate_prompt_tokens:]
        self.processor.add_request(request_id, prompt, prompt_token_ids, params,
                                   arrival_time, priority, tenant, length_hint, lora_request,
                                   band, slo_ttft_ms, slo_tpot_ms)
        if error is not None:
            return self.abort(request_id, error=error)
        rejected = self._add_ready(request_id)
        if rejected:
            return self.abort(request_id, error=rejected[0].error)
        return None

    def _add_ready(self, request_id: str) -> list[EngineCoreOutput]:
        """Hand the request's ready samples to the core; the core's rejections."""
        rejected = []
        for request in self.processor.engine_requests(request_id):
            error = self.core.add_request(request)
            if error is not None:
                rejected.append(error)
        return rejected

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """End a user request in the core and in the processor (with `error` as the
        reason, else as aborted); its final output, or None if it is unknown."""
        for engine_id in self.processor.engine_request_ids(request_id):
            self.core.abort_request(engine_id)
        if error is not None:
            return self.processor.reject(request_id, error)
        return self.processor.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """One engine step; the user requests it changed, with their up-to-date outputs."""
        core_outputs = self.core.step()
        self.num_generated_tokens += sum(len(o.new_token_ids) for o in core_outputs)
        outputs, to_stop = self.processor.process(core_outputs)
        for engine_id in to_stop:
            self.core.stop_request(engine_id)
        rejected: list[EngineCoreOutput] = []
        for request_id in self.processor.requests_to_add():
            rejected += self._add_ready(request_id)
        if rejected:
            outputs += self.processor.process(rejected)[0]
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

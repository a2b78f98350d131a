"""EngineCore: one engine step is schedule -> execute -> update.

Owns the scheduler and an executor (treadle/executor), and nothing of the device: the
executor's workers load the model, own the KV tensors and kernels, and report what the
core needs (WorkerInfo). The core sizes the KV cache from that report, and does the
admission check of step 1 of DESIGN.md ("ingest"): a request that can never fit (empty,
longer than the model's context, or larger than the whole KV cache) ends at once with an
error and never reaches the scheduler. With LoRA it keeps the adapters it knows
(engine/lora_registry.py): a request's adapter is checked against the model when it is
first seen, and the scheduler gets the worker's slot count. With `kv_events_endpoint`
set it publishes the prefix cache's changes once per step (treadle/kv_events,
imported only then). It works on token ids only: tokenization, detokenization and
user-facing outputs belong to the layers above. No torch here.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from pathlib import Path

from treadle.config import EngineConfig
from treadle.core.kv.config import kv_cache_config
from treadle.core.outputs import EngineCoreOutput, StepTimings, WorkerInfo
from treadle.core.scheduler import Scheduler
from treadle.engine.limits import EngineLimits
from treadle.engine.lora_registry import LoRARegistry
from treadle.engine.step_observers import StepObservers
from treadle.engine.trace import TraceRecorder, engine_facts
from treadle.executor import make_executor
from treadle.lora import AdapterSpec, LoRARequest
from treadle.models.tokenizer import has_tokenizer
from treadle.request import FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)


def resolve_checkpoint(model: str | None, revision: str | None = None,
                       download_dir: str | None = None, dtype: str = "auto",
                       device: str = "auto", kernel_isa: str = "auto") -> Path:
    """The local checkpoint directory a model string names, as the engine resolves it
    (the default model fetched, a GGUF file converted in the dtype `auto` means on this
    device, a Hub id downloaded: treadle/models/resolve.py). The public way for tools
    (benchmarks, the CLI) to find the checkpoint an engine will load."""
    from treadle.models.resolve import resolve_model  # imports torch: not at module level
    from treadle.worker.device import auto_dtype

    return resolve_model(model, revision, download_dir, dtype,
                         auto=lambda: auto_dtype(device, kernel_isa))


def resolve_model_once(config: EngineConfig) -> EngineConfig:
    """The config with `model` resolved to a local checkpoint directory, done here, once,
    so that no worker rank fetches or converts anything."""
    import dataclasses

    m = config.model
    path = resolve_checkpoint(m.model, m.revision, m.download_dir, m.dtype, m.device,
                              m.kernel_isa)
    return dataclasses.replace(config, model=dataclasses.replace(m, model=str(path)))


class EngineCore:
    """The engine without tokenizer: requests of token ids in, new token ids out."""

    def __init__(self, config: EngineConfig, executor=None) -> None:
        """`executor`: an Executor to use instead of the one the config names (tests)."""
        if executor is None:
            from treadle.worker.threads import prepare_openmp  # no torch: before it loads

            logger.info(prepare_openmp(config.model.omp_wait_policy))
            config = resolve_model_once(config)
        self.config = config
        self.executor = executor if executor is not None else make_executor(config)
        try:
            self.info = info = self.executor.load()
            self._size_cache(info)
        except BaseException:
            self.executor.shutdown()
            raise
        self.model_dir = Path(info.model_dir)
        self.eos_token_id = info.eos_token_id
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.limits = EngineLimits.from_core(self)
        """What a request must fit: the rule admission_error and the server both apply."""
        self.supports_structured_outputs = has_tokenizer(self.model_dir)
        """Grammars need the model's tokenizer (the worker builds them from it)."""
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_kv_blocks,
                                   self.max_model_len, self.num_swap_blocks,
                                   info.preemption_costs, speculative=config.speculative,
                                   spec_costs=info.spec_costs, max_loras=info.num_lora_slots,
                                   layer_groups=self.layer_groups)
        self.loras = (LoRARegistry(info.lora_module_shapes, info.num_layers,
                                   config.lora.max_lora_rank)
                      if config.lora.enable_lora else None)
        """The adapters this engine knows (None: LoRA is off)."""
        self.trace = StepObservers(
            [TraceRecorder(config.scheduler.trace, config.scheduler.scheduling_policy,
                           engine=engine_facts(config, info, self.num_kv_blocks,
                                               self.num_swap_blocks))]
            if config.scheduler.trace else [])
        """What watches each step (treadle.engine.step_observers): the per-step trace file
        when `scheduler.trace` names one, in-memory recorders added later (the server's
        treadle.engine.timeline); falsy when nothing watches."""
        self.timings = StepTimings()
        """The workers' step costs, summed over steps."""
        self.time_recompute_s = 0.0
        """Forward time spent recomputing what recompute preemptions threw away."""
        self._in_flight: deque[tuple] = deque()
        """Submitted steps not answered yet: (SchedulerOutput, step number, start time)."""
        self._overlap = config.scheduler.overlap_steps
        """Submit the next step before returning a step's outputs (docs/overlap.md)."""
        self.kv_events = None
        """The KV-event recorder and publisher (kv_events/engine.py), or None."""
        if config.kv_events.enabled:
            from treadle.kv_events.engine import KVEvents

            try:
                self.kv_events = KVEvents.attach(self.scheduler.kv, config.kv_events,
                                                 config.cache.block_size, info.kv_medium)
            except BaseException:
                self.executor.shutdown()
                raise

    def _size_cache(self, info: WorkerInfo) -> None:
        """Decide the KV config from the workers' report, once (core/kv/config.py: the
        layer groups, their blocks, the swap blocks), and hand it to every worker."""
        cache = self.config.cache
        num_blocks = cache.num_kv_blocks or info.num_kv_blocks
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={cache.kv_cache_memory} holds no block: one block of "
                f"{cache.block_size} tokens needs {info.kv_bytes_per_token * cache.block_size}"
                " bytes")
        if self.config.scheduler.preemption_mode == "swap" and not info.num_swap_blocks:
            logger.warning("preemption_mode=swap with swap_space=%s holds no block: "
                           "preemption falls back to recompute", cache.swap_space)
        logger.info("model %s: %s, %s", info.model_dir, info.dtype, info.kernels)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%s, %d bytes per token, "
                    "%.2f GiB)", num_blocks, cache.block_size, num_blocks * cache.block_size,
                    f"kv_cache_dtype {cache.kv_cache_dtype}", info.kv_bytes_per_token,
                    num_blocks * cache.block_size * info.kv_bytes_per_token / 1024**3)
        self.kv_config = kv_config = kv_cache_config(
            self.config, info.layer_windows, info.max_model_len, num_blocks,
            info.num_swap_blocks)
        """The KV cache's layer groups and block counts, as every worker got them."""
        groups = kv_config.layer_groups
        if groups is not None:
            logger.info(
                "KV layer groups: %d full-attention layers x %d blocks, %d sliding-window "
                "layers (window %d) x %d blocks: %d tokens of context (%d without the "
                "window's saving)", groups.num_full_layers, groups.num_full_blocks,
                groups.num_sliding_layers, groups.window, groups.num_sliding_blocks,
                groups.num_full_blocks * cache.block_size, num_blocks * cache.block_size)
        self.executor.initialize_cache(kv_config)
        self.layer_groups = groups
        self.num_kv_blocks = kv_config.num_blocks  # the context capacity
        self.num_swap_blocks = kv_config.num_swap_blocks
        self.kv_bytes_per_token = info.kv_bytes_per_token

    # ----- requests ------------------------------------------------------------------------

    def admission_error(self, request: Request) -> str | None:
        """Why this request can never run, or None if it can."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            return "prompt is empty: at least one token is needed"
        vocab = self.vocab_size
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            return f"prompt_token_ids contains {bad}, outside the vocabulary [0, {vocab})"
        token_id_error = request.sampling_params.token_id_error(vocab)
        if token_id_error is not None:
            return token_id_error
        if request.lora_request is not None:
            if self.loras is None:
                return (f"lora_request {request.lora_request.lora_name!r}: this engine "
                        "serves no adapters (enable_lora is off)")
            lora_error = self.loras.check(request.lora_request)
            if lora_error is not None:
                return lora_error
        limit = self.limits.length_error(num_prompt, request.sampling_params.max_tokens)
        return None if limit is None else limit.message

    def add_request(self, request: Request) -> EngineCoreOutput | None:
        """Accept a request, or end it at once with an error output if it can never run."""
        if request.eos_token_id is None:
            request.eos_token_id = self.eos_token_id
        error = self.admission_error(request)
        if error is not None:
            request.status = RequestStatus.FINISHED_ERROR
            request.error = error
            return EngineCoreOutput(request.request_id, [], FinishReason.ERROR, error)
        if request.sampling_params.prompt_logprobs is not None:
            # Every prompt position must be computed: a private salt keeps the prefix
            # cache from skipping any (the n samples of one request still share blocks).
            family = request.parent_id or request.request_id
            request.cache_salt = f"{request.cache_salt or ''}\x00prompt-logprobs:{family}"
        self.scheduler.add_request(request)
        if self.trace:
            self.trace.record_arrival(request)
        return None

    def add_lora(self, lora: LoRARequest) -> AdapterSpec:
        """Register an adapter (checked against the model; LoRAError when it does not fit).
        The worker loads its weights when a step first needs them."""
        if self.loras is None:
            raise ValueError("enable_lora is off: this engine serves no adapters")
        return self.loras.add(lora)

    def remove_lora(self, name: str) -> LoRARequest | None:
        """Forget an adapter by name; requests running with it finish with it."""
        return None if self.loras is None else self.loras.remove(name)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.loras is None else self.loras.list()

    def abort_request(self, request_id: str) -> EngineCoreOutput | None:
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        if self.trace:
            self.trace.record_end(request_id, FinishReason.ABORT.value)
        return EngineCoreOutput(request_id, [], FinishReason.ABORT)

    def stop_request(self, request_id: str) -> None:
        """End a request that the output processor found finished (a stop string matched):
        its blocks are freed at once and it is not scheduled again."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        if request is not None and self.trace:
            self.trace.record_end(request_id, FinishReason.STOP.value)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def check_health(self) -> None:
        """Raise executor.WorkerDiedError when a worker is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Wait for the steps in flight (their answers are dropped), stop the workers."""
        try:
            while self._in_flight:
                self._in_flight.popleft()
                self.executor.receive()
        except Exception:  # noqa: BLE001 - a dead worker: stop the rest anyway
            pass
        self.executor.shutdown()
        self.trace.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block no request holds (KV events: their removal, then
        AllBlocksCleared when nothing cached is left); whether the cache is now empty."""
        self.scheduler.kv.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()
        return self.scheduler.kv.pool.num_cached_blocks == 0

    # ----- one step ------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and submit steps until the executor has `max_in_flight` of them
        running (one, unless pipeline stages can overlap), then take the oldest one's
        answer and update the requests with it (and publish the step's KV events)."""
        outputs = self._step()
        if self.kv_events is not None:
            self.kv_events.flush()
        return outputs

    def _submit_steps(self) -> None:
        """Schedule and submit steps while the executor takes more in flight."""
        while len(self._in_flight) < self.executor.max_in_flight:
            t_start = time.monotonic()
            step = self.scheduler.stats.num_steps
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.is_empty and not (scheduler_output.finished_request_ids
                                                  or scheduler_output.preempted_request_ids):
                break  # nothing to run or to tell the workers
            if self.trace:
                self.trace.record_scheduled(step, scheduler_output)
            self.executor.submit(scheduler_output)
            self._in_flight.append((scheduler_output, step, t_start))
            if not scheduler_output.scheduled:
                break

    def _step(self) -> list[EngineCoreOutput]:
        self._submit_steps()
        ended = self.scheduler.take_ended_outputs()  # a policy's refusals (slo_reject)
        if ended and self.trace:
            for output in ended:
                self.trace.record_end(output.request_id, FinishReason.ERROR.value)
        if not self._in_flight:
            return ended
        scheduler_output, step, t_start = self._in_flight.popleft()
        runner_output = self.executor.receive()
        outputs = ended + self.scheduler.update_from_output(scheduler_output, runner_output)
        self.scheduler.observe_step_time(scheduler_output, time.monotonic() - t_start)
        self._add_timings(runner_output.timings, scheduler_output)
        if self.trace and (scheduler_output.scheduled
                                       or scheduler_output.preempted_request_ids):
            spec = self.scheduler.spec
            self.trace.record_step(step, t_start, time.monotonic(), scheduler_output, outputs,
                                   None if spec is None else spec.last_step)
        if self._overlap:
            # The next step runs while the caller processes these outputs; requests it
            # adds meanwhile join the step after, a stop string found ends its request
            # in flight (the row it ran is dropped when the step returns).
            self._submit_steps()
        return outputs

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    def _add_timings(self, t: StepTimings, scheduler_output) -> None:
        total = self.timings
        total.prepare_s += t.prepare_s
        total.forward_s += t.forward_s
        total.sample_s += t.sample_s
        total.swap_s += t.swap_s
        total.comm_s += t.comm_s
        total.propose_s += t.propose_s
        num_tokens = scheduler_output.num_scheduled_tokens
        if num_tokens and scheduler_output.num_recomputed_tokens:
            # The step's forward time, in the share of its tokens that were work redone.
            self.time_recompute_s += (t.forward_s * scheduler_output.num_recomputed_tokens
                                      / num_tokens)
        total.swap_bytes_out += t.swap_bytes_out
        total.swap_bytes_in += t.swap_bytes_in

    def stats(self) -> dict:
        """Engine-side figures for benchmarks and metrics."""
        s = self.scheduler.stats
        kv = self.scheduler.kv
        t = self.timings
        return {
            "num_steps": s.num_steps,
            "mean_batch_size": s.num_scheduled_requests / s.num_steps if s.num_steps else 0.0,
            "batch_slot_efficiency": (s.num_scheduled_requests
                                      / (s.num_steps * self.config.scheduler.max_num_seqs)
                                      if s.num_steps else 0.0),
            "mean_tokens_per_step": s.num_scheduled_tokens / s.num_steps if s.num_steps else 0.0,
            "num_scheduled_tokens": s.num_scheduled_tokens,
            "num_preemptions": s.num_preemptions,
            "num_preemptions_recompute": s.num_preemptions_recompute,
            "num_preemptions_swap": s.num_preemptions_swap,
            "num_admission_preemptions": s.num_admission_preemptions,
            "num_head_bypasses": s.num_head_bypasses,
            "num_kv_compactions": s.num_kv_compactions,
            "num_evicted_tokens": s.num_evicted_tokens,
            "num_swapped": self.scheduler.num_swapped,
            "swap_bytes_out": t.swap_bytes_out,
            "swap_bytes_in": t.swap_bytes_in,
            "prefix_cache_queries": kv.prefix_stats.num_queries,
            "kv_fragmentation": (1.0 - s.used_slots / s.allocated_slots
                                 if s.allocated_slots else 0.0),
            "kv_usage": kv.usage,
            "num_kv_blocks": self.num_kv_blocks,
            "prefix_cache_queried_tokens": kv.prefix_stats.num_queried_tokens,
            "prefix_cache_hit_tokens": kv.prefix_stats.num_hit_tokens,
            "time_prepare_s": t.prepare_s,
            "time_forward_s": t.forward_s,
            "time_sample_s": t.sample_s,
            "time_comm_s": t.comm_s,
            "time_swap_s": t.swap_s,
            "time_recompute_s": self.time_recompute_s,
            "time_propose_s": t.propose_s,
            **(self.scheduler.spec.stats.as_dict() if self.scheduler.spec is not None
               else {}),
        }

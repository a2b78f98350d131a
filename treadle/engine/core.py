"""EngineCore: one engine step is schedule -> execute -> update.

Owns the model, the KV-cache tensors, the scheduler and the model runner, and the
admission check of step 1 of DESIGN.md ("ingest"): a request that can never fit (empty,
longer than the model's context, or larger than the whole KV cache) ends at once with an
error and never reaches the scheduler. It works on token ids only: tokenization,
detokenization and user-facing outputs belong to the layers above.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from treadle.config import EngineConfig
from treadle.core.outputs import EngineCoreOutput
from treadle.core.policy import PreemptionCosts
from treadle.core.scheduler import Scheduler
from treadle.engine.trace import TraceRecorder
from treadle.models.loader import load_model
from treadle.request import FinishReason, Request, RequestStatus
from treadle.worker.cost_probe import measure_copy_bytes_per_s, measure_matmul_flops_per_s
from treadle.worker.kv_cache import KVCacheSpec, allocate_kv_caches, allocate_swap_space
from treadle.worker.model_runner import ModelRunner
from treadle.worker.native_linear import NativeLayerOps

logger = logging.getLogger(__name__)


def resolve_model_dir(config: EngineConfig) -> Path:
    """The checkpoint directory of the configured model (treadle/models/resolve.py)."""
    from treadle.models.resolve import resolve_model
    model = config.model
    return resolve_model(model.model, model.revision, model.download_dir, model.dtype)


def read_eos_token_id(model_dir: Path, hf_config: dict) -> int | None:
    """The end-of-sequence id, from generation_config.json first, then config.json."""
    eos = hf_config.get("eos_token_id")
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id", eos)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos


class EngineCore:
    """The engine without tokenizer: requests of token ids in, new token ids out."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.model.num_threads is not None:
            torch.set_num_threads(config.model.num_threads)
        self.model_dir = resolve_model_dir(config)
        self.model, self.hf_config = load_model(self.model_dir, config.model.dtype)
        self.dtype = next(self.model.parameters()).dtype
        num_packed = self.model.pack_weights()
        if num_packed:
            logger.info("prepacked %d linear weights for the oneDNN bf16 kernel", num_packed)
        self._native = self._load_native()
        layer_ops = (NativeLayerOps.load(self._native.lib)
                     if self._native is not None and self.dtype == torch.bfloat16 else None)
        if layer_ops is not None:
            self.model.use_native_ops(layer_ops)
            logger.info("small-batch bf16 layers (<= %d rows) run the C kernels",
                        layer_ops.max_rows)
        self.eos_token_id = read_eos_token_id(self.model_dir, self.hf_config)
        self.max_model_len = self._resolve_max_model_len()

        cache = config.cache
        spec = KVCacheSpec(self.model.num_layers, self.model.num_kv_heads, self.model.head_dim,
                           self.dtype)
        num_blocks = cache.num_kv_blocks or spec.num_blocks_for_memory(
            cache.kv_cache_memory, cache.block_size)
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={cache.kv_cache_memory} bytes holds no block: one block of "
                f"{cache.block_size} tokens needs {spec.bytes_per_token * cache.block_size} bytes")
        self.num_kv_blocks = num_blocks
        self.kv_bytes_per_token = spec.bytes_per_token
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%d bytes per token, %.2f GiB)",
                    num_blocks, cache.block_size, num_blocks * cache.block_size,
                    spec.bytes_per_token,
                    num_blocks * cache.block_size * spec.bytes_per_token / 1024**3)
        kv_caches = allocate_kv_caches(spec, num_blocks, cache.block_size)
        num_swap_blocks = spec.num_blocks_for_memory(cache.swap_space, cache.block_size)
        if config.scheduler.preemption_mode == "recompute":
            num_swap_blocks = 0
        swap_caches = (allocate_swap_space(spec, num_swap_blocks, cache.block_size)
                       if num_swap_blocks else None)
        if config.scheduler.preemption_mode == "swap" and not num_swap_blocks:
            logger.warning("preemption_mode=swap with swap_space=%d bytes holds no block: "
                           "preemption falls back to recompute", cache.swap_space)
        self.scheduler = Scheduler(config.scheduler, cache, num_blocks, self.max_model_len,
                                   num_swap_blocks, self._preemption_costs(spec))
        self.runner = ModelRunner(self.model, kv_caches, cache.block_size, config.model.seed,
                                  kernels=self._attention_kernels(), swap_caches=swap_caches)
        self.runner.eos_token_id = self.eos_token_id  # masked until min_tokens
        self.trace = (TraceRecorder(config.scheduler.trace, config.scheduler.scheduling_policy)
                      if config.scheduler.trace else None)
        """Per-step trace (treadle.engine.trace), when `scheduler.trace` names a file."""

    def _preemption_costs(self, spec: KVCacheSpec) -> PreemptionCosts | None:
        """Measured rates for preemption_mode=auto (None for the fixed modes)."""
        if self.config.scheduler.preemption_mode != "auto":
            return None
        hidden = self.model.hidden_size
        costs = PreemptionCosts(
            flops_per_token=2.0 * self.model.num_parameters,
            compute_flops_per_s=measure_matmul_flops_per_s(hidden, 4 * hidden, self.dtype),
            kv_bytes_per_token=spec.bytes_per_token,
            copy_bytes_per_s=measure_copy_bytes_per_s())
        logger.info("preemption costs: recompute %.2e s/token, swap %.2e s/token (out + in)",
                    costs.recompute_seconds(1), costs.swap_seconds(1))
        return costs

    def _load_native(self):
        """The compiled C kernels (worker.native.NativeKernels), or None when they cannot
        be built or nothing would use them: the attention backend is torch and the model
        is not bf16 (the small-batch layer kernels are bf16 only)."""
        if self.config.model.attention_backend == "torch" and self.dtype != torch.bfloat16:
            return None
        from treadle.worker.native import load_kernels
        return load_kernels()

    def _attention_kernels(self):
        """The native decode kernels, per `attention_backend` (None: the torch path)."""
        backend = self.config.model.attention_backend
        if backend == "torch":
            return None
        kernels = self._native
        if kernels is not None and kernels.supports(self.dtype):
            return kernels
        if backend == "native":
            raise RuntimeError("attention_backend='native' but the C kernels could not be "
                               "built or do not support " + str(self.dtype))
        return None

    def _resolve_max_model_len(self) -> int:
        model_limit = self.model.max_position_embeddings
        sliding_window = self.model.sliding_window
        if sliding_window is not None and sliding_window < model_limit:
            # Sliding-window attention is not implemented: beyond the window the
            # outputs would differ from the model's, so the context stops there.
            logger.warning("context capped at the sliding window of %d tokens", sliding_window)
            model_limit = sliding_window
        wanted = self.config.model.max_model_len
        if wanted is None:
            return model_limit
        if wanted > model_limit:
            raise ValueError(
                f"max_model_len={wanted} exceeds the model's context of {model_limit} tokens")
        return wanted

    # ----- requests ------------------------------------------------------------------------

    def admission_error(self, request: Request) -> str | None:
        """Why this request can never run, or None if it can."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            return "prompt is empty: at least one token is needed"
        vocab = self.model.vocab_size
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            return f"prompt_token_ids contains {bad}, outside the vocabulary [0, {vocab})"
        token_id_error = request.sampling_params.token_id_error(vocab)
        if token_id_error is not None:
            return token_id_error
        max_tokens = request.sampling_params.max_tokens
        if num_prompt + max_tokens > self.max_model_len:
            return (f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = "
                    f"{num_prompt + max_tokens} exceeds the model's context length of "
                    f"{self.max_model_len} tokens")
        block_size = self.config.cache.block_size
        blocks_needed = -(-(num_prompt + max_tokens) // block_size)
        if blocks_needed > self.num_kv_blocks:
            return (f"prompt + max_tokens = {num_prompt + max_tokens} tokens needs "
                    f"{blocks_needed} KV blocks, more than the whole cache of "
                    f"{self.num_kv_blocks} blocks ({self.num_kv_blocks * block_size} tokens)")
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and num_prompt > sched.max_num_batched_tokens:
            return (f"prompt ({num_prompt} tokens) exceeds max_num_batched_tokens "
                    f"({sched.max_num_batched_tokens}) and chunked prefill is disabled")
        return None

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
        if self.trace is not None:
            self.trace.record_arrival(request)
        return None

    def abort_request(self, request_id: str) -> EngineCoreOutput | None:
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        if request is None:
            return None
        if self.trace is not None:
            self.trace.record_end(request_id, FinishReason.ABORT.value)
        return EngineCoreOutput(request_id, [], FinishReason.ABORT)

    def stop_request(self, request_id: str) -> None:
        """End a request that the output processor found finished (a stop string matched):
        its blocks are freed at once and it is not scheduled again."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        if request is not None and self.trace is not None:
            self.trace.record_end(request_id, FinishReason.STOP.value)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ----- one step ------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        if self.trace is None:
            scheduler_output = self.scheduler.schedule()
            runner_output = self.runner.execute(scheduler_output)
            return self.scheduler.update_from_output(scheduler_output, runner_output)
        t_start = time.monotonic()
        step = self.scheduler.stats.num_steps
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if scheduler_output.scheduled or scheduler_output.preempted_request_ids:
            self.trace.record_step(step, t_start, time.monotonic(), scheduler_output, outputs)
        return outputs

    def stats(self) -> dict:
        """Engine-side figures for benchmarks and metrics."""
        s = self.scheduler.stats
        kv = self.scheduler.kv
        t = self.runner.timings
        return {
            "num_steps": s.num_steps,
            "mean_batch_size": s.num_scheduled_requests / s.num_steps if s.num_steps else 0.0,
            "batch_slot_efficiency": (s.num_scheduled_requests
                                      / (s.num_steps * self.config.scheduler.max_num_seqs)
                                      if s.num_steps else 0.0),
            "mean_tokens_per_step": s.num_scheduled_tokens / s.num_steps if s.num_steps else 0.0,
            "num_preemptions": s.num_preemptions,
            "num_preemptions_recompute": s.num_preemptions_recompute,
            "num_preemptions_swap": s.num_preemptions_swap,
            "num_admission_preemptions": s.num_admission_preemptions,
            "num_head_bypasses": s.num_head_bypasses,
            "num_swapped": self.scheduler.num_swapped,
            "swap_bytes_out": self.runner.num_swap_bytes_out,
            "swap_bytes_in": self.runner.num_swap_bytes_in,
            "prefix_cache_queries": kv.prefix_stats.num_queries,
            "kv_fragmentation": (1.0 - s.used_slots / s.allocated_slots
                                 if s.allocated_slots else 0.0),
            "kv_usage": kv.usage,
            "num_kv_blocks": self.num_kv_blocks,
            "prefix_cache_queried_tokens": kv.prefix_stats.num_queried_tokens,
            "prefix_cache_hit_tokens": kv.prefix_stats.num_hit_tokens,
            "time_prepare_s": t.prepare,
            "time_forward_s": t.forward,
            "time_sample_s": t.sample,
        }

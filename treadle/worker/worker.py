"""A worker: one device, one rank's share of the model (all of it with one rank), its KV
cache.

Owns everything the engine core must not know: the platform, its place among the ranks
(worker/parallel_state.py: joining the process group, the cores it is bound to), loading
its shard of the model, the C kernels and which of them run (linear, elementwise,
attention, sampling), the attention backend, the KV-cache and swap tensors, the
start-up cost probes, and the model runner.
Its life has three calls, made by an executor (treadle/executor): `load()` (model,
kernels, probes -> a WorkerInfo), `initialize_cache(num_kv_blocks, num_swap_blocks)`
(the core decides the block counts from what every worker reported), then
`execute_model(scheduler_output)` once per step. It never decides policy.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from treadle.config import EngineConfig
from treadle.core.outputs import ModelRunnerOutput, SchedulerOutput, WorkerInfo
from treadle.core.policy import PreemptionCosts
from treadle.config import parse_layer_partition
from treadle.models.loader import build_model, read_config
from treadle.models.registry import resolve_model_class
from treadle.worker.attention import make_attention_backend
from treadle.worker.attention.cpu_native import CpuNativeBackend
from treadle.worker.grammar import GrammarState
from treadle.worker.cpu_isa import describe_kernels
from treadle.worker.cost_probe import measure_copy_bytes_per_s, measure_matmul_flops_per_s
from treadle.worker.kv_cache import KVCacheSpec, allocate_kv_caches, allocate_swap_space
from treadle.worker.linear_kernels import DenseLinearKernel, dense_kernel_factory
from treadle.worker.model_runner import ModelRunner
from treadle.worker.native_linear import NativeLayerOps
from treadle.worker.parallel_state import ParallelContext, init_parallel
from treadle.worker.platform import get_platform
from treadle.worker.sampler import Sampler

logger = logging.getLogger(__name__)


def resolve_model_dir(config: EngineConfig) -> Path:
    """The checkpoint directory (EngineCore resolved `model` already; a Worker made
    directly, as benchmarks do, resolves it here: treadle/models/resolve.py)."""
    from treadle.models.resolve import resolve_model

    m = config.model
    return resolve_model(m.model, m.revision, m.download_dir, m.dtype)


def read_eos_token_id(model_dir: Path, hf_config: dict) -> int | None:
    """The end-of-sequence id, from generation_config.json first, then config.json."""
    eos = hf_config.get("eos_token_id")
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id", eos)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos


class Worker:
    """The device side of the engine."""

    def __init__(self, config: EngineConfig, rank: int = 0, init_method: str | None = None,
                 cores: list[int] | None = None) -> None:
        """`rank` among tensor_parallel_size x pipeline_parallel_size ranks, which join
        their process group at `init_method` (a torch.distributed URL); `cores`: the CPU
        cores this rank is bound to (its threads: one per core)."""
        self.config = config
        self.rank = rank
        self.platform = get_platform(config.model.device, rank)
        self.runner: ModelRunner | None = None
        if cores:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        elif config.model.num_threads is not None:
            torch.set_num_threads(config.model.num_threads)
        par = config.parallel
        self.model_dir = resolve_model_dir(config)
        self.hf_config = read_config(self.model_dir)
        if par.world_size > 1:
            self.parallel = init_parallel(
                par.tensor_parallel_size, par.pipeline_parallel_size, rank,
                init_method or "env://", self.platform.dist_backend,
                int(self.hf_config["num_hidden_layers"]),
                parse_layer_partition(par.pp_layer_partition), par.worker_timeout)
        else:
            self.parallel = ParallelContext()

    # ----- start-up --------------------------------------------------------------------------

    def load(self) -> WorkerInfo:
        """Load the model and kernels, probe the machine; report what the core needs."""
        config = self.config
        dtype = self.platform.resolve_dtype(config.model.dtype, config.model.kernel_isa)
        self.model, self.hf_config, self.num_bytes_loaded = build_model(
            self.model_dir, dtype, self.platform.device, self.parallel)
        self.dtype = dtype
        self.native = self._load_native()
        self.layer_ops = (NativeLayerOps.load(self.native.lib)
                          if self.native is not None and dtype == torch.bfloat16 else None)
        num_kernels = self.model.set_kernels(dense_kernel_factory(dtype, self.layer_ops),
                                             self.layer_ops)
        if num_kernels:
            logger.info("linear layers: %d kernels attached (oneDNN prepacked bf16%s)",
                        num_kernels, ", C kernels at <= %d rows" % self.layer_ops.max_rows
                        if self.layer_ops is not None else "")
        self.attention = make_attention_backend(
            config.model.attention_backend, self.platform, self.model.num_kv_heads,
            self.model.head_dim, dtype, kernels=self.native, layer_ops=self.layer_ops)
        self.eos_token_id = read_eos_token_id(self.model_dir, self.hf_config)
        self.max_model_len = self._resolve_max_model_len()
        cache = config.cache
        self.kv_spec = KVCacheSpec(self.model.num_local_layers, self.model.num_kv_heads,
                                   self.model.head_dim, dtype, self.attention.kv_layout)
        num_swap_blocks = (0 if config.scheduler.preemption_mode == "recompute" else
                           self.kv_spec.num_blocks_for_memory(cache.swap_space, cache.block_size))
        kernels = f"attention backend {self.attention.name}"
        if self.platform.uses_native_kernels:
            kernels += "; " + describe_kernels(
                self.native, dtype, self.model.head_dim, self.layer_ops,
                native_attention=self.attention.name == "cpu-native")
        return WorkerInfo(
            model_dir=str(self.model_dir), dtype=str(dtype).replace("torch.", ""),
            vocab_size=self.model.vocab_size, eos_token_id=self.eos_token_id,
            max_model_len=self.max_model_len, num_parameters=self._whole_model_parameters(),
            kv_bytes_per_token=self.kv_spec.bytes_per_token,
            num_kv_blocks=self.kv_spec.num_blocks_for_memory(cache.kv_cache_memory,
                                                             cache.block_size),
            num_swap_blocks=num_swap_blocks, preemption_costs=self._preemption_costs(),
            attention_backend=self.attention.name, kernels=kernels)

    def _whole_model_parameters(self) -> int:
        """Parameters of the whole model, not of this rank's shard (counted on a copy built
        on the meta device, which allocates nothing)."""
        if self.parallel.world_size == 1:
            return self.model.num_parameters
        with torch.device("meta"):
            whole = resolve_model_class(self.hf_config.get("architectures"))(
                self.hf_config, self.dtype)
        return whole.num_parameters

    def initialize_cache(self, num_kv_blocks: int, num_swap_blocks: int) -> None:
        """Allocate the KV cache and swap space the core decided on; make the runner."""
        block_size = self.config.cache.block_size
        device = self.platform.device
        kv_caches = allocate_kv_caches(self.kv_spec, num_kv_blocks, block_size, device)
        swap_caches = (allocate_swap_space(self.kv_spec, num_swap_blocks, block_size,
                                           self.platform.pin_swap_memory)
                       if num_swap_blocks else None)
        sampler = Sampler(self.config.model.seed, self._sampler_kernels(), device)
        self.runner = ModelRunner(self.model, kv_caches, self.attention, block_size,
                                  num_kv_blocks, self.max_model_len, sampler, device,
                                  swap_caches, self.kv_spec.block_dim, self.eos_token_id,
                                  self.parallel,
                                  GrammarState(self.model_dir, self.model.vocab_size,
                                               self.eos_token_id))

    def _load_native(self):
        """The compiled C kernels (worker.native.NativeKernels), or None when they cannot
        be built, the platform has none, or nothing would use them: the attention backend
        is not cpu-native and the model is not bf16 (the layer kernels are bf16 only)."""
        if not self.platform.uses_native_kernels:
            return None
        backend = self.config.model.attention_backend
        if backend in ("torch", "reference") and self.dtype != torch.bfloat16:
            return None
        from treadle.worker.native import load_kernels
        return load_kernels(self.config.model.kernel_isa)

    def _sampler_kernels(self):
        """The C sampling kernel runs with the cpu-native attention backend; the other
        backends are the all-torch path."""
        return self.native if self.attention.name == "cpu-native" else None

    def _preemption_costs(self) -> PreemptionCosts | None:
        """Measured rates for preemption_mode=auto (None for the fixed modes)."""
        if self.config.scheduler.preemption_mode != "auto":
            return None
        hidden = self.model.hidden_size
        costs = PreemptionCosts(
            flops_per_token=2.0 * self.model.num_parameters,
            compute_flops_per_s=measure_matmul_flops_per_s(hidden, 4 * hidden, self.dtype),
            kv_bytes_per_token=self.kv_spec.bytes_per_token,
            copy_bytes_per_s=measure_copy_bytes_per_s())
        logger.info("preemption costs: recompute %.2e s/token, swap %.2e s/token (out + in)",
                    costs.recompute_seconds(1), costs.swap_seconds(1))
        return costs

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

    # ----- steps -----------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """One step; the output on the output rank (parallel_state), None on the others."""
        return self.runner.execute(scheduler_output)

    @property
    def is_output_rank(self) -> bool:
        return self.parallel.is_output_rank

    def set_layer_kernels(self, enabled: bool) -> None:
        """Switch the small-batch C layer kernels (linear, norms, rope + K/V write) on or
        off, for side-by-side benchmarks and tests; the results agree up to rounding."""
        self.use_native_kernels(self.native, self.layer_ops if enabled else None)

    def use_native_kernels(self, kernels, layer_ops) -> None:
        """Run on another build of the C kernels (`kernels`: worker.native.NativeKernels of
        some ISA level, for attention and sampling; `layer_ops`: its NativeLayerOps, or None
        for torch's layers) — for benchmarks comparing builds in one engine."""
        for module in self.model.modules():
            if isinstance(getattr(module, "kernel", None), DenseLinearKernel):
                module.kernel.native = layer_ops
        if isinstance(self.model.lm_head_kernel, DenseLinearKernel):
            self.model.lm_head_kernel.native = layer_ops
        self.model.ops = layer_ops
        for module in self.model.modules():
            if hasattr(module, "ops"):
                module.ops = layer_ops
        if isinstance(self.attention, CpuNativeBackend):
            self.attention.kernels = kernels
            self.attention.layer_ops = layer_ops
        if self.runner is not None and self.runner.sampler.kernels is not None:
            self.runner.sampler.kernels = kernels

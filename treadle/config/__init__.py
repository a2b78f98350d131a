"""Engine configuration: one frozen dataclass per area, aggregated by EngineConfig.

Every knob of the engine is a field here with a one-line help text in its metadata;
the command-line flags of `treadle generate`, `treadle serve` and the benchmarks are
generated from these fields (`add_config_arguments`), and `LLM(model=..., **options)`
accepts the same names as keyword arguments (`EngineConfig.from_options`).
This package validates values; it never loads a model or allocates memory. Its modules:
values.py (registries and parsers), one module per area (model, cache, scheduler,
parallel, lora_spec), engine.py (EngineConfig), args.py (the command-line flags).
"""

from treadle.config.values import (AUTO, DEFAULT_SCHEDULING_POLICY, ENV_PREFIX,
                                   KERNEL_ISA_CHOICES, KERNEL_ISA_LEVELS, OMP_ENV_MARKER,
                                   OMP_WAIT_POLICIES, QUANTIZATION_CHOICES,
                                   SCHEDULING_POLICIES, SPECULATIVE_OPTION, _help,
                                   parse_int_list, parse_layer_partition, parse_size,
                                   parse_tenant_weights)
from treadle.config.model import ModelConfig
from treadle.config.cache import CacheConfig
from treadle.config.scheduler import SchedulerConfig
from treadle.config.parallel import ParallelConfig
from treadle.config.lora_spec import SPEC_METHODS, LoRAConfig, SpeculativeConfig
from treadle.config.engine import EngineConfig
from treadle.config.args import (add_config_arguments, add_dataclass_arguments,
                                 dataclass_from_args, options_from_args)

__all__ = [
    "AUTO",
    "DEFAULT_SCHEDULING_POLICY",
    "ENV_PREFIX",
    "KERNEL_ISA_CHOICES",
    "KERNEL_ISA_LEVELS",
    "OMP_ENV_MARKER",
    "OMP_WAIT_POLICIES",
    "QUANTIZATION_CHOICES",
    "SCHEDULING_POLICIES",
    "SPECULATIVE_OPTION",
    "SPEC_METHODS",
    "parse_int_list",
    "parse_layer_partition",
    "parse_size",
    "parse_tenant_weights",
    "ModelConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ParallelConfig",
    "LoRAConfig",
    "SpeculativeConfig",
    "EngineConfig",
    "add_config_arguments",
    "add_dataclass_arguments",
    "dataclass_from_args",
    "options_from_args",
    "_help",
]

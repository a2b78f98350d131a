"""LoRA adapters as the engine names and checks them: `LoRARequest`, and the PEFT files read
without torch.

Owns what an adapter is to the engine (vLLM's `LoRARequest(lora_name, lora_int_id,
lora_path)`), and the check of a PEFT adapter folder (adapter_config.json +
adapter_model.safetensors) against the model it is meant for: which tensors it has, of
which layers and modules, their ranks and the scaling of each (lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA; PEFT's rank_pattern and alpha_pattern per module), read
from the JSON header of the safetensors file, never its data. The engine core checks an
adapter with it when the adapter is registered (so a bad one is refused with an error
naming what does not fit, before any request uses it), and the worker's loader
(worker/lora/loader.py) reads the tensors it lists. Pure Python: no torch here.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")
"""The linear layers an adapter may target (PEFT's names)."""
_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_DTYPES = {"F32", "F16", "BF16"}
_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                     r"([a-z_]+)\.lora_(A|B)\.weight$")
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class LoRAError(ValueError):
    """An adapter that cannot be used with this engine; the message says why."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's names).

    `lora_int_id` identifies the adapter inside one engine (>= 1); the same id always
    means the same adapter (name and path), so it keys the worker's caches and the root
    of the prefix-cache hash chain."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError("lora_path must name the adapter's folder")
        object.__setattr__(self, "lora_path", str(self.lora_path))


@dataclass(frozen=True)
class ModuleAdapter:
    """One adapted linear layer: tensor names in the file, rank, scaling."""

    layer: int
    module: str
    """PEFT's module name, e.g. 'q_proj'."""
    rank: int
    scaling: float
    a_name: str
    b_name: str
    dtype: str
    """safetensors dtype of the tensors: F32, F16 or BF16."""


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: every module it changes, with rank and scaling."""

    path: str
    weights_file: str
    modules: dict[tuple[int, str], ModuleAdapter] = field(default_factory=dict)
    """(layer, module) -> what the adapter has there."""

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def target_modules(self) -> list[str]:
        return sorted({m for _, m in self.modules}, key=SUPPORTED_MODULES.index)


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern that matches the end
    of the module's name (peft.utils.other.get_pattern_key)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def read_adapter_config(path: str | Path) -> dict:
    """adapter_config.json of an adapter folder, checked for what the engine supports."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise LoRAError(f"adapter folder {str(folder)!r} does not exist")
    if not config_path.is_file():
        raise LoRAError(f"{config_path} not found: a PEFT adapter folder needs "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{config_path} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{config_path} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"{config_path}: peft_type {peft_type!r} is not supported; only LORA")
    unsupported = [(key, value) for key, value in (
        ("bias", config.get("bias", "none") not in (None, "none")),
        ("use_dora", bool(config.get("use_dora"))),
        ("lora_bias", bool(config.get("lora_bias"))),
        ("fan_in_fan_out", bool(config.get("fan_in_fan_out"))),
        ("modules_to_save", bool(config.get("modules_to_save"))),
        ("trainable_token_indices", bool(config.get("trainable_token_indices"))),
        ("layer_replication", bool(config.get("layer_replication"))),
    ) if value]
    if unsupported:
        names = ", ".join(f"{k}={config.get(k)!r}" for k, _ in unsupported)
        raise LoRAError(f"{config_path}: {names} is not supported (plain LoRA on "
                        f"{', '.join(SUPPORTED_MODULES)} only)")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{config_path}: r must be an int >= 1, got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAError(f"{config_path}: lora_alpha must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        bad = [t for t in targets if str(t).rpartition(".")[2] not in SUPPORTED_MODULES]
        if bad:
            raise LoRAError(f"{config_path}: target_modules {bad} are not supported; "
                            f"supported: {', '.join(SUPPORTED_MODULES)}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise LoRAError(f"{config_path}: {key} must be an object")
    return config


def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, data_offsets} from a safetensors file's header."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER_BYTES:
                raise LoRAError(f"{path}: header of {size} bytes is not a safetensors header")
            header = json.loads(f.read(size))
    except LoRAError:
        raise
    except (OSError, ValueError, struct.error) as exc:
        raise LoRAError(f"{path} is not a readable safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise LoRAError(f"{path}: the safetensors header is not an object")
    header.pop("__metadata__", None)
    return header


def inspect_adapter(path: str | Path, module_shapes: dict[str, tuple[int, int]],
                    num_layers: int, max_rank: int) -> AdapterSpec:
    """Check a PEFT adapter against a model: its modules must be among `module_shapes`
    (module -> (in_features, out_features) of the whole model), its layers below
    `num_layers`, every rank at most `max_rank`, every A [r, in] and B [out, r] of the
    model's shape. Raises LoRAError naming what does not fit."""
    folder = Path(path)
    config = read_adapter_config(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        extra = (" (a pickled adapter_model.bin is not read: save with safetensors)"
                 if (folder / "adapter_model.bin").exists() else "")
        raise LoRAError(f"{weights} not found{extra}")
    header = read_safetensors_header(weights)
    use_rslora = bool(config.get("use_rslora", False))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, entry in header.items():
        match = _TENSOR.match(name)
        if match is None:
            raise LoRAError(f"{weights}: tensor {name!r} is not supported (only lora_A / "
                            f"lora_B of {', '.join(SUPPORTED_MODULES)} in model.layers.N)")
        layer, block, module, which = match.groups()
        layer = int(layer)
        if module not in SUPPORTED_MODULES:
            raise LoRAError(f"{weights}: tensor {name!r} targets {module}; supported: "
                            f"{', '.join(SUPPORTED_MODULES)}")
        if (block == "self_attn") != (module in _ATTENTION_MODULES):
            raise LoRAError(f"{weights}: tensor {name!r}: {module} is not in {block}")
        if module not in module_shapes:
            raise LoRAError(f"{weights}: the model has no {module} to adapt")
        if layer >= num_layers:
            raise LoRAError(f"{weights}: tensor {name!r} is for layer {layer}, but the "
                            f"model has {num_layers} layers")
        if entry.get("dtype") not in _DTYPES:
            raise LoRAError(f"{weights}: tensor {name!r} has dtype {entry.get('dtype')!r}; "
                            "supported: F32, F16, BF16")
        found.setdefault((layer, module), {})[which] = name
    modules: dict[tuple[int, str], ModuleAdapter] = {}
    for (layer, module), pair in sorted(found.items()):
        key = f"model.layers.{layer}.{'self_attn' if module in _ATTENTION_MODULES else 'mlp'}" \
              f".{module}"
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAError(f"{weights}: {key} has no {missing}.weight")
        a_shape = list(header[pair["A"]].get("shape") or [])
        b_shape = list(header[pair["B"]].get("shape") or [])
        in_features, out_features = module_shapes[module]
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise LoRAError(f"{weights}: {key}: lora_A {a_shape} and lora_B {b_shape} are "
                            "not [r, in] and [out, r] of one rank r")
        rank = a_shape[0]
        if a_shape[1] != in_features or b_shape[0] != out_features:
            raise LoRAError(f"{weights}: {key}: the adapter is for a base layer of "
                            f"(in {a_shape[1]}, out {b_shape[0]}), the model's {module} is "
                            f"(in {in_features}, out {out_features})")
        if rank > max_rank:
            raise LoRAError(f"{weights}: {key} has rank {rank}, above max_lora_rank="
                            f"{max_rank}")
        configured = _pattern_value(rank_pattern, key, config["r"])
        if configured != rank:
            raise LoRAError(f"{weights}: {key} has rank {rank}, adapter_config.json says "
                            f"{configured}")
        alpha = _pattern_value(alpha_pattern, key, config.get("lora_alpha", config["r"]))
        scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        dtype = header[pair["A"]]["dtype"]
        if header[pair["B"]]["dtype"] != dtype:
            raise LoRAError(f"{weights}: {key}: lora_A and lora_B have different dtypes")
        modules[(layer, module)] = ModuleAdapter(layer, module, rank, float(scaling),
                                                 pair["A"], pair["B"], dtype)
    if not modules:
        raise LoRAError(f"{weights} holds no LoRA weights")
    return AdapterSpec(str(folder), str(weights), modules)

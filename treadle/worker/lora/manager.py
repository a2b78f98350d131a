"""The worker's LoRA manager: which adapters are resident, loading and evicting them, and
the per-step segments every LoRA layer reads.

Owns two least-recently-used caches: up to `max_loras` adapters resident in the slots (on
the device, in the layout the LoRA kernel reads; a step only runs adapters that are
there), and up to `max_cpu_loras` adapters read into host memory (so that an adapter
evicted from its slot comes back without reading its files again). An adapter a step
needs and that is in neither is read from its folder (weights.py). It wraps the kernel of
every linear layer an adapter may change with a `LoRALinearKernel` (layers.py) at start.
The scheduler guarantees that a step never needs more adapters than there are slots
(core/scheduler.py); the manager only carries that out: it never decides which requests
run. Its counters (loads, evictions) are for tests and benchmarks.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch

from treadle.config import LoRAConfig
from treadle.lora import LoRARequest
from treadle.worker.lora.layers import LoRALinearKernel, LoRAStep, TorchLoRAOps, plain_linear
from treadle.worker.lora.weights import AdapterWeights, load_adapter

logger = logging.getLogger(__name__)


class AdapterLoadError(RuntimeError):
    """An adapter's files could not be read when a step needed it (they changed since the
    adapter was registered): the requests that run it fail, the engine goes on."""


@dataclass
class LoRAStats:
    num_disk_loads: int = 0
    """Adapters read from their files."""
    num_slot_loads: int = 0
    """Adapters put into a slot."""
    num_slot_evictions: int = 0
    num_cpu_evictions: int = 0


class LoRAManager:
    """Adapter slots and host cache of one worker, and the LoRA layers of its model."""

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, device: torch.device,
                 dtype: torch.dtype, ops=None, pin_memory: bool = False,
                 weight_dtype: torch.dtype | None = None) -> None:
        self.config = config
        self.device, self.dtype = device, dtype
        self.weight_dtype = dtype if weight_dtype is None else weight_dtype
        """The adapters' dtype, the platform's choice (Platform.lora_weight_dtype: fp32
        under a bf16 / fp16 model on CPU, layers.py says why); the model's by default."""
        self.pin_memory = pin_memory
        self.targets = model.lora_targets()
        self.module_shapes = model.lora_module_shapes()
        self.num_layers = model.num_layers
        self.step = LoRAStep(ops if ops is not None else TorchLoRAOps())
        self.weight_precision = getattr(self.step.ops, "weight_precision", None)
        """A dtype the ops keep the adapters in (the C kernel's bf16): the weights are
        rounded to it once at load, so that the torch path, which takes a request's long
        prompt chunks, computes with the same values as the kernel."""
        for index, target in enumerate(self.targets):
            linear = target.linear
            base = linear.kernel or plain_linear(linear.weight, linear.kernel_bias)
            linear.kernel = LoRALinearKernel(base, index, self.step)
        self._slots: OrderedDict[int, AdapterWeights] = OrderedDict()
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.stats = LoRAStats()

    @property
    def num_slots(self) -> int:
        return self.config.max_loras

    @property
    def ops_name(self) -> str:
        return self.step.ops.name

    def resident(self) -> list[int]:
        """Ids of the adapters in the slots, least recently used first."""
        return list(self._slots)

    def cached(self) -> list[int]:
        """Ids of the adapters in host memory, least recently used first."""
        return list(self._host)

    def begin_step(self, segments: list[tuple[LoRARequest, int, int]]) -> dict[int, str]:
        """Make every adapter of the step resident, then publish its segments: (adapter,
        first token, end token) of the flat batch. Returns the adapters that could not be
        loaded (id -> why): their segments are left out, so those rows run on the base
        model, and the runner fails their requests alone."""
        needed: dict[int, LoRARequest] = {}
        for lora, _, _ in segments:
            needed.setdefault(lora.lora_int_id, lora)
        if len(needed) > self.num_slots:
            raise RuntimeError(f"a step uses {len(needed)} adapters, more than the "
                               f"{self.num_slots} slots (max_loras): a scheduler bug")
        failed: dict[int, str] = {}
        for lora in needed.values():
            try:
                self._make_resident(lora, needed)
            except AdapterLoadError as exc:
                logger.warning("%s", exc)
                failed[lora.lora_int_id] = str(exc)
        self.step.set_segments([(self._slots[lora.lora_int_id], start, end)
                                for lora, start, end in segments
                                if lora.lora_int_id not in failed])
        return failed

    def end_step(self) -> None:
        self.step.set_segments([])

    def _make_resident(self, lora: LoRARequest, keep: dict[int, LoRARequest]) -> None:
        lora_id = lora.lora_int_id
        if lora_id in self._slots:
            self._slots.move_to_end(lora_id)
            return
        host = self._host_weights(lora)
        if len(self._slots) >= self.num_slots:
            victim = next(i for i in self._slots if i not in keep)
            del self._slots[victim]
            self.stats.num_slot_evictions += 1
            logger.debug("LoRA slot of adapter %d evicted", victim)
        self._slots[lora_id] = host.to(self.device)
        self.stats.num_slot_loads += 1

    def _host_weights(self, lora: LoRARequest) -> AdapterWeights:
        lora_id = lora.lora_int_id
        host = self._host.get(lora_id)
        if host is not None:
            self._host.move_to_end(lora_id)
            return host
        try:
            host = load_adapter(lora, self.targets, self.module_shapes, self.num_layers,
                                self.config.max_lora_rank, self.weight_dtype,
                                self.pin_memory)
        except Exception as exc:  # noqa: BLE001 - checked when registered (LoRAError), so
            # the files changed since: deleted, rewritten, truncated (safetensors' own errors)
            raise AdapterLoadError(f"adapter {lora.lora_name!r} (lora_int_id {lora_id}) "
                                   f"could not be loaded: {exc}") from exc
        if self.weight_precision is not None:
            host.round_to(self.weight_precision)
        self.stats.num_disk_loads += 1
        logger.info("LoRA adapter %r (id %d) read from %s: %.1f MiB", lora.lora_name,
                    lora_id, lora.lora_path, host.num_bytes / 2**20)
        while len(self._host) >= self.config.num_cpu_loras:
            self._host.popitem(last=False)
            self.stats.num_cpu_evictions += 1
        self._host[lora_id] = host
        return host

"""LoRA in the worker: adapter weights (weights.py), the LoRA term of a linear layer over a
batch of adapter segments (layers.py), and the manager of resident and cached adapters
(manager.py). The policy side (which requests may run together) is the scheduler's."""

from treadle.worker.lora.manager import LoRAManager, LoRAStats

__all__ = ["LoRAManager", "LoRAStats"]

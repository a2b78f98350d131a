"""PEFT adapters for the LoRA tests: random A and B on a checkpoint the test made."""

from __future__ import annotations

from pathlib import Path

import torch

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: str, path: Path, rank: int, seed: int, alpha: float | None = None,
                 rslora: bool = False, modules: list[str] = MODULES) -> str:
    """A PEFT adapter with random A and B, large enough to change greedy tokens
    (lora_alpha 2 x rank unless given)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(
        r=rank, lora_alpha=2 * rank if alpha is None else alpha, use_rslora=rslora,
        target_modules=modules, init_lora_weights=False))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(3.0)
    peft_model.save_pretrained(str(path))
    return str(path)
